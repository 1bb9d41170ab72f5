"""What a sleeping replica gives back to its machine (cluster/replica.py: `EngineReplica.sleep`):
its engine let go whole, the freed heap returned to the OS, a checkpoint's pages dropped from the
page cache, and the process' resident memory measured."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import sys
import time
import weakref
from typing import Any

logger = logging.getLogger(__name__)

# The files a checkpoint's weights live in (a directory's), whose pages level 2 drops.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


async def engine_released(engine: Any, timeout_s: float = 5.0) -> bool:
    """Return once nothing but the caller holds a shut-down AsyncLLMEngine's LLMEngine (its weights
    and KV cache freed with it): the cancelled step loop lets go of its frames over a few turns of
    the event loop, and the engine's objects hold reference cycles only the collector frees. False
    (and logged) if it is still held after `timeout_s`."""
    gone = weakref.ref(engine.engine)
    engine.engine = None
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        if gone() is None:
            return True
        if time.monotonic() > deadline:
            logger.warning("the engine put to sleep is still referenced; its memory stays held")
            return False
        await asyncio.sleep(0.05)


def resident_bytes() -> int:
    """This process' resident set size (bytes)."""
    import psutil  # noqa: PLC0415 - Ray's own dependency

    return psutil.Process().memory_info().rss


def release_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc keeps freed small allocations in its
    arenas; torch's large tensors are their own mappings, gone once freed), and on a GPU the blocks
    torch's caching allocator keeps reserved after the engine's tensors are freed (else the device
    memory stays taken for this process)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def drop_page_cache(model_path: str) -> int:
    """Ask the OS to drop the page cache of the checkpoint at `model_path` (a file, or a
    directory's weight files), so that loading it again reads the disk; the bytes it covered."""
    if os.path.isdir(model_path):
        paths = [os.path.join(model_path, n) for n in sorted(os.listdir(model_path)) if n.endswith(WEIGHT_SUFFIXES)]
    else:
        paths = [model_path]
    dropped = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            logger.warning("cannot drop %s from the page cache: %s", path, e)
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += os.fstat(fd).st_size
        except (OSError, AttributeError) as e:          # (not on every OS)
            logger.warning("cannot drop %s from the page cache: %s", path, e)
        finally:
            os.close(fd)
    return dropped
