"""The compiled CPU kernels (kernels/cpu_ops.py, kernels/csrc/) against the torch reference and plain
per-sequence attention, and how dispatch chooses them or falls back to the reference.

Block tables are random permutations of the pool and lengths are not multiples of the block size.
The extension is built by `make setup`; a checkout without a C++ compiler fails here, loudly.
"""
from __future__ import annotations

import logging

import pytest
import torch
from cpu_batches import PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, TOLERANCE, paged_batch, prefill_batch, rel_err
from test_reference import naive_decode

from kernels import cpu_ops, dispatch, reference


@pytest.fixture(scope="module", autouse=True)
def built():
    return cpu_ops.load()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 4, 2), (64, 9, 3), (128, 28, 4), (32, 8, 8), (96, 5, 1)])
def test_decode_matches_per_sequence_attention(dtype, head_dim, heads, kv_heads):
    """GQA groups of 2, 3, 7, 1 (MHA) and 5 (MQA) exercise every row tile; lengths 1 to 3 blocks + 1."""
    lens = [1, 15, 16, 17, 40, 49, 5]
    query, cache, tables, seq_lens = paged_batch(lens, heads, kv_heads, head_dim, 16, dtype)
    out = cpu_ops.decode_attention(query, cache, tables, seq_lens, head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == query.shape
    ref = naive_decode(query.float(), cache.float(), tables, seq_lens, head_dim ** -0.5)
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_decode_other_block_sizes_match_reference(block_size):
    query, cache, tables, seq_lens = paged_batch([3, 33, 70, 1], 8, 2, 64, block_size, torch.float32)
    out = cpu_ops.decode_attention(query, cache, tables, seq_lens, 0.2)
    assert rel_err(out, reference.decode_attention(query, cache, tables, seq_lens, 0.2)) < 1e-6


def test_decode_splits_a_long_context_over_threads():
    """One sequence of 2,000 tokens is cut into token ranges (one work item would idle a thread),
    merged by their softmax statistics; a zero-length row gives zeros, as the Triton kernel does."""
    query, cache, tables, seq_lens = paged_batch([2000, 0], 6, 2, 64, 16, torch.float32)
    out = cpu_ops.decode_attention(query, cache, tables, seq_lens, 0.125)
    ref = reference.decode_attention(query[:1], cache, tables[:1], seq_lens[:1], 0.125)
    assert rel_err(out[:1], ref) < 1e-6
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_decode_softmax_is_exact_for_peaked_scores():
    """Large scores (one key dominates, the rest underflow): the kernel's exp must not overflow or
    lose the peak."""
    query, cache, tables, seq_lens = paged_batch([300, 64], 4, 2, 32, 16, torch.float32)
    out = cpu_ops.decode_attention(query * 30, cache, tables, seq_lens, 1.0)
    ref = naive_decode(query * 30, cache, tables, seq_lens, 1.0)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [576, 50])
