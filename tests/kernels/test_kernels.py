"""Triton kernels against the torch reference (kernels/reference.py).

Without CUDA every kernel runs under Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
Triton is imported) at small fp32 shapes: the interpreter's bf16 arithmetic is broken, so bf16/fp16
and full sizes are left to the `gpu` tests, which run the compiled kernels. Block tables are random
permutations of the pool (non-contiguous, shuffled ids) and lengths are not multiples of the block
size.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from helpers import REPO

# benchmarks/quality.py for the fp8 checkpoint test (appended: it must not shadow the packages).
sys.path.append(os.path.join(REPO, "benchmarks"))
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import hf_greedy, save_random_model

from engine import LLM, SamplingParams
from kernels import cpu_ops, gguf_format, reference, triton_quant
from kernels import triton_ops as tri
from kernels.dispatch import get_kernels
from kernels.triton_attention import decode_partitions

DEVICE = torch.device("cuda" if CUDA else "cpu")
HEAD_DIM = 128 if CUDA else 32          # the interpreter runs each program in Python: small shapes
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# Relative error ||out - ref|| / ||ref|| allowed per dtype (fp32: exact products, other orders).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def paged(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
          spare_blocks: int = 3, seed: int = 0):
    """A KV cache with random contents and each sequence's blocks drawn at random from the pool."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    perm = torch.randperm(num_blocks, generator=g).to(DEVICE)
    tables, start = [], 0
    for n in need:
        tables.append(perm[start:start + n])
        start += n
    return cache, tables, g


def padded(tables: list[torch.Tensor]) -> torch.Tensor:
    width = max(t.numel() for t in tables)
    # Padding columns hold a real block id: the kernels must not read past a row's length.
    return torch.stack([torch.cat([t, t[:1].expand(width - t.numel())]) for t in tables])


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_attention_matches_reference(group, block_size):
    num_kv_heads, head_dim = 2, HEAD_DIM
    lens = [1, 17, 45, 300 if not CUDA else 3000, 0]        # 0: a padded row (CUDA-graph batches)
    cache, tables, g = paged([max(n, 1) for n in lens], num_kv_heads, head_dim, block_size, torch.float32)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=g).to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    block_tables = padded(tables)
    out = tri.decode_attention(q, cache, block_tables, seq_lens, head_dim ** -0.5)
    ref = reference.decode_attention(q[:-1], cache, block_tables[:-1], seq_lens[:-1], head_dim ** -0.5)
    assert rel_err(out[:-1], ref) < TOLERANCE[torch.float32]
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_decode_attention_splits_long_contexts():
    """One sequence (flash-decoding): the context is split over several partitions and merged."""
    head_dim, block_size, n = 32, 16, 700 if not CUDA else 32768
    cache, tables, g = paged([n], 1, head_dim, block_size, torch.float32)
    splits, _, _ = decode_partitions(1, 1, tables[0].numel() * block_size, block_size, DEVICE)
    assert splits >= 3
    q = torch.randn(1, 4, head_dim, generator=g).to(DEVICE)
    seq_lens = torch.tensor([n], device=DEVICE)
    out = tri.decode_attention(q, cache, tables[0][None], seq_lens, 0.2)
    assert rel_err(out, reference.decode_attention(q, cache, tables[0][None], seq_lens, 0.2)) < 1e-5


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_attention_matches_reference(group, block_size):
    """Full prefill, chunks after a cached prefix (prefix hits, chunked prefill), one-token chunk."""
    num_kv_heads, head_dim = 2, HEAD_DIM
    seq_lens = [37, 70, 5, 100] if not CUDA else [1000, 2100, 5, 700]
    query_lens = [37, 21, 1, 67] if not CUDA else [1000, 900, 1, 69]
    cache, tables, g = paged(seq_lens, num_kv_heads, head_dim, block_size, torch.float32)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=g).to(DEVICE)
    out = tri.prefill_attention(q, cache, tables, query_lens, seq_lens, 0.15)
    ref = reference.prefill_attention(q, cache, tables, query_lens, seq_lens, 0.15)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_write_kv_skips_padding_and_copy_blocks_matches_reference():
    cache, _, g = paged([100], 2, 32, 16, torch.float32, spare_blocks=4)
    key = torch.randn(6, 2, 32, generator=g).to(DEVICE)
    value = torch.randn(6, 2, 32, generator=g).to(DEVICE)
    slots = torch.tensor([3, 40, -1, 100, 159, 17], device=DEVICE)
    expected = cache.clone()
    real = slots >= 0
    reference.write_kv(key[real], value[real], expected, slots[real])
    tri.write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)
    pairs = [(1, 7), (2, 3), (0, 9)]
    reference.copy_blocks([expected], pairs)
    tri.copy_blocks([cache], pairs)
    assert torch.equal(cache, expected)


