"""Sliding-window attention and score soft-capping in every kernel set (the torch reference, the C++
CPU kernels, Triton under its interpreter without CUDA, at fp32), each against a per-token loop written from the
definition: the query at position p sees keys p - window + 1 .. p, and a capped score is
softcap * tanh(score / softcap) (transformers' Mistral / Gemma 2). The blocks before a window hold
large garbage (a freed block's slot may point anywhere): no kernel may weigh them."""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:    # Triton's CPU interpreter (set before Triton is imported; tests/kernels/test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import cpu_ops, reference, triton_attention


@pytest.fixture(scope="module", autouse=True)
def built():
    return cpu_ops.load()


def kernel_sets():
    return [("reference", reference), ("cpu", cpu_ops), ("triton", triton_attention)]


def naive(query_rows, positions, k_seq, v_seq, scale, window, softcap):
    """[rows, H, d] queries at `positions` against one sequence's [L, kvh, d] keys/values."""
    heads, kv_heads = query_rows.shape[1], k_seq.shape[1]
    out = torch.empty_like(query_rows)
    for r, p in enumerate(positions):
        lo = max(0, p - window + 1) if window else 0
        for h in range(heads):
            kh = h // (heads // kv_heads)
            s = (k_seq[lo:p + 1, kh] @ query_rows[r, h]) * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            out[r, h] = torch.softmax(s, 0) @ v_seq[lo:p + 1, kh]
    return out


def paged(lens, kv_heads, head_dim, block_size, window, seed=0):
    """A cache holding each sequence's K/V in random blocks; the blocks wholly before the last
    window of a sequence are poisoned with 1e4 (what a freed block may hold by the next read)."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 2
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    seqs = []
    for i, n in enumerate(lens):
        kv = reference.gather_blocks(cache, tables[i]).flatten(1, 2)[:, :n].clone()
        seqs.append(kv)
    return cache, tables, seqs


def poison_before(cache, table, first_needed, block_size):
    for b in range(first_needed // block_size):
        cache[:, table[b]] = 1e4


@pytest.mark.parametrize("window,softcap", [(5, 0.0), (20, 0.0), (0, 1.5), (7, 2.0)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_with_window_and_softcap(window, softcap, block_size):
    lens = [1, 6, 17, 40, 70]
    heads, kv_heads, d = 6, 2, 32
    cache, tables, seqs = paged(lens, kv_heads, d, block_size, window)
    if window:
        for i, n in enumerate(lens):
            poison_before(cache, tables[i], n - window, block_size)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(len(lens), heads, d, generator=g)
    expected = torch.cat([naive(query[i:i + 1], [n - 1], seqs[i][0], seqs[i][1], 0.3, window, softcap)
                          for i, n in enumerate(lens)])
    for name, kernels in kernel_sets():
        out = kernels.decode_attention(query, cache, tables, torch.tensor(lens), 0.3, window=window, softcap=softcap)
        assert torch.allclose(out, expected, atol=2e-5, rtol=1e-4), name


@pytest.mark.parametrize("window,softcap", [(5, 0.0), (20, 0.0), (0, 1.5), (7, 2.0)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_with_window_and_softcap(window, softcap, block_size):
    """Full prefills, chunks after a cached prefix and single rows, across 16-row tiles."""
    query_lens, seq_lens = [9, 40, 5, 33, 1], [9, 40, 50, 70, 23]
    heads, kv_heads, d = 4, 2, 16
    cache, tables, seqs = paged(seq_lens, kv_heads, d, block_size, window)
    if window:
        for i, (q, n) in enumerate(zip(query_lens, seq_lens)):
            poison_before(cache, tables[i], n - q - window + 1, block_size)
    g = torch.Generator().manual_seed(2)
    query = torch.randn(sum(query_lens), heads, d, generator=g)
    parts, start = [], 0
    for i, (q, n) in enumerate(zip(query_lens, seq_lens)):
        parts.append(naive(query[start:start + q], list(range(n - q, n)), seqs[i][0], seqs[i][1], 0.25,
                           window, softcap))
        start += q
    expected = torch.cat(parts)
    block_tables = [t for t in tables]
    for name, kernels in kernel_sets():
        out = kernels.prefill_attention(query, cache, block_tables, query_lens, seq_lens, 0.25, window=window,
                                        softcap=softcap)
        assert torch.allclose(out, expected, atol=2e-5, rtol=1e-4), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernels_with_window_in_half_precision(dtype):
    """The C++ kernels' half-precision path against the reference on the same (rounded) inputs."""
    lens = [3, 30, 64]
    cache, tables, _ = paged(lens, 2, 64, 16, 24)
    cache = cache.to(dtype)
    query = torch.randn(len(lens), 8, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    args = (query, cache, tables, torch.tensor(lens), 0.125)
    out = cpu_ops.decode_attention(*args, window=24, softcap=3.0)
    ref = reference.decode_attention(*(a.float() if a.is_floating_point() else a for a in args[:2]), *args[2:],
                                     window=24, softcap=3.0)
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_cpu_kernels_refuse_negative_window():
    cache, tables, _ = paged([4], 1, 16, 4, 0)
    with pytest.raises(RuntimeError, match="window and softcap must be >= 0"):
        torch.ops.pdserve_cpu.paged_decode(torch.zeros(1, 1, 16), cache, tables, torch.tensor([4]), 1.0, 1.0, 1.0,
                                           -1, 0.0)
