"""The compiled CPU prefill attention (kernels/csrc/prefill_attention.cpp) against the torch
reference: full prefills and chunks after a cached prefix across block and tile boundaries, the bf16
dot-product kernel and the fp32 one it falls back to, items of two to eight tiles, SDPA for long
segments, other block sizes, the step's packed tables, strided query rows, bad tables and lengths
refused.
"""
from __future__ import annotations

import pytest
import torch
from cpu_batches import PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, TOLERANCE, prefill_batch, rel_err

from kernels import cpu_ops, reference


@pytest.fixture(scope="module", autouse=True)
def built():
    return cpu_ops.load()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 4, 2), (64, 9, 3), (128, 28, 4), (32, 8, 8), (96, 5, 1)])
def test_prefill_matches_reference(dtype, head_dim, heads, kv_heads):
    query, cache, tables = prefill_batch(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, heads, kv_heads, head_dim, 16, dtype)
    out = cpu_ops.prefill_attention(query, cache, tables, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == query.shape
    ref = reference.prefill_attention(query.float(), cache.float(), tables, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS,
                                      head_dim ** -0.5)
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_reads_strided_query_rows(dtype):
    """The query as the model passes it: a view of the QKV projection's output (each row's heads
    contiguous, rows further apart), read where it lies with the bits of its contiguous copy; an odd
    row stride (the bf16 kernel reads pairs) too."""
    query, cache, tables = prefill_batch(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 9, 3, 64, 16, dtype)
    want = cpu_ops.prefill_attention(query, cache, tables, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 0.125)
    for row in (15 * 64, 15 * 64 + 1):
        flat = torch.zeros(query.shape[0] * row, dtype=dtype)
        strided = flat.as_strided(query.shape, (row, 64, 1))
        strided.copy_(query)
        out = cpu_ops.prefill_attention(strided, cache, tables, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 0.125)
        assert out.is_contiguous() and torch.equal(out, want), row


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (24, 0.0), (0, 3.0)])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 16, 4), (16, 4, 2)])
def test_prefill_bf16_dot_products_and_the_fp32_fallback(monkeypatch, window, softcap, head_dim, heads, kv_heads):
    """bf16 prefill runs on AVX512-BF16's dot products where this CPU has them (the default) and
    through the fp32 kernel that every other CPU runs (PDSERVE_CPU_BF16_DOT=0 forces it here). Both
    match the reference over several 32-key chunks, partial tiles, a chunk after a cached prefix,
    windows, soft caps and peaked scores; on an AVX512-BF16 CPU the two are different code (their
    roundings differ), elsewhere the switch changes nothing."""
    query_lens, seq_lens = [100, 37, 1, 64], [100, 130, 50, 64]
    query, cache, tables = prefill_batch(query_lens, seq_lens, heads, kv_heads, head_dim, 16, torch.bfloat16)
    shape = {"window": window, "softcap": softcap}
    outs = {}
    for q in (query, query * 8):
        ref = reference.prefill_attention(q.float(), cache.float(), tables, query_lens, seq_lens, head_dim ** -0.5,
                                          **shape)
        for dot in ("1", "0"):
            monkeypatch.setenv("PDSERVE_CPU_BF16_DOT", dot)
            outs[dot] = cpu_ops.prefill_attention(q, cache, tables, query_lens, seq_lens, head_dim ** -0.5, **shape)
            assert outs[dot].dtype == torch.bfloat16 and rel_err(outs[dot], ref) < TOLERANCE[torch.bfloat16], dot
    assert torch.equal(outs["1"], outs["0"]) != torch.cpu._is_avx512_bf16_supported()


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (40, 0.0), (0, 3.0)])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 16, 4), (96, 5, 5), (64, 8, 1)])
def test_prefill_on_amx_tiles_and_the_dot_product_fallback(monkeypatch, window, softcap, head_dim, heads, kv_heads):
    """bf16 prefill runs on AMX tiles where this CPU has AMX-BF16 (the default; query heads two at a
    time, an odd one alone) and on AVX512-BF16's dot products with PDSERVE_CPU_AMX_ATTENTION=0. Both
    match the reference over full prompts longer than SDPA_MIN_QUERY_LEN (no segment goes to SDPA
    while the kernel runs on tiles), chunks after a cached prefix, partial tiles and chunks, windows,
    soft caps and peaked scores; on an AMX CPU the two are different code, elsewhere the switch
    changes nothing. A head size not a multiple of 32, an fp8 or fp32 cache never take the tiles."""
    query_lens, seq_lens = [300, 37, 1, 64], [300, 130, 50, 64]
    query, cache, tables = prefill_batch(query_lens, seq_lens, heads, kv_heads, head_dim, 16, torch.bfloat16)
    shape = {"window": window, "softcap": softcap}
    built = torch.ops.pdserve_cpu.prefill_amx_built()
    assert cpu_ops.amx_prefill(torch.bfloat16, torch.bfloat16, head_dim) == built
    assert not cpu_ops.amx_prefill(torch.bfloat16, torch.bfloat16, 16)
    assert not cpu_ops.amx_prefill(torch.bfloat16, cpu_ops.FP8_DTYPE, head_dim)
    assert not cpu_ops.amx_prefill(torch.float32, torch.float32, head_dim)
    outs = {}
    for q in (query, query * 8):
        ref = reference.prefill_attention(q.float(), cache.float(), tables, query_lens, seq_lens, head_dim ** -0.5,
                                          **shape)
        for amx in ("1", "0"):
            monkeypatch.setenv("PDSERVE_CPU_AMX_ATTENTION", amx)
            assert cpu_ops.amx_prefill(torch.bfloat16, torch.bfloat16, head_dim) == (built and amx == "1")
            outs[amx] = cpu_ops.prefill_attention(q, cache, tables, query_lens, seq_lens, head_dim ** -0.5, **shape)
            assert outs[amx].dtype == torch.bfloat16 and rel_err(outs[amx], ref) < TOLERANCE[torch.bfloat16], amx
    assert torch.equal(outs["1"], outs["0"]) != built


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("query_lens,seq_lens", [([300], [300]), ([40, 9], [90, 9]), ([512, 200], [700, 200])])
def test_prefill_items_of_two_four_and_eight_tiles(dtype, query_lens, seq_lens):
    """With AVX-512 the kernels take up to eight 16-row tiles a work item at head sizes under 128 (the
    bf16 dot-product kernel and the fp32 one), fewer where a step's rows would leave a thread short of
    items: with one thread and one KV head these segments make items of four tiles (300 rows), two (40
    and 9) and eight (512 and 200, after cached prefixes). Each matches the reference (on AVX2 the
    fp32 kernel's fixed two tiles run them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        query, cache, tables = prefill_batch(query_lens, seq_lens, 4, 1, 64, 16, dtype)
        out = cpu_ops.prefill_attention(query, cache, tables, query_lens, seq_lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    ref = reference.prefill_attention(query.float(), cache.float(), tables, query_lens, seq_lens, 0.125)
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_long_segments_through_sdpa(monkeypatch, dtype):
    """With PDSERVE_CPU_PREFILL_SDPA=1 (the AMX default), segments of SDPA_MIN_QUERY_LEN rows or more
    run through SDPA, full prompts and chunks after a cached prefix alike, the rest through the C++
    kernel in one call; all of them match the reference, and fp32 never leaves the C++ kernel."""
    monkeypatch.setenv("PDSERVE_CPU_PREFILL_SDPA", "1")
    n = cpu_ops.SDPA_MIN_QUERY_LEN
    query_lens, seq_lens = [n + 2, 5, n + 70, 17, n], [n + 2, 5, n + 130, 40, n + 1]
    assert cpu_ops.sdpa_segments(dtype, query_lens) == [0, 2, 4]
    assert cpu_ops.sdpa_segments(torch.float32, query_lens) == []
    query, cache, tables = prefill_batch(query_lens, seq_lens, 9, 3, 64, 16, dtype)
    out = cpu_ops.prefill_attention(query, cache, tables, query_lens, seq_lens, 0.125)
    ref = reference.prefill_attention(query.float(), cache.float(), tables, query_lens, seq_lens, 0.125)
    assert out.dtype == dtype and rel_err(out, ref) < TOLERANCE[dtype]
    monkeypatch.setenv("PDSERVE_CPU_PREFILL_SDPA", "0")
    assert cpu_ops.sdpa_segments(dtype, query_lens) == []
    assert rel_err(cpu_ops.prefill_attention(query, cache, tables, query_lens, seq_lens, 0.125), ref) < TOLERANCE[dtype]
    monkeypatch.setenv("PDSERVE_CPU_PREFILL_SDPA", "1")
    with pytest.raises(RuntimeError, match="needs more blocks than the block table"):
        cpu_ops.prefill_attention(query, cache, tables, query_lens, [*seq_lens[:4], seq_lens[4] + 16], 0.125)
    with pytest.raises(RuntimeError, match="query_lens sum to"):
        cpu_ops.prefill_attention(query[1:], cache, tables, query_lens, seq_lens, 0.125)
    monkeypatch.setenv("PDSERVE_CPU_PREFILL_SDPA", "yes")
    with pytest.raises(ValueError, match="PDSERVE_CPU_PREFILL_SDPA must be auto, 0 or 1"):
        cpu_ops.prefill_attention(query, cache, tables, query_lens, seq_lens, 0.125)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_prefill_other_block_sizes_and_peaked_scores(block_size):
    """Scores up to ~100 (one key dominates, the rest underflow) must not overflow the exp."""
    query, cache, tables = prefill_batch([3, 70, 18], [3, 90, 18], 8, 2, 64, block_size, torch.float32)
    for q in (query, query * 12):
        out = cpu_ops.prefill_attention(q, cache, tables, [3, 70, 18], [3, 90, 18], 0.2)
        assert rel_err(out, reference.prefill_attention(q, cache, tables, [3, 70, 18], [3, 90, 18], 0.2)) < 1e-5


def test_prefill_reads_the_steps_packed_tables():
    """`pack_prefill` builds the padded table once per step (every layer reads it); prefill with it
    equals prefill that packs for itself, and both equal the reference."""
    query, cache, tables = prefill_batch([30, 10], [30, 50], 4, 2, 32, 16, torch.float32)
    packed = cpu_ops.pack_prefill(tables, [30, 10], [30, 50], torch.device("cpu"))
    assert packed.tables.shape == (2, max(len(t) for t in tables))
    out = cpu_ops.prefill_attention(query, cache, tables, [30, 10], [30, 50], 0.3, packed)
    assert torch.equal(out, cpu_ops.prefill_attention(query, cache, tables, [30, 10], [30, 50], 0.3))
    assert rel_err(out, reference.prefill_attention(query, cache, tables, [30, 10], [30, 50], 0.3)) < 1e-6
    assert cpu_ops.pack_prefill([], [], [], torch.device("cpu")) is None


def test_prefill_refuses_bad_tables_and_lengths():
    query, cache, tables = prefill_batch([20, 3], [20, 3], 4, 2, 32, 16, torch.float32)
    with pytest.raises(RuntimeError, match="needs more blocks than the block table"):
        cpu_ops.prefill_attention(query, cache, tables, [20, 3], [20, 33], 0.3)
    with pytest.raises(RuntimeError, match="query_lens sum to 22 but query has 23 rows"):
        cpu_ops.prefill_attention(query, cache, tables, [20, 2], [20, 3], 0.3)
    with pytest.raises(RuntimeError, match="query_len 4 of segment 1 must be in \\[0, seq_len 3\\]"):
        cpu_ops.prefill_attention(query, cache, tables, [20, 4], [20, 3], 0.3)
    tables[1] = torch.tensor([cache.shape[1]])
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_ops.prefill_attention(query, cache, tables, [20, 3], [20, 3], 0.3)
