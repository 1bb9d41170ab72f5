"""How a CPU worker takes memory from the OS (engine/worker/host_memory.py): glibc's malloc keeps a
step's freed activations for the next step, and the KV cache is a lazily mapped zero tensor whose
pages a thread of idle priority faults in ahead of use, contents unchanged."""
from __future__ import annotations

import gc
import os
import pathlib
import platform
import resource
import subprocess
import sys

import pytest
import torch

from engine.worker import host_memory
from engine.worker.host_memory import (
    MMAP_THRESHOLD,
    PAGE,
    block_ranges,
    keep_freed_memory,
    prefault,
    prefault_in_background,
    zeroed,
)

GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC or not sys.platform.startswith("linux"),
                    reason="mallopt is glibc's (other allocators keep their defaults); per-thread rusage is Linux's")
def test_freed_activations_are_reused_without_page_faults():
    """After keep_freed_memory, allocating, writing and freeing a step-sized tensor again and again
    faults its pages in until the heap has settled, then no more (20 rounds of 16 MiB would be ~82k
    faults of fresh pages)."""
    assert keep_freed_memory()
    size = 16 << 20
    assert size < MMAP_THRESHOLD
    pages = size // 4096
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # every fault on this thread: counted per thread, so that another
    try:                         # thread's faults (an engine's cache faulted in) do not count

        def round_faults() -> int:
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            torch.empty(size, dtype=torch.uint8).fill_(1)
            return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

        # The first rounds fault their pages in: each freed block is 64 bytes short of the next
        # aligned request (posix_memalign's padding) until the heap holds a few. Measured: 2-12
        # rounds, now and then one without faults among them (a freed block that fitted); then none.
        quiet = 0
        for _ in range(64):
            quiet = quiet + 1 if round_faults() < pages // 10 else 0
            if quiet == 3:
                break
        assert quiet == 3, "in 64 rounds the heap never settled (3 rounds in a row without faults)"
        faults = sum(round_faults() for _ in range(20))
    finally:
        torch.set_num_threads(threads)
    assert faults < pages, faults


