"""How a CPU worker takes memory from the OS (engine/worker/host_memory.py): glibc's malloc keeps a
step's freed activations for the next step, and the KV cache is a lazily mapped zero tensor."""
from __future__ import annotations

import platform
import resource

import pytest
import torch

from engine.worker.host_memory import MMAP_THRESHOLD, keep_freed_memory, zeroed

GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's; other allocators keep their own defaults")
def test_freed_activations_are_reused_without_page_faults():
    """After keep_freed_memory, allocating, writing and freeing a step-sized tensor again and again
    faults its pages in once, not every time (20 rounds of 16 MiB would be ~82k faults of fresh pages)."""
    assert keep_freed_memory()
    size = 16 << 20
    assert size < MMAP_THRESHOLD
    torch.empty(size, dtype=torch.uint8).fill_(1)       # the first round may fault its pages in
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.empty(size, dtype=torch.uint8).fill_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 2 * size // 4096, faults


def test_zeroed_cpu_tensor_is_zero_and_writable():
    t = zeroed((2, 3, 16, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (2, 3, 16, 2, 8) and t.dtype == torch.bfloat16 and not t.any()
    t[1, 2] = 1.5
    assert t.sum().item() == 1.5 * 16 * 2 * 8
    assert zeroed((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)