def test_rms_norm_matches_reference(dtype, hidden):
    """With and without the residual add; a hidden size that is not a multiple of the vector width.
    The residual sum is exact; the output differs from the reference only by the order in which the
    sum of squares is reduced (none at all in bf16 / fp16 here)."""
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(7, hidden, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(dtype)
    out, res = cpu_ops.rms_norm(x, w, 1e-5)
    ref_out, ref_res = reference.rms_norm(x, w, 1e-5)
    assert res is x and rel_err(out, ref_out) < 1e-6
    out, res = cpu_ops.rms_norm(x, w, 1e-5, r)
    ref_out, ref_res = reference.rms_norm(x, w, 1e-5, r)
    assert torch.equal(res, ref_res) and rel_err(out, ref_out) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_matches_reference_bitwise(dtype, head_dim):
    """On strided views of one fused QKV projection, as the model passes them; every product and
    sum rounded where torch rounds, no fused multiply-adds."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(9, (8 + 2 + 2) * head_dim, generator=g).to(dtype)
    q, k = qkv[:, :8 * head_dim].view(9, 8, head_dim), qkv[:, 8 * head_dim:10 * head_dim].view(9, 2, head_dim)
    cos, sin = (torch.randn(9, head_dim, generator=g).to(dtype) for _ in range(2))
    refs = reference.apply_rotary(q, k, cos, sin)
    for out, ref in zip(cpu_ops.apply_rotary(q, k, cos, sin), refs, strict=True):
        assert torch.equal(out, ref)
    # In place (the model's path): q and k rewritten, v's columns between them untouched.
    v = qkv[:, 10 * head_dim:].clone()
    cpu_ops.apply_rotary_(q, k, cos, sin)
    assert torch.equal(q, refs[0]) and torch.equal(k, refs[1]) and torch.equal(qkv[:, 10 * head_dim:], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_matches_reference(dtype):
    """Bitwise in bf16 / fp16 (the silu is rounded before the product, as torch rounds it); in fp32
    within its exp's last bit."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2 * 100, generator=g).to(dtype) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])              # exp's clamps, and zero
    out, ref = cpu_ops.silu_and_mul(x), reference.silu_and_mul(x)
    assert out.shape == (5, 100)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-30)
    else:
        assert torch.equal(out, ref)


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (16, 16), (100, 64), (5000, 64), (49152 + 5, 64), (49152, 300),
                                 (3000, 1)])
