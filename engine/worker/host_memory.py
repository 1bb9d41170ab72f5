"""How a CPU worker takes memory from the OS: the KV cache as an anonymous mapping of its own, its
pages faulted in ahead of use by a thread that runs only when a core is idle, and glibc's malloc told
to keep the memory a step frees for the next step.

All three are about page faults on the step's path: a page the process has not touched yet faults on
first write (the kernel maps and zeroes it), and on a CPU engine these were 2-18% of a prefill's time
(docs/perf/journal.md §34), ~20% of a 1,024-token prefill on fresh blocks in a VM (§60).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import math
import mmap
import os
import platform
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# madvise(2): fault a range's pages in writable, their contents unchanged (Linux 5.14+).
_MADV_POPULATE_WRITE = 23
# madvise(2)'s system call number, which the prefault calls through libc's syscall(2) rather than
# libc's madvise: UCX (NIXL's transport) rewrites libc's madvise, mmap, munmap, ... at run time to
# watch the address space, and a prefault thread inside madvise while an engine's NIXL agent started
# crashed the replica (SIGSEGV in that call; journal §61). libc's syscall it leaves alone.
_SYS_MADVISE = {"x86_64": 28, "aarch64": 233, "riscv64": 233, "ppc64le": 205, "s390x": 219}.get(platform.machine())
PAGE = mmap.PAGESIZE
# Bytes a prefault call advises: small, so that a call preempted at idle priority holds the address
# space's lock (which an mmap or munmap of the engine's waits for) only briefly.
CHUNK_BYTES = 256 << 10

# The largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD = 32 << 20
# Freed memory at the top of the heap is handed back to the OS only beyond this.
TRIM_THRESHOLD = 1 << 30


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU, over an anonymous mapping of its own: the kernel's pages are zero
    until written, so nothing is written now (torch.zeros spent 0.39 s of a 1.15 s engine start
    filling a 2.2 GB cache), only the blocks in use are resident, and freeing the tensor unmaps it
    (what a replica put to sleep gives back). A block's first write faults its pages in (~5,800
    faults in `write_kv` for a 1,024-token prefill of the embedded model on fresh blocks), unless
    `prefault_in_background` got there first; asking for transparent huge pages (MADV_HUGEPAGE) cut
    that to ~100 but made the prefill ~30 ms slower, the kernel zeroing (and compacting for) 2 MiB at
    each fault (journal §34)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)   # (it keeps the mapping)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library through ctypes (whose calls let go of the GIL; errno kept), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Tell glibc's malloc (where it is the allocator) to keep what a step frees for the next step:
    allocations up to MMAP_THRESHOLD from the heap (not each its own mapping) and freed heap memory
    kept up to TRIM_THRESHOLD. By default glibc adapts both as blocks come and go, and a process
    could settle in a state where a step's activations were fresh mappings every time: in one of
    four runs a 1,024-token prefill took 35,000 page faults and 400 ms against 5,800 and 335-355 ms
    (journal §34). Once per process; returns whether glibc took both settings."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:                     # not Linux, or not glibc (musl has no mallopt)
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        logger.info("glibc's mallopt refused the step's malloc settings; keeping its defaults")
    return ok


def prefault_enabled() -> bool:
    """`PDSERVE_KV_PREFAULT` (default 1): whether a CPU KV cache's pages are faulted in ahead of use."""
    value = os.environ.get("PDSERVE_KV_PREFAULT", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PDSERVE_KV_PREFAULT must be 0 or 1; got {value!r}")
    return value == "1"


def block_ranges(tensors: Sequence[torch.Tensor], num_blocks: int, b0: int, b1: int) -> list[tuple[int, int]]:
    """The page-aligned byte ranges (address, length) that blocks [b0, b1) of `tensors` take: each
    tensor shaped (2, num_blocks, ...) and contiguous (K's blocks, then V's), so two ranges a tensor."""
    ranges = []
    for t in tensors:
        block_bytes = t.nbytes // (2 * num_blocks)
        for half in range(2):
            start = t.data_ptr() + (half * num_blocks + b0) * block_bytes
            end = t.data_ptr() + (half * num_blocks + b1) * block_bytes
            start, end = start // PAGE * PAGE, -(-end // PAGE) * PAGE
            ranges.append((start, end - start))
    return ranges


def _raw_madvise(libc: ctypes.CDLL) -> Callable[[int, int, int], int]:
    """madvise(addr, length, advice) -> 0, or -1 with errno set: the system call itself (libc's
    syscall), or libc's madvise on an architecture whose call number `_SYS_MADVISE` lacks."""
    if _SYS_MADVISE is None:
        call = libc["madvise"]          # (its own function object: argtypes set on it alone)
        call.argtypes, call.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        return call
    syscall = libc["syscall"]
    syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    syscall.restype = ctypes.c_long
    return functools.partial(syscall, _SYS_MADVISE)


def prefault(live: Callable[[], list[torch.Tensor] | None], num_blocks: int, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Fault in the pages of the KV tensors `live()` returns (made by `zeroed`, each shaped
    (2, num_blocks, ...)), block by block from block 0, contents unchanged (MADV_POPULATE_WRITE: the
    engine may be writing some blocks meanwhile), about `chunk_bytes` a call. `live()` is asked again
    at each chunk and the tensors held while it is advised (so they stay mapped); it stops once
    `live()` returns None. OSError where the OS cannot (EINVAL before Linux 5.14; ENOSYS off Linux)."""
    libc = _libc()
    if libc is None:
        raise OSError(errno.ENOSYS, "madvise(MADV_POPULATE_WRITE) is Linux's")
    madvise = _raw_madvise(libc)
    tensors = live()
    if not tensors or num_blocks <= 0:
        return
    step = max(1, chunk_bytes // max(1, sum(t.nbytes for t in tensors) // num_blocks))
    del tensors
    batched = _batched_madvise()
    for b0 in range(0, num_blocks, step):
        tensors = live()
        if tensors is None:
            return
        ranges = block_ranges(tensors, num_blocks, b0, min(num_blocks, b0 + step))
        if batched is not None:         # the chunk's ranges in one call: the GIL taken back once
            code = batched([a for a, _ in ranges], [n for _, n in ranges], _MADV_POPULATE_WRITE)
        else:
            code = next((e for address, length in ranges if (e := _advise(madvise, address, length))), 0)
        if code != 0:
            raise OSError(code, f"madvise(MADV_POPULATE_WRITE): {os.strerror(code)}")
        del tensors


def _advise(madvise: Callable[[int, int, int], int], address: int, length: int) -> int:
    """One range through ctypes: 0, or the errno (EINTR retried)."""
    while madvise(address, length, _MADV_POPULATE_WRITE) != 0:
        code = ctypes.get_errno()
        if code != errno.EINTR:
            return code
    return 0


def _batched_madvise() -> Callable[[list[int], list[int], int], int] | None:
    """The CPU kernels' madvise over many ranges (kernels/csrc/host_memory.cpp: madvise_ranges), where
    the extension is loaded: a thread at idle priority that takes the GIL back after every range's
    call, descheduled while holding it, stalls the step's thread each time (journal §67)."""
    try:
        return torch.ops.pdserve_cpu.madvise_ranges
    except (AttributeError, RuntimeError):
        return None


def prefault_in_background(tensors: Sequence[torch.Tensor], num_blocks: int) -> threading.Thread | None:
    """`prefault` on a thread that runs only when a core is idle (SCHED_IDLE): the cache is
    resident before the engine writes it, as vLLM's and llama.cpp's caches (zeroed at start) are,
    without delaying the engine's start or taking from its steps. An engine's first requests after
    its start otherwise fault their blocks in, ~20% of a 1,024-token prefill in a VM (journal §60).
    The thread holds the tensors only while it advises a chunk, so freeing the cache stops it, and
    so does the main thread's end; on a kernel without the call (before 5.14) it logs that and ends.
    None where prefaulting is off (`PDSERVE_KV_PREFAULT=0`), the tensors are not the CPU's, or the
    OS is not Linux.

    Not a daemon: an engine freed while a chunk is advised leaves the thread the cache's last owner,
    and unmapping it lets go of the GIL; a daemon doing that as the interpreter shuts down is ended
    inside torch's buffer deleter, which aborts the process (`terminate called without an active
    exception`, exit 134; journal §64). The interpreter waits for this thread instead, at most the
    chunk it is in, since it stops once the main thread has."""
    if not tensors or any(t.device.type != "cpu" for t in tensors) or not prefault_enabled() or _libc() is None:
        return None
    refs = [weakref.ref(t) for t in tensors]

    def live() -> list[torch.Tensor] | None:
        if not threading.main_thread().is_alive():          # the interpreter is shutting down
            return None
        held = [r() for r in refs]
        return None if any(t is None for t in held) else held   # type: ignore[misc]

    def run() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))      # this thread only
        except (AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        started = time.perf_counter()
        try:
            prefault(live, num_blocks)
        except OSError as e:        # EINVAL: before Linux 5.14; ENOMEM: the memory is not there
            logger.info("the KV cache's pages fault in at first use, not ahead (%s)", e)
            return
        logger.debug("KV cache faulted in (%d blocks) in %.1f s", num_blocks, time.perf_counter() - started)

    thread = threading.Thread(target=run, name="kv-prefault", daemon=False)
    thread.start()
    return thread