def test_zeroed_cpu_tensor_is_zero_and_writable():
    t = zeroed((2, 3, 16, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (2, 3, 16, 2, 8) and t.dtype == torch.bfloat16 and not t.any()
    t[1, 2] = 1.5
    assert t.sum().item() == 1.5 * 16 * 2 * 8
    assert zeroed((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)


LINUX = sys.platform.startswith("linux")
SHAPE = (2, 64, 16, 4, 64)          # (K/V, blocks, block size, heads, head size): 2 MiB of float32


def write_faults(t: torch.Tensor) -> int:
    """Minor page faults taken while writing one element on each page of `t` (kept unchanged)."""
    flat = t.view(torch.uint8).view(-1)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt       # (one thread: a small copy)
    flat[::PAGE].copy_(flat[::PAGE].clone())
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def prefault_supported() -> bool:
    try:
        prefault(lambda: [zeroed((2, 1, 16, 1, 64), torch.float32, torch.device("cpu"))], 1)
    except OSError:
        return False
    return True


def test_block_ranges_cover_each_block_s_k_and_v_page_aligned():
    t = zeroed(SHAPE, torch.float32, torch.device("cpu"))
    block = t[0, 0].nbytes
    ranges = block_ranges([t], 64, 8, 12)
    assert len(ranges) == 2
    for (address, length), half in zip(ranges, (0, 1)):
        first = t.data_ptr() + (half * 64 + 8) * block
        assert address % PAGE == 0 and length % PAGE == 0
        assert address <= first and first + 4 * block <= address + length < first + 4 * block + PAGE + block


@pytest.mark.skipif(not LINUX, reason="MADV_POPULATE_WRITE is Linux's")
@pytest.mark.parametrize("calls", ["batched", "per_range"])
def test_prefault_makes_the_cache_resident_and_keeps_what_it_holds(calls, monkeypatch):
    """Written blocks keep their values; afterwards writes take no page faults, where a cache left
    to fault in at first use takes one a page. Both ways of calling madvise: a chunk's ranges in one
    call to the CPU kernels' library, or one ctypes call a range (where the library is not loaded)."""
    if calls == "batched":
        from kernels import cpu_ops

        cpu_ops.load()
        assert host_memory._batched_madvise() is not None
    else:
        monkeypatch.setattr(host_memory, "_batched_madvise", lambda: None)
    cold, warm = (zeroed(SHAPE, torch.float32, torch.device("cpu")) for _ in range(2))
    warm[0, 5].fill_(1.5)
    warm[1, 40].fill_(-2.0)
    pages = warm.nbytes // PAGE
    try:
        prefault(lambda: [warm], 64, chunk_bytes=64 << 10)
    except OSError as e:
        pytest.skip(f"this kernel cannot prefault (Linux 5.14+): {e}")
    assert warm[0, 5].eq(1.5).all() and warm[1, 40].eq(-2.0).all()
    assert warm.abs().sum().item() == (1.5 + 2.0) * warm[0, 5].numel()
    assert write_faults(warm) < pages // 8
    assert write_faults(cold) > pages // 2


@pytest.mark.skipif(not LINUX, reason="MADV_POPULATE_WRITE is Linux's")
def test_background_prefault_finishes_and_ends_once_the_cache_is_freed(monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_PREFAULT", "1")
    t = zeroed(SHAPE, torch.float32, torch.device("cpu"))
    thread = prefault_in_background([t], 64)
    assert thread is not None and not thread.daemon     # (the interpreter waits for it: the test below)
    thread.join(timeout=300)             # it runs when a core is idle: no deadline, only a bound
    assert not thread.is_alive()
    assert write_faults(t) < t.nbytes // PAGE // 8 or not prefault_supported()
    big = zeroed((2, 2048, 16, 4, 64), torch.float32, torch.device("cpu"))   # 64 MiB
    thread = prefault_in_background([big], 2048)
    del big
    gc.collect()
    thread.join(timeout=300)
    assert not thread.is_alive()


def test_prefault_switch(monkeypatch):
    t = zeroed(SHAPE, torch.float32, torch.device("cpu"))
    monkeypatch.setenv("PDSERVE_KV_PREFAULT", "0")
    assert prefault_in_background([t], 64) is None
    monkeypatch.setenv("PDSERVE_KV_PREFAULT", "yes")
    with pytest.raises(ValueError, match="PDSERVE_KV_PREFAULT must be 0 or 1"):
        prefault_in_background([t], 64)


@pytest.mark.skipif(not LINUX, reason="MADV_POPULATE_WRITE is Linux's")
def test_prefault_stops_at_the_chunk_where_the_cache_is_gone():
    """What the background thread sees once the cache is freed (its weak references dead): no further
    chunk is advised. Blocks 0-15 (one chunk) are resident, the rest still fault at first write."""
    if not prefault_supported():
        pytest.skip("this kernel cannot prefault (Linux 5.14+)")
    t = zeroed(SHAPE, torch.float32, torch.device("cpu"))
    calls = []

    def live() -> list[torch.Tensor] | None:
        calls.append(1)
        return [t] if len(calls) <= 2 else None      # the size probe, the first chunk, then gone

    prefault(live, 64, chunk_bytes=16 * t[:, 0].nbytes)
    assert len(calls) == 3
    first_pages = 2 * t[0, :16].nbytes // PAGE
    assert sum(write_faults(t[h, :16]) for h in range(2)) < first_pages // 8
    rest_pages = 2 * t[0, 16:].nbytes // PAGE
    assert sum(write_faults(t[h, 16:]) for h in range(2)) > rest_pages // 2


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter at the repository's root, the prefault on (a bound, no deadline)."""
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600,
                          cwd=str(pathlib.Path(__file__).parents[2]), env={**os.environ, "PDSERVE_KV_PREFAULT": "1"})


EXIT_CHECK = """
import gc, sys, time
import torch
from engine.worker import host_memory
record = open(sys.argv[1], "w", buffering=1)
raw = host_memory._raw_madvise

def slow(libc):                 # each call preempted for 0.5 s, as on a busy machine
    call = raw(libc)
    def madvise(address, length, advice):
        time.sleep(0.5)
        result = call(address, length, advice)
        record.write(f"call done, finalizing {sys.is_finalizing()}\\n")
        return result
    return madvise

host_memory._raw_madvise = slow
t = host_memory.zeroed((2, 1024, 16, 4, 64), torch.float32, torch.device("cpu"))    # 32 MiB
thread = host_memory.prefault_in_background([t], 1024)
time.sleep(0.2)                 # the thread is inside its first chunk, holding the cache
del t
gc.collect()
print("main done", flush=True)
"""


@pytest.mark.skipif(not LINUX, reason="MADV_POPULATE_WRITE is Linux's")
def test_a_prefault_holding_the_last_reference_ends_before_the_interpreter(tmp_path):
    """An engine freed while its prefault advises a chunk leaves the thread the cache's last owner.
    As a daemon the thread was stopped in the middle of unmapping it as the interpreter shut down,
    inside torch's buffer deleter: the process aborted with 134 (any script that freed an LLM and
    exited; journal §64). Now the interpreter waits for the chunk, the thread stops there (the main
    thread has ended), and the process exits 0."""
    if not prefault_supported():
        pytest.skip("this kernel cannot prefault (Linux 5.14+)")
    record = tmp_path / "record"
    out = run_script(EXIT_CHECK, str(record))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "main done" in out.stdout
    calls = record.read_text().splitlines()        # the chunk's calls (its blocks' K and V), then it stopped
    assert calls and set(calls) == {"call done, finalizing False"}, calls


UCX_PATCH_CHECK = """
import ctypes, os
import torch
from engine.worker import host_memory
libc = ctypes.CDLL("libc.so.6")
def code(name):
    return bytes((ctypes.c_ubyte * 16).from_address(ctypes.cast(libc[name], ctypes.c_void_p).value))
before = {n: code(n) for n in ("madvise", "syscall")}
t = host_memory.zeroed((2, 256, 16, 4, 64), torch.float32, torch.device("cpu"))   # 8 MiB
thread = host_memory.prefault_in_background([t], 256)       # running while the agent starts
os.environ.setdefault("UCX_NET_DEVICES", "lo")
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("check", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
agent.register_memory(t)
thread.join()
host_memory.prefault(lambda: [t], 256)                      # and after it
called = host_memory._raw_madvise(host_memory._libc()).func.__name__
print("madvise", before["madvise"] != code("madvise"), "syscall", before["syscall"] != code("syscall"), "calls", called)
"""


@pytest.mark.skipif(not LINUX or not GLIBC or platform.machine() != "x86_64",
                    reason="reads the code of glibc on x86-64 Linux")
def test_the_prefault_calls_no_libc_function_ucx_rewrites():
    """UCX (NIXL's transport) rewrites libc's madvise as an agent starts (journal §61: a prefault
    thread inside it then crashed two replicas); the prefault makes its system call through libc's
    syscall, which UCX leaves alone, here while an agent starts and after."""
    pytest.importorskip("nixl", reason="needs nixl: make setup installs it")
    out = run_script(UCX_PATCH_CHECK)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.endswith("syscall False calls syscall"), line   # what the prefault calls is untouched