def test_softmax_topk_matches_softmax_then_topk(n, k):
    """The sampler's kernel against torch's softmax and topk: the same indices in the same order
    (distinct values), probabilities within a few ulps; rows with a stride; masked (-inf) entries;
    a row sorted ascending (every entry a new best); rows without a distribution (NaN, +inf, all
    -inf) give NaN probabilities as softmax does; equal values take the earlier index first."""
    g = torch.Generator().manual_seed(n + k)
    x = (torch.randn(10, n + 3, generator=g) * torch.tensor([1, 8, 0.1, 1, 1, 1, 1, 1, 1, 3])[:, None])[:, 1:n + 1]
    x[3, ::2] = float("-inf")
    x[4] = torch.linspace(-5, 5, n)
    x[5, n // 3] = float("nan")
    x[6, (7 * n) // 8] = float("inf")
    x[7] = float("-inf")
    vals, ids = cpu_ops.softmax_topk(x, k)
    ref_vals, ref_ids = reference.softmax_topk(x, k)
    assert vals.shape == ids.shape == (10, k) and ids.dtype == torch.long
    ok = [0, 1, 2, 4, 8, 9] + ([3] if n // 2 >= k else [])      # (row 3: its finite half)
    assert torch.equal(ids[ok], ref_ids[ok])
    torch.testing.assert_close(vals[ok], ref_vals[ok], rtol=4e-6, atol=1e-30)
    assert vals[5:8].isnan().all() and ref_vals[5:8].isnan().all()
    if k <= 3 and n >= 7:                   # ties: the earlier index first, whatever topk does
        x = torch.zeros(1, n)
        x[0, [n - 1, 2, 5]] = 1.0
        assert cpu_ops.softmax_topk(x, k)[1][0].tolist() == [2, 5, n - 1][:k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 16, 49152 + 5])
def test_argmax_rows_matches_torch_first_maximum_and_nan(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n + 3, generator=g).to(dtype)[:, 1:n + 1]           # rows with a stride > n
    x[1] = 0.0                                                              # all tied: index 0
    x[2] = float("-inf")
    x[3, n // 2:] = 100.0                                                   # ties: the first one
    x[4, n - 1] = 100.0                                                     # the last one (tail)
    x[5, n // 3] = float("nan")                                             # NaN wins, as in torch
    x[6, :] = -5.0
    x[6, (7 * n) // 8] = float("inf")
    got = cpu_ops.argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, reference.argmax_rows(x))
    finite = [0, 1, 2, 3, 4, 6, 7, 8]
    assert torch.equal(got[finite], x[finite].float().argmax(dim=-1))
    assert got[3].item() == n // 2 and got[5].item() == n // 3


def test_write_kv_skips_padding_and_matches_reference():
    """Key rows contiguous, value rows a strided view of a fused projection; slot -1 is padding."""
    g = torch.Generator().manual_seed(4)
    _, cache, _, _ = paged_batch([100], 4, 2, 32, 16, torch.bfloat16)
    key = torch.randn(6, 2, 32, generator=g).bfloat16()
    value = torch.randn(6, 3 * 64, generator=g).bfloat16()[:, 64:128].view(6, 2, 32)
    slots = torch.tensor([3, 40, -1, 100, 101, 17])
    expected = cache.clone()
    real = slots >= 0
    reference.write_kv(key[real], value[real], expected, slots[real])
    cpu_ops.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.write_kv(key[:1], value[:1], cache, torch.tensor([cache.shape[1] * 16]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 8, 2)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (12, 2.0)])
def test_decode_attention_qkv_equals_its_steps(dtype, head_dim, heads, kv_heads, window, softcap):
    """The decode plan's one call from the fused QKV output (rotary, K/V write, paged decode) gives
    the bits and the cache of the three kernels called one by one; a padding slot is skipped."""
    g = torch.Generator().manual_seed(5)
    lens = [7, 33, 16, 1]
    _, cache, tables, seq_lens = paged_batch(lens, heads, kv_heads, head_dim, 16, dtype)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    cos, sin = (torch.randn(len(lens), head_dim, generator=g).to(dtype) for _ in range(2))
    slots = torch.stack([tables[i, (n - 1) // 16] * 16 + (n - 1) % 16 for i, n in enumerate(lens)])
    slots[3] = -1
    expected_cache = cache.clone()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = cpu_ops.apply_rotary(q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), cos, sin)
    cpu_ops.write_kv(k, v.view(-1, kv_heads, head_dim), expected_cache, slots)
    expected = cpu_ops.decode_attention(q, expected_cache, tables, seq_lens, 0.3, window=window,
                                        softcap=softcap).view(len(lens), -1)
    out = torch.ops.pdserve_cpu.decode_attention_qkv(qkv, cos, sin, cache, slots, tables, seq_lens, heads, kv_heads,
                                                     0.3, 1.0, 1.0, window, softcap)
    assert torch.equal(out, expected) and torch.equal(cache, expected_cache)
    with pytest.raises(RuntimeError, match="qkv must be"):
        torch.ops.pdserve_cpu.decode_attention_qkv(qkv[:, 1:], cos, sin, cache, slots, tables, seq_lens, heads,
                                                   kv_heads, 0.3, 1.0, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="kv_cache must be"):
        torch.ops.pdserve_cpu.decode_attention_qkv(qkv, cos, sin, cache.float() if dtype != torch.float32
                                                   else cache.double(), slots, tables, seq_lens, heads, kv_heads,
                                                   0.3, 1.0, 1.0, 0, 0.0)


def test_decode_refuses_blocks_outside_the_table_or_pool():
    """The kernel reads raw memory, so a table that does not cover a length, or names a block past
    the pool, is an error rather than a read out of bounds."""
    query, cache, tables, seq_lens = paged_batch([20, 3], 4, 2, 32, 16, torch.float32)
    with pytest.raises(RuntimeError, match="needs more blocks than the block table"):
        cpu_ops.decode_attention(query, cache, tables, torch.tensor([20, 33]), 0.3)
    tables[1, 0] = cache.shape[1]
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_ops.decode_attention(query, cache, tables, seq_lens, 0.3)


def test_unsupported_head_dim_uses_the_reference(monkeypatch):
    query, cache, tables, seq_lens = paged_batch([20, 3], 4, 2, 24, 16, torch.float32)
    calls = []
    monkeypatch.setattr(reference, "decode_attention", lambda *a: calls.append("decode") or torch.zeros(1))
    monkeypatch.setattr(reference, "prefill_attention", lambda *a: calls.append("prefill") or torch.zeros(1))
    cpu_ops.decode_attention(query, cache, tables, seq_lens, 0.3)
    cpu_ops.prefill_attention(query, cache, [tables[0], tables[1]], [1, 1], [20, 3], 0.3)
    assert calls == ["decode", "prefill"]


def test_dispatch_picks_the_cpu_kernels_and_falls_back_with_a_reason(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PDSERVE_KERNELS", "auto")
    assert dispatch.get_kernels("cpu") is cpu_ops
    monkeypatch.setenv("PDSERVE_KERNELS", "cpu")
    assert dispatch.get_kernels("cpu") is cpu_ops
    with pytest.raises(ValueError, match="PDSERVE_KERNELS=cpu runs on CPU tensors only"):
        dispatch.get_kernels("cuda")
    # Where no compiler runs, auto falls back to the reference with a warning; `cpu` is an error.
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu_ops.BuildError, match="no C\\+\\+ compiler"):
        cpu_ops.library_path()
    cpu_ops.load.cache_clear()
    dispatch._cpu_build_error.cache_clear()
    try:
        with pytest.raises(ValueError, match="C\\+\\+ CPU kernels are unavailable: no C\\+\\+ compiler"):
            dispatch.get_kernels("cpu")
        monkeypatch.setenv("PDSERVE_KERNELS", "auto")
        with caplog.at_level(logging.WARNING, logger="pdserve.kernels"):
            assert dispatch.get_kernels("cpu") is reference
        assert "using the torch reference kernels" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_ops.load.cache_clear()
        dispatch._cpu_build_error.cache_clear()
    assert dispatch.get_kernels("cpu") is cpu_ops


def test_a_failed_compile_reports_the_compiler_error(monkeypatch, tmp_path):
    """A compiler that runs but fails: BuildError carries its output, and nothing is left in the cache."""
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'cpu_ops.cpp:1: error: no luck' >&2; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    path = cpu_ops.library_path()
    with pytest.raises(cpu_ops.BuildError, match="error: no luck"):
        cpu_ops.build(path)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"{(tmp_path / 'cache' / path).name}.lock"]


# --- fp8 KV cache (kv_cache_dtype="fp8") ----------------------------------------------------------
def fp8_cache(cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """`cache`'s K and V as an fp8 cache stores them (kernels.reference.quantize_kv)."""
    return torch.stack([reference.quantize_kv(cache[0] * 3, k_scale), reference.quantize_kv(cache[1], v_scale)])


def test_fp8_values_widen_exactly_in_the_kernels():
    """Every finite e4m3 value (subnormals, +-448, -0) read by the C++ decode kernel as torch widens
    it: one token whose V holds sixteen of them, attended alone (its weight is exactly 1)."""
    values = torch.arange(256, dtype=torch.uint8)
    values = values[(values & 0x7F) != 0x7F]                          # 254 finite values
    rows = torch.cat([values, torch.zeros(2, dtype=torch.uint8)]).view(-1, 16)
    for row in rows:
        cache = torch.zeros(2, 1, 16, 1, 16, dtype=torch.float8_e4m3fn)
        cache.view(torch.uint8)[1, 0, 0, 0] = row
        out = cpu_ops.decode_attention(torch.ones(1, 1, 16), cache, torch.tensor([[0]]), torch.tensor([1]), 1.0)
        assert torch.equal(out[0, 0], row.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 2.5)])
def test_fp8_decode_and_prefill_match_the_reference(dtype, scales):
    """The C++ kernels on an fp8 cache (K and V scales folded into the query's scale and the output)
    against the reference, which widens the cache to the query's dtype times the scales."""
    k_scale, v_scale = scales
    query, cache, tables, seq_lens = paged_batch([1, 15, 17, 49, 300], 9, 3, 64, 16, torch.float32)
    cache = fp8_cache(cache, k_scale, v_scale)
    query = query.to(dtype)
    out = cpu_ops.decode_attention(query, cache, tables, seq_lens, 0.125, k_scale, v_scale)
    ref = reference.decode_attention(query.float(), cache, tables, seq_lens, 0.125, k_scale, v_scale)
    assert out.dtype == dtype and rel_err(out, ref) < TOLERANCE[dtype]
    query, cache, ptables = prefill_batch(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 9, 3, 64, 16, torch.float32)
    cache = fp8_cache(cache, k_scale, v_scale)
    query = query.to(dtype)
    out = cpu_ops.prefill_attention(query, cache, ptables, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 0.125, None,
                                    k_scale, v_scale)
    ref = reference.prefill_attention(query.float(), cache, ptables, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 0.125,
                                      None, k_scale, v_scale)
    assert out.dtype == dtype and rel_err(out, ref) < TOLERANCE[dtype]


def test_fp8_write_quantizes_saturates_and_copies_blocks():
    """The slot write stores quantize_kv's bytes (x / scale, saturated at +-448) in every kernel set;
    copy and swap move fp8 blocks as bytes."""
    g = torch.Generator().manual_seed(5)
    cache = torch.zeros(2, 8, 16, 2, 32, dtype=torch.float8_e4m3fn)
    key = torch.randn(5, 2, 32, generator=g).bfloat16() * 300         # some beyond 448 * 0.5
    value = torch.randn(5, 2, 32, generator=g).bfloat16()
    slots = torch.tensor([3, 40, -1, 100, 17])
    expected = cache.clone()
    real = slots >= 0
    reference.write_kv(key[real], value[real], expected, slots[real], 0.5, 2.0)
    cpu_ops.write_kv(key, value, cache, slots, 0.5, 2.0)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    stored = cache.view(2, -1, 2, 32)[0, 3].float()
    assert stored.abs().max() == 448.0 and not stored.isnan().any()
    assert torch.equal(stored, (key[0].float() / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    reference.copy_blocks([cache], [(0, 5)])
    assert torch.equal(cache[:, 5].view(torch.uint8), cache[:, 0].view(torch.uint8))
    cpu = torch.zeros_like(cache)
    reference.swap_blocks([cache], [cpu], [(6, 1)])
    assert torch.equal(cpu[:, 1].view(torch.uint8), cache[:, 6].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("subs,in_features", [([40], 72), ([32, 8, 8], 64), ([100, 100], 33)])
def test_lora_add_matches_reference(dtype, subs, in_features):
    """Groups of different ranks, rows out of order and split across the batch (decode rows), rows of
    no group (the base model), fused outputs whose sizes are no multiple of 16, an input size that is
    none either; and a group of a partly filled slot (zero past its rank)."""
    g = torch.Generator().manual_seed(len(subs) * 100 + in_features)
    slots, max_rank, rows_n = 5, 16, 23
    out_total = sum(subs)
    a = (torch.randn(slots, max_rank, len(subs), in_features, generator=g) * 0.3).to(dtype)
    bt = (torch.randn(slots, max_rank, out_total, generator=g) * 0.3).to(dtype)
    a[2, 8:] = 0
    bt[2, 8:] = 0
    x = torch.randn(rows_n, in_features, generator=g).to(dtype)
    out = torch.randn(rows_n, out_total, generator=g).to(dtype)
    groups = {4: [3, 17, 9], 2: list(range(10, 16)), 0: [0], 1: [22, 1, 20, 2]}      # rows 4-8 etc.: base
    ranks = {4: 16, 2: 8, 0: 1, 1: 5}
    rows = torch.tensor([r for rs in groups.values() for r in rs])
    starts = torch.tensor([0, *torch.tensor([len(rs) for rs in groups.values()]).cumsum(0).tolist()])
    args = (a, bt, rows, starts, torch.tensor(list(groups)), torch.tensor([ranks[s] for s in groups]),
            torch.tensor([0, *torch.tensor(subs).cumsum(0).tolist()]))
    want = reference.lora_add(x, out.clone(), *args)
    got = cpu_ops.lora_add(x, out.clone(), *args)
    base_rows = sorted(set(range(rows_n)) - set(rows.tolist()))
    assert torch.equal(got[base_rows], out[base_rows]) and torch.equal(want[base_rows], out[base_rows])
    assert rel_err(got - out.float(), want - out.float()) < {torch.float32: 1e-5}.get(dtype, 2e-2)
    assert rel_err(got, want) < TOLERANCE[dtype] * 2
    # In fp32, against a per-row loop of plain matmuls (a reference the kernels do not share).
    if dtype == torch.float32:
        offsets = args[-1].tolist()
        for slot, rs in groups.items():
            r = ranks[slot]
            for row in rs:
                shrunk = a[slot, :r].double() @ x[row].double()               # [r, subs]
                for i in range(len(subs)):
                    delta = bt[slot, :r, offsets[i]:offsets[i + 1]].double().t() @ shrunk[:, i]
                    assert torch.allclose(got[row, offsets[i]:offsets[i + 1]].double(),
                                          out[row, offsets[i]:offsets[i + 1]].double() + delta, atol=1e-4)
    with pytest.raises(RuntimeError, match="bad slot"):
        cpu_ops.lora_add(x, out.clone(), a, bt, rows, starts, torch.tensor([9, 2, 0, 1]), args[5], args[6])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_does_not_depend_on_the_thread_count(dtype):
    """Each thread runs its own share of work items, then takes what is left of the others'
    (kernels/csrc/work_split.h run_shares_stealing): with more threads than cores, shares are taken from
    descheduled threads all the time, and every item must still run exactly once. Prefill and decode
    attention give the same bits with 1, 2 and 7 threads (the decode batch has enough sequences,
    4 x 7, that no thread count cuts them into token ranges, which would sum in another order)."""
    prefill = prefill_batch(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 9, 3, 64, 16, dtype)
    decode = paged_batch([37 * i % 700 + 1 for i in range(30)], 9, 3, 64, 16, dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 7):
            torch.set_num_threads(n)
            outs.append((cpu_ops.prefill_attention(*prefill, PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 0.125),
                         cpu_ops.decode_attention(*decode, 0.125)))
    finally:
        torch.set_num_threads(threads)
    for prefill_out, decode_out in outs[1:]:
        assert torch.equal(prefill_out, outs[0][0]) and torch.equal(decode_out, outs[0][1])


def test_the_attention_kernels_keep_their_prefetches():
    """GCC 12 compiled the attention kernels' prefetch of the next chunk to nothing (a block walk whose
    only effect was __builtin_prefetch: docs/perf/journal.md §70), which no output and no benchmark
    shows as such; their prefetches go through common.h's asm prefetch_line. Checked in the library
    this machine built: every decode_range instantiation, and prefill's item loop, prefetch."""
    import platform
    import re
    import shutil
    import subprocess

    from kernels import cpu_extension

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"prefetch_line is an x86 instruction; this machine is {platform.machine()}")
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("needs objdump (binutils) to read the built library")
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", cpu_extension.load()],
                             capture_output=True, text=True, check=True).stdout
    prefetches: dict[str, int] = {}
    name = ""
    for line in listing.splitlines():
        if line.endswith(">:"):
            name = line.split("<", 1)[1]
            prefetches.setdefault(name, 0)
        elif "prefetcht0" in line:
            prefetches[name] += 1
    decode = {n: c for n, c in prefetches.items() if re.search(r"::decode_range<[^()]*>\(", n) and "{lambda" not in n}
    prefill = {n: c for n, c in prefetches.items() if "prefill_impl<" in n}
    assert decode and all(decode.values()), [n[:90] for n, c in decode.items() if not c]
    assert any(prefill.values()), "no prefill_impl function prefetches"
