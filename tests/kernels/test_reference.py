"""The CPU reference decode attention against plain per-sequence attention, padded and grouped."""
from __future__ import annotations

import pytest
import torch

from kernels import reference


def naive_decode(query, kv_cache, tables, lens, scale):
    """softmax(q K^T) V per sequence over exactly its own tokens, GQA by repeating KV heads."""
    group = query.shape[1] // kv_cache.shape[3]
    outs = []
    for q, table, n in zip(query, tables, lens.tolist()):
        k, v = reference.gather_kv(kv_cache, table, n)                # [n, kvh, d]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(outs)


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_decode_attention_matches_per_sequence_attention(order):
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, head_dim, block_size, num_blocks = 40, 6, 2, 16, 4, 800
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    lens = torch.randint(1, 70, (batch,), generator=g)
    if order == "sorted":                           # as the model runner orders a decode batch
        lens = lens.sort().values
    width = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[:batch * width].view(batch, width)
    query = torch.randn(batch, heads, head_dim, generator=g)
    groups = reference._decode_groups(lens.tolist(), block_size)
    assert (len(groups) > 1) == (order == "sorted")          # sorted and spread: the grouped path
    out = reference.decode_attention(query, kv_cache, tables, lens, 0.25)
    torch.testing.assert_close(out, naive_decode(query, kv_cache, tables, lens, 0.25), rtol=1e-5, atol=1e-5)


def test_decode_groups_only_where_they_save():
    assert reference._decode_groups([5] * 32, 16) == [(0, 32, 1)]                  # nothing to save
    lens = list(range(1, 161, 5))                                                  # 32 rows, 1..156
    groups = reference._decode_groups(lens, 16)
    assert [(a, b) for a, b, _ in groups] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert all(w == -(-lens[b - 1] // 16) for _, b, w in groups)
    assert reference._decode_groups(lens[::-1], 16) == [(0, 32, 10)]               # not sorted