def test_fp8_cache_write_decode_prefill_and_copy_match_reference():
    """kv_cache_dtype="fp8": the write quantizes (kernels.reference.quantize_kv), the attention
    kernels widen the bytes and apply the K/V scales, copies move bytes; all as the reference."""
    num_kv_heads, head_dim, block_size, k_scale, v_scale = 2, HEAD_DIM, 16, 0.5, 2.0
    seq_lens, query_lens = [37, 70, 5], [37, 21, 1]
    dense, tables, g = paged(seq_lens, num_kv_heads, head_dim, block_size, torch.float32)
    cache = torch.stack([reference.quantize_kv(dense[0], k_scale), reference.quantize_kv(dense[1], v_scale)])
    q = torch.randn(sum(query_lens), num_kv_heads * 4, head_dim, generator=g).to(DEVICE)
    out = tri.prefill_attention(q, cache, tables, query_lens, seq_lens, 0.15, None, k_scale, v_scale)
    ref = reference.prefill_attention(q, cache, tables, query_lens, seq_lens, 0.15, None, k_scale, v_scale)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    lens = torch.tensor(seq_lens, device=DEVICE)
    qd = q[:len(seq_lens)].contiguous()
    out = tri.decode_attention(qd, cache, padded(tables), lens, 0.15, k_scale, v_scale)
    ref = reference.decode_attention(qd, cache, padded(tables), lens, 0.15, k_scale, v_scale)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    key = torch.randn(4, num_kv_heads, head_dim, generator=g).to(DEVICE) * 400
    value = torch.randn(4, num_kv_heads, head_dim, generator=g).to(DEVICE)
    slots = torch.tensor([3, -1, 100, 17], device=DEVICE)
    expected = cache.clone()
    reference.write_kv(key[slots >= 0], value[slots >= 0], expected, slots[slots >= 0], k_scale, v_scale)
    tri.write_kv(key, value, cache, slots, k_scale, v_scale)
    reference.copy_blocks([expected], [(1, 4)])
    tri.copy_blocks([cache], [(1, 4)])
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def e4m3_edge_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties, which round to even) and the
    fp32 values just either side of each, zeros, values past +-448, and both signs of all of them."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(reference.FP8_DTYPE).float()
    grid = grid[grid.isfinite()].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mid, grid]).view(torch.int32)
    x = torch.cat([grid, mid, (near + 1).view(torch.float32), (near - 1).view(torch.float32),
                   torch.tensor([0.0, 2.0 ** -10, 2.0 ** -12, 1e-30, 449.0, 464.0, 480.0, 1e6])])
    x = x[x.isfinite()]                     # (0.0's bits less one are a NaN)
    return torch.cat([x, -x, torch.tensor([float("nan")])])


