"""GGUF weights kept in their blocks: the dequantization against the gguf package's, the compiled
linear against dequantize-then-matmul, the loader's mapping against transformers', the choice of
`quantization`, and the embedded model served from its Q4_1 blocks token-identical to the same
weights dequantized."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.weights import GGUFWeight, iterate_weights
from kernels import cpu_ops, gguf_format, reference
from records.cpu_flags import fast_block_kernels
from records.frozen_config import FrozenConfig
from records.model_source import embedded_model_path, resolve_model
from records.quantization import resolve_quantization

TYPES = ["Q8_0", "Q4_0", "Q4_1"]


def quantized(rows: int, cols: int, qtype: str, seed: int = 0) -> torch.Tensor:
    """Random weights quantized by the gguf package (llama.cpp's own quantizers, in numpy)."""
    import gguf

    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.1
    return torch.from_numpy(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype)))


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_matches_the_gguf_package(qtype):
    import gguf

    blocks = quantized(7, 96, qtype)
    ours = gguf_format.dequantize_gguf(blocks, qtype)
    theirs = gguf.quants.dequantize(blocks.numpy(), getattr(gguf.GGMLQuantizationType, qtype))
    assert ours.shape == (7, 96) and np.array_equal(ours.numpy(), theirs)
    assert torch.equal(gguf_format.dequantize_gguf(blocks, qtype, torch.bfloat16), ours.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", TYPES)
def test_quantize_matches_the_gguf_package(qtype):
    """Our torch quantizer (a weight update into a layer kept in blocks) makes llama.cpp's bytes:
    random rows, an all-zero block, a constant block, halves exactly between two steps, and the
    value of largest magnitude negative in one block and positive in another (Q4_0 keeps its sign)."""
    import gguf

    w = np.random.default_rng(4).standard_normal((11, 128)).astype(np.float32) * 0.05
    w[1, :32] = 0
    w[2, 32:64] = 0.375
    w[3, :32] = np.arange(32) * 0.125 - 2
    w[4, 64:96] = np.linspace(-1, 0.5, 32)
    w[4, 96:] = np.linspace(-0.5, 1, 32)
    theirs = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype))
    ours = gguf_format.quantize_gguf(torch.from_numpy(w), qtype)
    assert ours.dtype == torch.uint8 and np.array_equal(ours.numpy(), theirs)
    assert torch.equal(gguf_format.quantize_gguf(torch.from_numpy(w).to(torch.bfloat16), qtype),
                       gguf_format.quantize_gguf(torch.from_numpy(w).to(torch.bfloat16).float(), qtype))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_linear_matches_dequantize_then_matmul(qtype, dtype):
    """Rows below gguf_dequant_min_rows() run the C++ kernel (any count: whole passes of 8 rows,
    which on AVX2 dequantize each block once, and the rest, which take the factored loop; blocks two
    at a time and an odd last one), from it on dequantize + GEMM; an odd number of output rows."""
    cpu_ops.load()
    for rows, cols in [(1, 128), (3, 160), (5, 96), (8, 128), (13, 160), (cpu_ops.gguf_dequant_min_rows(), 128)]:
        blocks = quantized(37, cols, qtype, seed=1)        # an even and an odd number of blocks per row
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
        out = cpu_ops.gguf_linear(x, blocks, qtype)
        ref = reference.gguf_linear(x.float(), blocks, qtype)   # fp32 oracle of the same products
        assert out.dtype == dtype and out.shape == (rows, 37)
        tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        if dtype != torch.float32:      # the kernel multiplies the weights rounded to x's dtype
            ref = reference.gguf_linear(x, blocks, qtype).float()
        assert ((out.float() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activation_kernel_matches_its_reference(qtype, dtype):
    """quantize_activations: the C++ kernel (x quantized to int8 per block, integer dot products)
    against its torch oracle, every pass shape as above; from gguf_dequant_min_rows() rows on it is
    the exact gguf_linear. The quantized x: each block's largest value maps to +-127, a zero block to
    zeros."""
    cpu_ops.load()
    # 4-18 blocks a row: the AVX2 kernel takes eight blocks at a time, the rest one by one
    for rows, cols in [(1, 128), (3, 160), (8, 128), (13, 160), (1, 576), (5, 320), (8, 576), (11, 512),
                       (cpu_ops.gguf_dequant_min_rows(), 128)]:
        blocks = quantized(37, cols, qtype, seed=1)
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        x[0, :32] = 0                                                      # an all-zero block
        x = x.to(dtype)
        out = cpu_ops.gguf_linear_int8(x, blocks, qtype)
        assert out.dtype == dtype and out.shape == (rows, 37)
        if rows >= cpu_ops.gguf_dequant_min_rows():
            assert torch.equal(out, cpu_ops.gguf_linear(x, blocks, qtype))
            continue
        ref = reference.gguf_linear_int8(x, blocks, qtype).float()
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        assert ((out.float() - ref).norm() / ref.norm()).item() < tol
        exact = reference.gguf_linear(x.float(), blocks, qtype)
        assert 1e-4 < ((ref - exact).norm() / exact.norm()).item() < 0.05          # lossy, boundedly
    q, dx = reference.quantize_rows_int8(x.float())
    assert torch.equal(q[0, 0], torch.zeros(32, dtype=torch.int8)) and dx[0, 0].item() == 0
    assert torch.equal(q[:, 1:].abs().amax(-1), torch.full_like(q[:, 1:, 0], 127))


def test_compiled_linear_refuses_bad_shapes():
    cpu_ops.load()
    blocks = quantized(4, 64, "Q4_1")
    with pytest.raises(RuntimeError, match="x has 96 features but the blocks' rows hold 40 bytes"):
        torch.ops.pdserve_cpu.gguf_linear(torch.randn(2, 96), blocks, 2)
    with pytest.raises(ValueError, match="GGUF type must be one of"):
        cpu_ops.gguf_linear(torch.randn(2, 64), blocks, "Q5_K")


def test_gguf_weight_shards_on_block_boundaries():
    w = GGUFWeight(quantized(6, 128, "Q8_0"), "Q8_0", 128)
    assert w.shape == (6, 128)
    assert torch.equal(w.narrow(0, 2, 3).dequantize(), w.dequantize()[2:5])
    assert torch.equal(w.narrow(1, 64, 64).dequantize(), w.dequantize()[:, 64:])
    with pytest.raises(ValueError, match="tensor_parallel_size must divide 4"):
        w.narrow(1, 48, 48)


def test_gguf_loaders_match_transformers_dequantization(embedded_gguf_tensors):
    """Every tensor of the embedded GGUF, read dense or kept in blocks (then dequantized), is exactly
    what transformers' GGUF loader yields (names, the llama row order of attn_q/attn_k, values,
    dtypes); both read with the model's config as a replica receives it (frozen:
    records/frozen_config.py). pdserve reads its architectures' files itself (~8 s less per load)."""
    path, gguf_file, hf_config = resolve_model(None)
    theirs = embedded_gguf_tensors[1]
    dense = dict(iterate_weights(path, gguf_file, FrozenConfig.of(hf_config)))
    native = dict(iterate_weights(path, gguf_file, FrozenConfig.of(hf_config), keep_quantized=True))
    assert set(native) == set(dense) == set(theirs)
    assert {type(v).__name__ for v in dense.values()} == {"Tensor"}
    assert {type(v).__name__ for v in native.values()} == {"GGUFWeight", "Tensor"}
    for name, value in theirs.items():
        assert dense[name].dtype == value.dtype and torch.equal(dense[name], value), name
        got = native[name].dequantize() if isinstance(native[name], GGUFWeight) else native[name]
        assert torch.equal(got.float(), value.float()), name


def test_gguf_reader_keeps_gguf_pys_tensors_and_scalars():
    """records/gguf_file.py: gguf_reader steps over the metadata's arrays (the tokenizer's) instead of
    parsing them: every tensor (name, type, shape, offset, bytes) and every scalar or string field
    is gguf-py's own; only the arrays are left out."""
    from gguf import GGUFReader, GGUFValueType

    from records.gguf_file import gguf_reader

    path = embedded_model_path()
    fast, full = gguf_reader(path), GGUFReader(path)
    assert fast.data_offset == full.data_offset and len(fast.tensors) == len(full.tensors) > 0
    for a, b in zip(fast.tensors, full.tensors):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.data_offset, a.data.shape, a.data.dtype) == (
            b.name, b.tensor_type, b.shape.tolist(), b.data_offset, b.data.shape, b.data.dtype)
        assert np.array_equal(a.data, b.data), a.name
    arrays = {k for k, f in full.fields.items() if f.types[0] == GGUFValueType.ARRAY}
    assert "tokenizer.ggml.tokens" in arrays and set(fast.fields) == set(full.fields) - arrays
    for key, field in fast.fields.items():
        assert [bytes(p) for p in field.parts] == [bytes(p) for p in full.fields[key].parts], key


def test_gguf_config_and_tokenizer_come_converted_once_and_unchanged(tmp_path, monkeypatch):
    """A GGUF file's HF config and tokenizer are converted by transformers once and saved
    (records/gguf_file.py: gguf_hf_dir): what loads from the saved files is what transformers converts from
    the file: the config's fields, the vocabulary, special tokens, chat template, encodings."""
    import os

    from transformers import AutoConfig, AutoTokenizer

    from engine.text.tokenizer import load_tokenizer
    from records.gguf_file import gguf_hf_dir

    monkeypatch.setenv("PDSERVE_GGUF_CACHE", str(tmp_path))
    path, gguf_file = os.path.split(embedded_model_path())
    saved = gguf_hf_dir(path, gguf_file)
    assert os.path.dirname(saved) == str(tmp_path) and gguf_hf_dir(path, gguf_file) == saved
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(saved)]       # no staging left behind
    config = resolve_model(None)[2].to_dict()
    direct = AutoConfig.from_pretrained(path, gguf_file=gguf_file).to_dict()
    assert {k: v for k, v in config.items() if k != "_name_or_path"} == {
        k: v for k, v in direct.items() if k != "_name_or_path"}
    tok, want = load_tokenizer(path, gguf_file), AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    assert type(tok) is type(want) and tok.get_vocab() == want.get_vocab()
    assert tok.chat_template == want.chat_template and tok.special_tokens_map == want.special_tokens_map
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (want.bos_token_id, want.eos_token_id,
                                                                      want.pad_token_id)
    texts = ["Hello wörld 🌍 <|im_start|>user\n  x\t\ty", "def f(a, b):\n    return a**2 // b  # ok", " " * 5]
    for text in texts:
        assert tok.encode(text) == want.encode(text)
        assert tok.decode(want.encode(text)) == want.decode(want.encode(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[0]}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == want.apply_chat_template(
        messages, add_generation_prompt=True)


def test_quantization_choice(tiny_llama):
    path, gguf_file, config = resolve_model(None)
    auto = "gguf+dense" if fast_block_kernels() else "none"      # auto on CPU: blocks where they are fast
    assert resolve_quantization(None, path, gguf_file, config, on_gpu=False) == auto
    assert resolve_quantization(None, path, gguf_file, config, on_gpu=True) == "none"
    for explicit in ("gguf", "gguf+dense", "none"):
        assert resolve_quantization(explicit, path, gguf_file, config, on_gpu=False) == explicit
    with pytest.raises(ValueError, match="quantization='int8' needs a safetensors checkpoint"):
        resolve_quantization("int8", path, gguf_file, config, on_gpu=False)
    dense = resolve_model(tiny_llama)[2]
    assert resolve_quantization(None, tiny_llama, None, dense, on_gpu=False) == "none"
    assert resolve_quantization("fp8", tiny_llama, None, dense, on_gpu=False) == "fp8"   # quantized at load
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model file"):
        resolve_quantization("gguf", tiny_llama, None, dense, on_gpu=False)
    with pytest.raises(ValueError, match="quantization='int8' does not fit this checkpoint's dense weights"):
        resolve_quantization("int8", tiny_llama, None, dense, on_gpu=False)
    with pytest.raises(ValueError, match="quantization must be one of \\('gguf', 'gguf\\+dense', 'int8'"):
        LLM(tiny_llama, quantization="int4")
    with pytest.raises(ValueError, match="quantize_activations multiplies weights kept in blocks on CPU .* "
                                         "resolved to quantization='none'"):
        LLM(tiny_llama, quantize_activations=True)
    with pytest.raises(ValueError, match="quantize_activations .* worker_num_gpus=1"):
        LLM(None, quantization="gguf", quantize_activations=True, worker_num_gpus=1)


def test_unsupported_gguf_type_is_refused(tmp_path):
    """A file with a tensor type the kernels lack: 'gguf' refuses it naming the type, auto falls
    back to dequantizing."""
    import gguf

    file = tmp_path / "q5.gguf"
    writer = gguf.GGUFWriter(str(file), "llama")
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    writer.add_tensor("blk.0.attn_k.weight", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="also has \\['Q5_0'\\] tensors"):
        resolve_quantization("gguf", str(tmp_path), file.name, None, on_gpu=False)
    assert resolve_quantization(None, str(tmp_path), file.name, None, on_gpu=False) == "none"


def test_embedded_model_from_its_blocks_equals_dequantized_weights():
    """The embedded Q4_1 model served from its blocks gives the same greedy tokens (fp32) as the same
    weights dequantized at load, whether large batches take the blocks (dequantize + GEMM) or a
    dense copy: a batch with a long prefill and 9 decoding rows, then 3 rows (the blocks' kernel)."""
    assert embedded_model_path()
    prompts = [[1, 504, 3458, 282, 4055, 314, 253], [1, 9690, 198, 2683, 2], list(range(100, 300))]
    prompts += [[1, 30 + i, 700 + 3 * i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for quantization in ("gguf", "gguf+dense", "none"):
        llm = LLM(dtype="float32", quantization=quantization, max_model_len=512)
        assert llm.llm_engine.config.model_config.quantization == quantization
        outs[quantization] = [[r.outputs[0].token_ids for r in llm.generate(
            [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)] for batch in (prompts, prompts[:3])]
        if quantization != "none":
            model = llm.llm_engine.executor.worker.runner.model
            qkv = model.layers[0].self_attn.qkv_proj
            assert qkv.qtype == "Q4_1" and qkv.weight.dtype == torch.uint8
            assert model.embed_tokens.qtype == "Q8_0"
            assert (qkv.dense is not None) == (quantization == "gguf+dense")
        del llm
    assert outs["gguf"] == outs["none"] and outs["gguf+dense"] == outs["none"]


@pytest.mark.parametrize("qtype", TYPES)
def test_compiled_dequantize_is_exact(qtype):
    cpu_ops.load()
    blocks = quantized(9, 160, qtype, seed=2)
    qid = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}[qtype]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(torch.ops.pdserve_cpu.gguf_dequantize(blocks, qid, dtype),
                           gguf_format.dequantize_gguf(blocks, qtype, dtype))


def test_tensor_parallel_shards_of_gguf_weights():
    """Column-parallel layers split the blocks' rows, row-parallel ones their input features on block
    boundaries; each rank's shard equals the same shard of the dense weight; a split inside a block
    is refused naming tensor_parallel_size."""
    from engine.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from engine.model.parallel_state import ParallelState, reset_parallel_state, set_parallel_state

    gate, up = (GGUFWeight(quantized(64, 128, "Q4_1", seed=s), "Q4_1", 128) for s in (3, 4))
    down = GGUFWeight(quantized(128, 64 * 2, "Q8_0", seed=5), "Q8_0", 128)
    try:
        for rank in (0, 1):
            set_parallel_state(ParallelState(tp_rank=rank, tp_size=2))
            merged = MergedColumnParallelLinear(128, [64, 64])
            merged.quantize_as("Q4_1")
            merged.weight_loader(merged.weight, gate, 0)
            merged.weight_loader(merged.weight, up, 1)
            want = torch.cat([gate.dequantize()[rank * 32:(rank + 1) * 32], up.dequantize()[rank * 32:(rank + 1) * 32]])
            assert torch.equal(gguf_format.dequantize_gguf(merged.weight.data, "Q4_1"), want)
            row = RowParallelLinear(128, 128)
            row.quantize_as("Q8_0")
            row.weight_loader(row.weight, down)
            assert torch.equal(gguf_format.dequantize_gguf(row.weight.data, "Q8_0"),
                               down.dequantize()[:, rank * 64:(rank + 1) * 64])
        set_parallel_state(ParallelState(tp_rank=0, tp_size=8))     # 16 input features per rank
        row = RowParallelLinear(128, 128)
        with pytest.raises(ValueError, match="tensor_parallel_size must divide"):
            row.quantize_as("Q8_0")
    finally:
        reset_parallel_state()


def test_half_precision_on_a_cpu_without_bf16_units_is_warned(tiny_llama, monkeypatch, caplog):
    """bfloat16 / float16 on a CPU without AVX512-BF16 or AMX (several times slower than float32
    there, docs/perf/journal.md §9; "auto" takes a checkpoint's bfloat16) is logged at config time, saying
    what to pass; float32, or a CPU with the units, is not."""
    import logging

    from records import cpu_flags
    from records.config_resolution import engine_config_from_args
    from records.engine_args import EngineArgs

    avx2 = frozenset({"avx2", "fma", "f16c"})
    monkeypatch.setattr(cpu_flags, "cpu_flags", lambda: avx2)
    assert "dtype='float32'" in cpu_flags.slow_half_dtype_warning("bfloat16")
    assert cpu_flags.slow_half_dtype_warning("float32") is None
    with caplog.at_level(logging.WARNING, logger="records.config"):
        engine_config_from_args(tiny_llama, EngineArgs(dtype="bfloat16", max_model_len=64))
    assert any("runs several times slower than float32" in r.message for r in caplog.records)
    for flags in (avx2 | {"avx512_bf16"}, avx2 | {"amx_bf16"}, frozenset()):
        monkeypatch.setattr(cpu_flags, "cpu_flags", lambda flags=flags: flags)
        assert cpu_flags.slow_half_dtype_warning("bfloat16") is None
