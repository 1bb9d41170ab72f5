"""Batches the CPU kernel tests share (test_cpu_ops.py, test_cpu_prefill.py): paged decode batches,
prefill segments over random blocks, the error measure and its bound per dtype."""
from __future__ import annotations

import torch

# Relative error ||out - ref|| / ||ref|| allowed per dtype; both sides accumulate in fp32, so bf16 and
# fp16 differ by the output's rounding (and, in bf16 prefill on AVX512-BF16, by the softmax weights'
# rounding to bf16: ~2.0e-3 against ~1.6e-3 measured).
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def paged_batch(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    query = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return query, cache, tables, torch.tensor(lens)


def prefill_batch(query_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                  block_size: int, dtype: torch.dtype, seed: int = 0):
    """Segments laid end to end, segment i the last query_lens[i] of seq_lens[i] tokens; each table
    a random set of pool blocks, exactly as long as its sequence needs."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g)
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    query = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    return query, cache, tables


# Full prefills across block and 16-row tile boundaries, and chunks that attend to a cached prefix.
PREFILL_QUERY_LENS = [1, 15, 16, 17, 40, 5, 20, 33]
PREFILL_SEQ_LENS = [1, 15, 16, 17, 40, 49, 100, 70]
