"""How a CPU worker takes memory from the OS: the KV cache as an anonymous mapping of its own, and
glibc's malloc told to keep the memory a step frees for the next step.

Both are about page faults on the step's path: a page the process has not touched yet faults on
first write (the kernel maps and zeroes it), and on a CPU engine these were 2-18% of a prefill's time
(docs/perf/journal.md §34).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# The largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD = 32 << 20
# Freed memory at the top of the heap is handed back to the OS only beyond this.
TRIM_THRESHOLD = 1 << 30


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU, over an anonymous mapping of its own: the kernel's pages are zero
    until written, so nothing is written now (torch.zeros spent 0.39 s of a 1.15 s engine start
    filling a 2.2 GB cache), only the blocks in use are resident, and freeing the tensor unmaps it
    (what a replica put to sleep gives back). A block's first write faults its pages in (~5,800
    faults in `write_kv` for a 1,024-token prefill of the embedded model on fresh blocks); asking for
    transparent huge pages (MADV_HUGEPAGE) cut that to ~100 but made the prefill ~30 ms slower, the
    kernel zeroing (and compacting for) 2 MiB at each fault (journal §34)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)   # (it keeps the mapping)


@functools.cache
def keep_freed_memory() -> bool:
    """Tell glibc's malloc (where it is the allocator) to keep what a step frees for the next step:
    allocations up to MMAP_THRESHOLD from the heap (not each its own mapping) and freed heap memory
    kept up to TRIM_THRESHOLD. By default glibc adapts both as blocks come and go, and a process
    could settle in a state where a step's activations were fresh mappings every time: in one of
    four runs a 1,024-token prefill took 35,000 page faults and 400 ms against 5,800 and 335-355 ms
    (journal §34). Once per process; returns whether glibc took both settings."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):       # not glibc (musl has no mallopt)
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        logger.info("glibc's mallopt refused the step's malloc settings; keeping its defaults")
    return ok