@pytest.mark.parametrize("hardware", [False, True] if CUDA else [False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if CUDA else [torch.float32])
def test_fp8_slot_write_rounds_as_the_reference(hardware, dtype, monkeypatch):
    """The Triton slot write quantizes in its own launch, by the GPU's conversion or (older GPUs,
    the interpreter) by fp32 and integer arithmetic: both give quantize_kv's bytes on every e4m3
    value, tie and neighbour, saturated and subnormal, at scale 1 and scales that move the ties;
    a NaN stays a NaN."""
    from kernels import triton_attention

    monkeypatch.setattr(triton_attention, "HARDWARE_FP8", hardware)
    values = e4m3_edge_values().to(dtype).to(DEVICE)
    num_kv_heads, head_dim, block_size = 2, 64, 16
    rows = -(-values.numel() // (num_kv_heads * head_dim))
    flat = torch.zeros(rows * num_kv_heads * head_dim, dtype=dtype, device=DEVICE)
    flat[:values.numel()] = values
    key = flat.view(rows, num_kv_heads, head_dim)
    value = key.flip(0).contiguous()
    slots = torch.randperm(rows + 5, generator=torch.Generator().manual_seed(0))[:rows].to(DEVICE)
    for k_scale, v_scale in ((1.0, 1.0), (0.5, 3.0), (0.1, 7.0)):
        cache = torch.zeros(2, -(-(rows + 5) // block_size), block_size, num_kv_heads, head_dim,
                            dtype=reference.FP8_DTYPE, device=DEVICE)
        expected = cache.clone()
        reference.write_kv(key, value, expected, slots, k_scale, v_scale)
        tri.write_kv(key, value, cache, slots, k_scale, v_scale)
        nan = expected.float().isnan()
        assert nan.sum() == 2 and cache.float().isnan().equal(nan)
        assert torch.equal(cache.view(torch.uint8)[~nan], expected.view(torch.uint8)[~nan]), (k_scale, v_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if CUDA else [torch.float32])
def test_fp8_cache_widened_by_conversion_equals_bit_arithmetic(dtype, monkeypatch):
    """The attention kernels' two ways of widening an fp8 cache (the GPU's e4m3 conversion, the
    C++ kernels' bit arithmetic) give the same values, so the same outputs bit for bit; the cache
    holds every byte but e4m3's two NaNs (which the interpreter's conversion reads as +-480)."""
    from kernels import triton_attention

    seq_lens, query_lens = [37, 70, 5], [37, 21, 1]
    cache, tables, g = paged(seq_lens, 2, HEAD_DIM, 16, torch.float32)
    byte = torch.randint(0, 254, cache.shape, generator=g, dtype=torch.int32)
    byte = byte + (byte >= 127).int()       # skip 0x7F; 0xFF is above the range
    fp8 = byte.to(torch.uint8).view(reference.FP8_DTYPE).to(DEVICE)
    q = (torch.randn(sum(query_lens), 8, HEAD_DIM, generator=g) * 0.01).to(DEVICE, dtype)
    qd = q[:len(seq_lens)].contiguous()
    lens = torch.tensor(seq_lens, device=DEVICE)
    outs = {}
    for hardware in (False, True):
        monkeypatch.setattr(triton_attention, "HARDWARE_FP8", hardware)
        outs[hardware] = (tri.decode_attention(qd, fp8, padded(tables), lens, 0.2, 0.5, 2.0),
                          tri.prefill_attention(q, fp8, tables, query_lens, seq_lens, 0.2, None, 0.5, 2.0))
    for by_bits, by_conversion in zip(outs[False], outs[True]):
        assert not by_bits.isnan().any()
        assert torch.equal(by_bits, by_conversion)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(with_residual):
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(7, 96, generator=g).to(DEVICE) for _ in range(2))
    w = torch.randn(96, generator=g).to(DEVICE)
    out, res = tri.rms_norm(x, w, 1e-5, r if with_residual else None)
    ref_out, ref_res = reference.rms_norm(x, w, 1e-5, r if with_residual else None)
    assert torch.equal(res, ref_res)
    assert rel_err(out, ref_out) < 1e-6


@pytest.mark.parametrize("subs", [[40], [32, 8, 8], [100, 100]])
def test_lora_add_matches_reference(subs):
    """The Triton LoRA kernels against the reference: groups of different ranks, rows out of order,
    rows of no group untouched, fused outputs and an input size that are no power of two."""
    g = torch.Generator().manual_seed(len(subs))
    slots, max_rank, rows_n, in_features = 4, 16, 13, 72
    out_total = sum(subs)
    a = (torch.randn(slots, max_rank, len(subs), in_features, generator=g) * 0.3).to(DEVICE)
    bt = (torch.randn(slots, max_rank, out_total, generator=g) * 0.3).to(DEVICE)
    x = torch.randn(rows_n, in_features, generator=g).to(DEVICE)
    out = torch.randn(rows_n, out_total, generator=g).to(DEVICE)
    groups = {3: [4, 11, 0], 1: [6, 7, 8], 0: [12]}
    ranks = [16, 5, 1]
    args = (a, bt, torch.tensor([r for rs in groups.values() for r in rs], device=DEVICE),
            torch.tensor([0, 3, 6, 7]), torch.tensor(list(groups)), torch.tensor(ranks),
            torch.tensor([0, *torch.tensor(subs).cumsum(0).tolist()]))
    want = reference.lora_add(x, out.clone(), *args)
    got = tri.lora_add(x, out.clone(), *args)
    untouched = [1, 2, 3, 5, 9, 10]
    assert torch.equal(got[untouched], out[untouched])
    assert rel_err(got - out, want - out) < 1e-5


def test_q8_0_packing_round_trips():
    """The Triton set's Q8_0 form and back (a weight update rewrites rows in the file's form); pure
    torch, so checked here on any machine."""
    blocks = torch.randint(0, 256, (5, 3 * 34), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    packed = triton_quant.pack_gguf(blocks, "Q8_0")
    assert not torch.equal(packed, blocks) and torch.equal(triton_quant.unpack_gguf(packed, "Q8_0"), blocks)
    assert triton_quant.unpack_gguf(blocks, "Q4_1") is blocks


def test_q8_0_linear_matches_reference():
    """The W8A16 kernels on Q8_0 blocks (GGUF files, int8 checkpoints; reordered by pack_gguf) against
    dequantize-then-matmul in fp32: batch 1 (the one-row kernel), ragged batches over a ragged number
    of weight rows (the tile kernel), and a large batch (dequantize + one GEMM); other tiles,
    split-K, and the blocks' dequantization."""
    g = torch.Generator().manual_seed(5)
    n, k = 70, 160
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).to(torch.float16)
    blocks = torch.cat([scales.view(torch.uint8).reshape(n, -1, 2), q.view(torch.uint8).reshape(n, -1, 32)], dim=2)
    blocks = blocks.reshape(n, -1).to(DEVICE)
    packed = tri.pack_gguf(blocks, "Q8_0")
    assert packed.shape == blocks.shape and not torch.equal(packed, blocks)
    assert torch.equal(tri.unpack_gguf(packed, "Q8_0"), blocks)          # (a weight update's way back)
    assert torch.equal(triton_quant.dequantize_q8_0(packed, torch.float32), gguf_format.dequantize_gguf(blocks, "Q8_0"))
    dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if CUDA else [])
    for rows in (1, 19, 70, triton_quant.DEQUANT_MIN_ROWS):
        for dtype in dtypes:
            x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
            out = tri.gguf_linear(x, packed, "Q8_0")
            assert out.dtype == dtype and out.shape == (rows, n)
            assert rel_err(out, reference.gguf_linear(x, blocks, "Q8_0")) < TOLERANCE[dtype]
    # 160 features = 5 blocks: partial last steps of NB blocks, splits of unequal length.
    x = torch.randn(19, k, generator=g).to(DEVICE)
    for block_n, nb, split in ((16, 1, 1), (16, 2, 3), (64, 4, 2), (32, 8, 4)):
        out = triton_quant.q8_0_linear(x, packed, {"BLOCK_M": 16, "BLOCK_N": block_n, "NB": nb, "SPLIT_K": split,
                                                   "num_warps": 4, "num_stages": 2})
        assert rel_err(out, reference.gguf_linear(x, blocks, "Q8_0")) < TOLERANCE[torch.float32]
    for rows, (block_n, nb, split) in ((1, (8, 1, 1)), (1, (8, 2, 3)), (3, (16, 4, 2)), (1, (32, 8, 4))):
        out = triton_quant.q8_0_linear(x[:rows], packed, {"BLOCK_N": block_n, "NB": nb, "SPLIT_K": split,
                                                          "num_warps": 4}, kernel="gemv")
        assert rel_err(out, reference.gguf_linear(x[:rows], blocks, "Q8_0")) < TOLERANCE[torch.float32]


def test_rotary_matches_reference_bitwise():
    """On strided views of one fused QKV projection, as the model passes them."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(9, (8 + 2 + 2) * 32, generator=g).to(DEVICE)
    q, k = qkv[:, :256].view(9, 8, 32), qkv[:, 256:320].view(9, 2, 32)
    cos, sin = (torch.randn(9, 32, generator=g).to(DEVICE) for _ in range(2))
    for out, ref in zip(tri.apply_rotary(q, k, cos, sin), reference.apply_rotary(q, k, cos, sin)):
        assert torch.equal(out, ref)


def test_dispatch_choices(monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNELS", "fast")
    with pytest.raises(ValueError, match="PDSERVE_KERNELS must be one of"):
        get_kernels("cpu")
    monkeypatch.setenv("PDSERVE_KERNELS", "auto")
    assert get_kernels("cpu") is cpu_ops           # (tests/kernels/test_cpu_ops.py: the fallback to the reference)
    monkeypatch.setenv("PDSERVE_KERNELS", "reference")
    assert get_kernels("cuda") is reference
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_kernels("cpu") is tri
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        get_kernels("cpu")


def greedy_ids(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.skipif(CUDA, reason="the interpreter run; the gpu tests below cover CUDA")
def test_engine_with_triton_kernels_matches_transformers(tiny_llama, monkeypatch):
    """The whole engine on the interpreted kernels: chunked prefill (budget 24), prefix-cache hits
    (the second prompt shares two blocks with the first), decode; token-identical to transformers."""
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    g = torch.Generator().manual_seed(3)
    first = torch.randint(3, 1000, (40,), generator=g).tolist()
    prompts = [first, first[:32] + [7, 8, 9], torch.randint(3, 1000, (5,), generator=g).tolist()]
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128, max_num_batched_tokens=24)
    outs = greedy_ids(llm, prompts[:1], 6) + greedy_ids(llm, prompts[1:], 6)
    assert outs == hf_greedy(tiny_llama, prompts, 6)
    assert llm.llm_engine.executor.worker.runner.kernels is tri
    assert llm.llm_engine.kv_cache_manager.prefix_cache_hits == 32


# --- CUDA ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def untokenized_model(tmp_path_factory) -> str:
    """A random Llama without a tokenizer (token-id prompts): head_dim 64, GQA 2. (The shared tiny
    models use the embedded model's tokenizer, whose package a GPU machine may lack.)"""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    return save_random_model(tmp_path_factory, config, "untokenized-llama", seed=0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_full_size_kernels_gpu(dtype, head_dim, block_size):
    """Decode over up to 32k contexts (batch 1 splits, batch 64 does not) and prefill of 2k-token
    segments with cached prefixes, GQA 4, in every dtype, against the reference in fp32."""
    lens = [32768, 1, 4095, 333]
    cache, tables, g = paged(lens, 8, head_dim, block_size, dtype)
    q = torch.randn(len(lens), 32, head_dim, generator=g).to(DEVICE, dtype)
    bt, sl = padded(tables), torch.tensor(lens, device=DEVICE)
    ref = reference.decode_attention(q.float(), cache.float(), bt, sl, head_dim ** -0.5)
    assert rel_err(tri.decode_attention(q, cache, bt, sl, head_dim ** -0.5), ref) < TOLERANCE[dtype]
    seq_lens, query_lens = [2048, 3000, 700], [2048, 1000, 1]
    cache, tables, g = paged(seq_lens, 8, head_dim, block_size, dtype)
    q = torch.randn(sum(query_lens), 32, head_dim, generator=g).to(DEVICE, dtype)
    ref = reference.prefill_attention(q.float(), cache.float(), tables, query_lens, seq_lens, 0.1)
    assert rel_err(tri.prefill_attention(q, cache, tables, query_lens, seq_lens, 0.1), ref) < TOLERANCE[dtype]
    # Gemma's shapes: a 4,096-token window and soft-capped scores, compiled
    shape = dict(window=4096, softcap=50.0)
    ref = reference.prefill_attention(q.float(), cache.float(), tables, query_lens, seq_lens, 0.1, **shape)
    assert rel_err(tri.prefill_attention(q, cache, tables, query_lens, seq_lens, 0.1, **shape), ref) < TOLERANCE[dtype]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_size_windowed_decode_and_moe_gpu(dtype):
    """Compiled: windowed, soft-capped decode over long contexts; a Mixtral-sized expert layer's
    grouped GEMMs at decode and prefill batch sizes, against the reference in fp32."""
    lens = [32768, 1, 4095, 333]
    cache, tables, g = paged(lens, 8, 128, 16, dtype)
    q = torch.randn(len(lens), 32, 128, generator=g).to(DEVICE, dtype)
    bt, sl = padded(tables), torch.tensor(lens, device=DEVICE)
    ref = reference.decode_attention(q.float(), cache.float(), bt, sl, 0.088, window=4096, softcap=50.0)
    assert rel_err(tri.decode_attention(q, cache, bt, sl, 0.088, window=4096, softcap=50.0), ref) < TOLERANCE[dtype]
    from engine.model.layers.moe import route

    w13 = (torch.randn(8, 2 * 1792, 1024, generator=g) * 0.03).to(DEVICE, dtype)
    w2 = (torch.randn(8, 1024, 1792, generator=g) * 0.03).to(DEVICE, dtype)
    for tokens in (1, 64, 1024):
        x = torch.randn(tokens, 1024, generator=g).to(DEVICE, dtype)
        weights, ids = route(torch.randn(tokens, 8, generator=g).to(DEVICE), 2, True)
        ref = reference.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
        assert rel_err(tri.fused_moe(x, w13, w2, weights, ids), ref) < TOLERANCE[dtype]


@gpu
@pytest.mark.gpu
def test_engine_on_cuda_matches_transformers_with_and_without_graphs(untokenized_model):
    """fp32 greedy on CUDA (Triton kernels) equals transformers, eager and with CUDA graphs (batch
    sizes 3 and 5 replay padded buckets 4 and 8; 9 prompts exceed the largest and run eagerly)."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(4)
    # Ids from 3: transformers' generate takes id 0 (pad_token_id) in a prompt for padding.
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 33, 130, 200, 3, 64)]
    hf = AutoModelForCausalLM.from_pretrained(untokenized_model, dtype=torch.float32).to("cuda").eval()
    expected = []
    for ids in prompts:
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=24, min_new_tokens=24,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(gen[0, len(ids):].tolist())
    results = {}
    for eager in (True, False):
        llm = LLM(untokenized_model, dtype="float32", max_model_len=512, worker_num_gpus=1, enforce_eager=eager,
                  cuda_graph_sizes=[1, 2, 4, 8])
        runner = llm.llm_engine.executor.worker.runner
        assert (runner.graph_runner is None) == eager
        results[eager] = [greedy_ids(llm, prompts[:n], 24) for n in (3, 5, 9)]
    for batches in results.values():
        for n, out in zip((3, 5, 9), batches):
            assert out == expected[:n]


def test_cuda_graph_sizes_config(untokenized_model):
    """Buckets up to max_num_seqs and the first at or above it; enforce_eager captures none; on
    the CPU nothing is captured whatever the sizes."""
    from records.config_resolution import engine_config

    config = engine_config(untokenized_model, max_num_seqs=5, cuda_graph_sizes=[16, 8, 1, 2, 4, 2])
    assert config.model_config.cuda_graph_sizes == (1, 2, 4, 8)
    assert engine_config(untokenized_model, enforce_eager=True).model_config.cuda_graph_sizes == ()
    with pytest.raises(ValueError, match="cuda_graph_sizes must be positive integers"):
        engine_config(untokenized_model, cuda_graph_sizes=[0, 4])
    llm = LLM(untokenized_model, dtype="float32", max_model_len=64, cuda_graph_sizes=[1, 2])
    assert llm.llm_engine.executor.worker.runner.graph_runner is None


# --- CUDA: quantized weights, the fp8 KV cache and LoRA in the engine (issues 26, 28) -------------

def cuda_llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", max_model_len=512, worker_num_gpus=1, cuda_graph_sizes=[1, 2, 4, 8], **kwargs)


def cuda_prompts() -> list[list[int]]:
    """Decode batches of 7 rows (a graph bucket of 8) and prefills of 1-200 tokens (the 130- and
    200-token prompts take the large-batch paths)."""
    g = torch.Generator().manual_seed(6)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 15, 17, 33, 130, 200, 64)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["ct-pack", "gptq"])
def test_int8_checkpoint_on_cuda_matches_transformers(untokenized_model, tmp_path, layout):
    """W8A16 on CUDA, fp32: greedy tokens from the Triton Q8_0 kernel (decode rows, eager and replayed
    from CUDA graphs) and dequantize + cuBLAS (prefill rows) equal transformers' on the checkpoint's
    dequantized weights; with no quantization argument a GPU keeps the int8 blocks."""
    from test_quant_checkpoint import write_checkpoint

    path = write_checkpoint(untokenized_model, str(tmp_path / layout), layout)
    prompts = cuda_prompts()
    want = hf_greedy(path + "-dense", prompts, 16)
    for eager in (True, False):
        llm = cuda_llm(path, enforce_eager=eager)
        qkv = llm.llm_engine.executor.worker.runner.model.layers[0].self_attn.qkv_proj
        assert qkv.qtype == "Q8_0" and qkv.weight.is_cuda
        assert greedy_ids(llm, prompts, 16) == want


@gpu
@pytest.mark.gpu
def test_fp8_checkpoint_on_cuda(untokenized_model, tmp_path, monkeypatch):
    """fp8 weights on CUDA: through cuBLASLt's fp8 GEMM (torch._scaled_mm) where the GPU has one
    (compute capability 8.9+), equal to the reference product to bf16 rounding; on older GPUs
    dequantized at load. Teacher-forced over 200 random tokens, as far from the exact weights as the
    CPU's fp8 path is (on an H200: mean KL 0.125 on CUDA, 0.126 on the CPU; this random model's
    activations feel e4m3 more than test_quant_checkpoint's), and close to that path (0.037: CUDA's
    row-scaled GEMM rounds its output to bf16); CUDA graphs replay it."""
    import quality
    from test_quant_checkpoint import write_checkpoint

    path = write_checkpoint(untokenized_model, str(tmp_path / "fp8"), "ct-fp8")
    fp8_gemm = torch.cuda.get_device_capability() >= (8, 9)
    llm = cuda_llm(path)
    qkv = llm.llm_engine.executor.worker.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.qtype == ("fp8" if fp8_gemm else None)
    if fp8_gemm:
        x = torch.randn(37, qkv.input_size, device="cuda")
        got = reference.fp8_linear_scaled_mm(x, qkv.weight, qkv.weight_scale)
        assert rel_err(got, reference.fp8_linear(x, qkv.weight, qkv.weight_scale)) < TOLERANCE[torch.bfloat16]
    assert [len(t) for t in greedy_ids(llm, cuda_prompts(), 16)] == [16] * 7
    ids = torch.randint(3, 512, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    logprobs = {}
    for device in ("cuda", "cpu"):
        if device == "cpu":
            monkeypatch.setenv("PDSERVE_KERNELS", "reference")     # (no C++ build on a GPU machine)
        for quantization in ("none", "fp8"):
            logprobs[device, quantization] = quality.teacher_forced_logprobs(
                ids, 64, path, device=device, dtype="float32", quantization=quantization)
    on_cuda = quality.agreement(logprobs["cuda", "none"], logprobs["cuda", "fp8"]).mean_kl
    on_cpu = quality.agreement(logprobs["cpu", "none"], logprobs["cpu", "fp8"]).mean_kl
    across = quality.agreement(logprobs["cpu", "fp8"], logprobs["cuda", "fp8"]).mean_kl
    print(f"fp8 weights, mean KL against exact: {on_cuda:.4f} on CUDA, {on_cpu:.4f} on the CPU; "
          f"CUDA against the CPU's fp8 path {across:.4f}")
    assert quality.agreement(logprobs["cpu", "none"], logprobs["cuda", "none"]).mean_kl < 1e-5
    assert on_cuda <= 1.2 * on_cpu
    assert across <= 0.06


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if CUDA else [torch.float32])
def test_fp8_gemv_matches_reference(dtype):
    """One row of x times fp8 weights (single-sequence decode) on the Triton GEMV: the reference's
    product (x quantized per row, exact products summed in fp32, both scales), whole and split
    over the features, with a feature count no launch tile divides, per-channel and per-tensor
    scales."""
    from engine.loading.quant_checkpoint import quantize_fp8

    g = torch.Generator().manual_seed(3)
    shapes = [(6144, 4096), (4096, 14336), (1000, 4128)] if CUDA else [(40, 96), (300, 544)]
    for n, k in shapes:
        w = quantize_fp8(torch.randn(n, k, generator=g).to(DEVICE) * 0.02)
        x = (torch.randn(1, k, generator=g) * torch.rand(1, k, generator=g) * 3).to(DEVICE, dtype)
        for scale in (w.scale, w.scale[:1].expand(n).clone()):
            want = reference.fp8_linear(x, w.weight, scale)
            for splits in (1, 3, 4):
                got = triton_quant.fp8_gemv(x, w.weight, scale, splits=splits,
                                            quantize_rows=None if CUDA else reference.quantize_fp8_rows)
                assert got.shape == want.shape and got.dtype == dtype
                assert rel_err(got, want) < TOLERANCE[dtype], (n, k, splits)


@gpu
@pytest.mark.gpu
def test_fp8_row_quantize_on_cuda_matches_reference():
    """The Triton kernel that quantizes x's rows for fp8 linears: the reference's scales and e4m3
    bytes exactly (rows of very different magnitudes, a zero row, one outlier, features not a
    multiple of the kernel's step), and so the same fp8 GEMM. (GPU only: the interpreter's fp32 ->
    e4m3 conversion rounds values just below a power of two down.)"""
    from engine.loading.quant_checkpoint import quantize_fp8

    g = torch.Generator().manual_seed(11)
    magnitudes = torch.tensor([1.0, 300.0, 1e-4, 0.0, 7.0, 2.0 ** -20])[:, None]
    for k in (96, 1500, 4096):
        x = torch.randn(6, k, generator=g) * magnitudes
        x[4, 3] = 6e4
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xc = x.to(dtype).cuda()
            q, scale = triton_quant.quantize_fp8_rows(xc)
            want_q, want_scale = reference.quantize_fp8_rows(xc)
            assert torch.equal(scale, want_scale)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), (k, dtype)
    w = quantize_fp8(torch.randn(64, 4096, generator=g).cuda() * 0.02)
    x = torch.randn(5, 4096, generator=g).to("cuda", torch.bfloat16)
    want = reference.fp8_linear_scaled_mm(x, w.weight, w.scale)
    assert torch.equal(triton_quant.fp8_linear(x, w.weight, w.scale), want)


@gpu
@pytest.mark.gpu
def test_fp8_kv_cache_on_cuda_matches_the_reference_kernels(untokenized_model, monkeypatch):
    """kv_cache_dtype="fp8" on CUDA: the Triton kernels (eager and in CUDA graphs) give the torch
    reference kernels' greedy tokens on the same GPU (same matmuls, same quantized slots)."""
    runs = {}
    for kernels, eager in (("reference", True), ("triton", True), ("triton", False)):
        monkeypatch.setenv("PDSERVE_KERNELS", kernels)
        llm = cuda_llm(untokenized_model, kv_cache_dtype="fp8", calculate_kv_scales=False, enforce_eager=eager)
        assert llm.llm_engine.executor.worker.runner.kv_caches[0].dtype == torch.float8_e4m3fn
        runs[kernels, eager] = greedy_ids(llm, cuda_prompts(), 16)
    assert runs["triton", True] == runs["reference", True]
    assert runs["triton", False] == runs["reference", True]


@gpu
@pytest.mark.gpu
def test_lora_on_cuda_matches_peft(untokenized_model, tmp_path):
    """Two adapters (ranks 8 and 16, different projections) and the base model in one batch on
    CUDA through the Triton LoRA kernels: greedy tokens equal transformers + PEFT's."""
    from helpers import make_adapter, peft_greedy

    from engine import LoRARequest

    a1 = make_adapter(untokenized_model, str(tmp_path / "a1"), 8, ["q_proj", "v_proj", "down_proj"], seed=1)
    a2 = make_adapter(untokenized_model, str(tmp_path / "a2"), 16, ["k_proj", "o_proj", "gate_proj", "up_proj"],
                      seed=2)
    prompts = cuda_prompts()[:6]
    adapters = [None, a1, a2, a1, None, a2]
    want = [peft_greedy(untokenized_model, a, [p], 16)[0] for p, a in zip(prompts, adapters)]
    llm = cuda_llm(untokenized_model, enable_lora=True, max_loras=2, max_lora_rank=16)
    loras = {a1: LoRARequest("a1", 1, a1), a2: LoRARequest("a2", 2, a2)}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[loras.get(a) for a in adapters])
    assert [o.outputs[0].token_ids for o in outs] == want
