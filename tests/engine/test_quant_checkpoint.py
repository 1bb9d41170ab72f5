"""Quantized safetensors checkpoints (engine/loading/quant_checkpoint.py): int8 weight-only checkpoints in the
compressed-tensors and GPTQ layouts, and fp8 checkpoints, written here from a tiny random model by
packers that follow each layout's own description (not pdserve's unpacking). The oracle of an int8
checkpoint is transformers on the same weights dequantized (w = q * scale): pdserve's greedy tokens
(fp32) must equal its. fp8 weights quantize the activations too, so their bound is measured: on
real text against the exact weights. Bad configs are ValueErrors naming the field."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from helpers import REPO, hf_greedy, mixed_prompts
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.loading.quant_checkpoint import FP8Weight, convert, int8_blocks, quantize_fp8
from kernels import reference
from records.config_resolution import engine_config
from records.quantization import checkpoint_quant

sys.path.append(os.path.join(REPO, "benchmarks"))
import quality  # benchmarks/quality.py (appended to the path: it must not shadow the packages)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def int8_per_group(w: torch.Tensor, group: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 values [N, K] and scales [N, K / group] (amax / 127, held in scale_dtype)."""
    g = w.reshape(w.shape[0], -1, group)
    scale = (g.abs().amax(-1) / 127).to(scale_dtype)
    q = (g / scale.float().unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(w.shape), scale


def pack_compressed_tensors(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized words: value + 128 in bits 8 i of word j, column 4 j + i."""
    u = (q.int() + 128).to(torch.int64)
    packed = torch.zeros(q.shape[0], q.shape[1] // 4, dtype=torch.int64)
    for i in range(4):
        packed |= u[:, i::4] << (8 * i)
    return as_int32(packed)


def pack_gptq_rows(u: torch.Tensor) -> torch.Tensor:
    """GPTQ packing along dim 0: word [i, n] holds u[4 i + j, n] in bits 8 j."""
    u = u.to(torch.int64)
    packed = torch.zeros(u.shape[0] // 4, u.shape[1], dtype=torch.int64)
    for j in range(4):
        packed |= u[j::4] << (8 * j)
    return as_int32(packed)


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (in int64) as the int32 tensors checkpoints store."""
    return (words - (words >= 2**31).long() * 2**32).int()


def write_checkpoint(src: str, dst: str, layout: str, group: int = 0) -> str:
    """`src`'s tiny model with its projections quantized in `layout`; beside it, `dst`-dense: the same
    model with the quantized weights dequantized (the oracle's checkpoint)."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, dense = {}, {}
    for name, w in tensors.items():
        prefix = name.removesuffix(".weight")
        if not any(f".{p}." in name for p in LINEAR):
            out[name] = dense[name] = w
            continue
        n, k = w.shape
        if layout in ("ct-pack", "ct-int"):
            q, scale = int8_per_group(w, group or k, torch.bfloat16)
            dense[name] = q.float() * scale.float().repeat_interleave(group or k, dim=1)
            out[f"{prefix}.weight_scale"] = scale
            if layout == "ct-pack":
                out[f"{prefix}.weight_packed"] = pack_compressed_tensors(q)
                out[f"{prefix}.weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
            else:
                out[f"{prefix}.weight"] = q
        elif layout == "gptq":
            q, scale = int8_per_group(w, group or k, torch.float16)
            dense[name] = q.float() * scale.float().repeat_interleave(group or k, dim=1)
            out[f"{prefix}.qweight"] = pack_gptq_rows((q.int() + 128).t().contiguous())
            zeros = torch.full((scale.shape[1], n), 127)                     # v1: the zero (128) minus one
            out[f"{prefix}.qzeros"] = pack_gptq_rows(zeros.t().contiguous()).t().contiguous()
            out[f"{prefix}.scales"] = scale.t().contiguous()
            out[f"{prefix}.g_idx"] = torch.arange(k, dtype=torch.int32) // (group or k)
        else:                                                    # fp8: per channel (ct) or per tensor
            per_tensor = layout == "fp8"
            amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
            scale = amax / 448
            q = (w / scale).to(torch.float8_e4m3fn)
            dense[name] = q.float() * scale
            out[f"{prefix}.weight"] = q
            out[f"{prefix}.weight_scale"] = scale.reshape(1) if per_tensor else scale
            out[f"{prefix}.input_scale"] = torch.tensor([1.0])
    for path, data in ((dst, out), (dst + "-dense", dense)):
        shutil.copytree(src, path)
        save_file(data, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant_config(layout, group)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def quant_config(layout: str, group: int = 0) -> dict:
    if layout == "gptq":
        return {"quant_method": "gptq", "bits": 8, "group_size": group or -1, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq"}
    if layout == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static"}
    kind = "float" if layout == "ct-fp8" else "int"
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": False,
               "strategy": "group" if group else "channel", "group_size": group or None}
    fmt = {"ct-pack": "pack-quantized", "ct-int": "int-quantized", "ct-fp8": "float-quantized"}[layout]
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}}


@pytest.mark.parametrize("layout,group", [("ct-pack", 0), ("ct-int", 32), ("gptq", 0), ("gptq", 32)])
def test_int8_checkpoint_equals_transformers_on_its_dequantized_weights(tiny_llama, tmp_path, layout, group):
    """Greedy tokens (fp32) from the int8 blocks, from their dense copies (large batches) and from the
    weights dequantized at load all equal transformers' on the dequantized checkpoint."""
    path = write_checkpoint(tiny_llama, str(tmp_path / layout), layout, group)
    prompts = mixed_prompts(1000, seed=3)
    want = hf_greedy(path + "-dense", prompts, GREEDY.max_tokens)
    for quantization in ("int8", "int8+dense", "none"):
        llm = LLM(path, dtype="float32", quantization=quantization, max_model_len=256)
        assert run(llm, prompts) == want, quantization
        qkv = llm.llm_engine.executor.worker.runner.model.layers[0].self_attn.qkv_proj
        assert qkv.qtype == (None if quantization == "none" else "Q8_0")
        assert run(llm, prompts[:3]) == want[:3]                  # few rows: the block kernel
        pool = llm.llm_engine.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks


def test_auto_quantization_of_int8_and_fp8_checkpoints(tiny_llama, tmp_path):
    from records.cpu_flags import fast_block_kernels

    int8 = write_checkpoint(tiny_llama, str(tmp_path / "int8"), "ct-pack")
    fp8 = write_checkpoint(tiny_llama, str(tmp_path / "fp8"), "fp8")
    assert engine_config(int8).model_config.quantization == ("int8+dense" if fast_block_kernels() else "none")
    assert engine_config(fp8).model_config.quantization == "none"     # CPUs have no fast fp8 GEMM
    with pytest.raises(ValueError, match="quantization='fp8' does not fit this checkpoint's int8 weights"):
        engine_config(int8, quantization="fp8")
    with pytest.raises(ValueError, match="quantization='int8' does not fit this checkpoint's fp8 weights"):
        engine_config(fp8, quantization="int8")


@pytest.mark.parametrize("layout", ["fp8", "ct-fp8"])
def test_fp8_checkpoint_serves_its_e4m3_weights(tiny_llama, tmp_path, layout):
    """fp8 weights through torch._scaled_mm (activations quantized per row) on CPU: the layers hold
    the checkpoint's e4m3 bytes and scales; the next-token distributions stay close to the exact
    path on the same (dequantized) weights, and quantization='none' is that exact path."""
    path = write_checkpoint(tiny_llama, str(tmp_path / layout), layout)
    prompts = mixed_prompts(1000, seed=4)
    want = hf_greedy(path + "-dense", prompts, GREEDY.max_tokens)
    assert run(LLM(path, dtype="float32", quantization="none", max_model_len=256), prompts) == want
    llm = LLM(path, dtype="float32", quantization="fp8", max_model_len=256)
    qkv = llm.llm_engine.executor.worker.runner.model.layers[0].self_attn.qkv_proj
    stored = load_file(os.path.join(path, "model.safetensors"))
    q = stored["model.layers.0.self_attn.q_proj.weight"]
    assert qkv.qtype == "fp8" and qkv.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(qkv.weight[:q.shape[0]].view(torch.uint8), q.view(torch.uint8))
    assert torch.allclose(qkv.weight_scale[:q.shape[0]],
                          stored["model.layers.0.self_attn.q_proj.weight_scale"].float().reshape(-1).expand(q.shape[0]))
    assert len(run(llm, prompts)[-1]) == GREEDY.max_tokens
    # Teacher-forced over 200 random tokens against the exact weights: mean KL measured 0.0083. The
    # tiny random model's next-token distributions are flat (near-ties), so top-1 is not bounded here:
    # test_fp8_weights_quality_on_real_text bounds it on a real model.
    ids = torch.randint(3, 1000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    exact = quality.teacher_forced_logprobs(ids, 64, path, dtype="float32", quantization="none")
    fp8 = quality.teacher_forced_logprobs(ids, 64, path, dtype="float32", quantization="fp8")
    assert quality.agreement(exact, fp8).mean_kl <= 0.03


def test_checkpoint_conversion_errors_name_the_field():
    """What pdserve cannot read is refused at config time naming the config field, or at load naming
    the tensor; int8 groups that do not fill 32-feature blocks are refused."""
    class Config:
        def __init__(self, qc):
            self.quantization_config = qc

    cases = [({"quant_method": "awq", "bits": 4}, "quant_method must be one of compressed-tensors"),
             ({"quant_method": "gptq", "bits": 4, "sym": True}, "quantization_config.bits"),
             ({"quant_method": "gptq", "bits": 8, "sym": False}, "sym=true and desc_act=false"),
             ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quantization_config.weight_block_size"),
             (quant_config("ct-pack") | {"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
              "config_groups.g.weights: pdserve reads 8-bit"),
             (quant_config("ct-pack") | {"config_groups": {"g": {"weights": {
                 "num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}}}}, "symmetric must be true"),
             (quant_config("ct-pack") | {"config_groups": {"g": {"weights": {
                 "num_bits": 8, "type": "int", "strategy": "group", "actorder": "group"}}}}, "actorder"),
             (quant_config("ct-pack") | {"format": "marlin-24"}, "format for int weights must be one of")]
    for qc, message in cases:
        with pytest.raises(ValueError, match=message):
            checkpoint_quant(Config(qc))
    quant = checkpoint_quant(Config(quant_config("ct-int")))
    with pytest.raises(ValueError, match="layers.0.mlp.up_proj: int8 weights are kept as blocks of 32"):
        list(convert([("layers.0.mlp.up_proj.weight", torch.zeros(4, 64, dtype=torch.int8)),
                      ("layers.0.mlp.up_proj.weight_scale", torch.ones(4, 4))], quant, keep=True))
    with pytest.raises(ValueError, match=r"has \['weight'\] for layers.0.mlp.up_proj but not \['weight_scale'"):
        list(convert([("layers.0.mlp.up_proj.weight", torch.zeros(4, 64, dtype=torch.int8))], quant, keep=True))


def test_int8_blocks_and_fp8_shards_keep_their_scales():
    """int8 rows with bf16 scales become Q8_0 blocks that dequantize to exactly q * scale; fp8
    weights split by rows (column-parallel) carry their rows' scales and by columns (row-parallel)
    keep every row's, through the layers' loaders."""
    from engine.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from engine.model.parallel_state import ParallelState, reset_parallel_state, set_parallel_state

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g)
    q, scale = int8_per_group(w, 64, torch.bfloat16)
    blocks = int8_blocks(q, scale, "w")
    assert torch.equal(blocks.dequantize(), q.float() * scale.float().repeat_interleave(64, dim=1))
    gate, up = quantize_fp8(torch.randn(64, 128, generator=g)), quantize_fp8(torch.randn(64, 128, generator=g))
    down = quantize_fp8(torch.randn(128, 128, generator=g))
    try:
        for rank in (0, 1):
            set_parallel_state(ParallelState(tp_rank=rank, tp_size=2))
            merged = MergedColumnParallelLinear(128, [64, 64])
            merged.quantize_as("fp8")
            merged.weight_loader(merged.weight, gate, 0)
            merged.weight_loader(merged.weight, up, 1)
            merged.process_weights_after_loading()
            rows = slice(rank * 32, (rank + 1) * 32)
            want = torch.cat([gate.dequantize()[rows], up.dequantize()[rows]])
            got = FP8Weight(merged.weight, merged.weight_scale).dequantize()
            assert torch.equal(got, want)
            row = RowParallelLinear(128, 128)
            row.quantize_as("fp8")
            row.weight_loader(row.weight, down)
            row.process_weights_after_loading()
            assert torch.equal(FP8Weight(row.weight, row.weight_scale).dequantize(),
                               down.dequantize()[:, rank * 64:(rank + 1) * 64])
    finally:
        reset_parallel_state()


def test_fp8_scaled_mm_matches_its_reference():
    """torch._scaled_mm (oneDNN here) against the dequantized fp8 operands' product in fp32."""
    g = torch.Generator().manual_seed(1)
    weight = quantize_fp8(torch.randn(96, 64, generator=g))
    for rows in (1, 5, 40):
        x = torch.randn(rows, 64, generator=g) * torch.linspace(0.1, 10, rows).reshape(-1, 1)
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
            got = reference.fp8_linear_scaled_mm(x.to(dtype), weight.weight, weight.scale)
            want = reference.fp8_linear(x.to(dtype), weight.weight, weight.scale)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


def test_fp8_weights_dequantize_where_the_gpu_has_no_fp8_gemm(monkeypatch):
    """On a GPU below compute capability 8.9 (simulated: the layer is told its device has no fp8
    GEMM) an fp8 layer keeps its checkpoint's weights dequantized to the model's dtype instead of
    failing in torch._scaled_mm at the first step; with fp8 GEMMs it keeps the e4m3 bytes."""
    import engine.model.layers.linear as linear_module

    g = torch.Generator().manual_seed(2)
    weight = quantize_fp8(torch.randn(48, 64, generator=g))
    x = torch.randn(3, 64, generator=g)
    layers = {}
    for fp8_gemm in (True, False):
        monkeypatch.setattr(linear_module, "has_fp8", lambda device, ok=fp8_gemm: ok)
        monkeypatch.setattr(linear_module, "cuda_capability", lambda device: (8, 0))
        layer = linear_module.Linear(64, 48, dtype=torch.float32)
        layer.quantize_as("fp8")
        layer.weight_loader(layer.weight, weight.rows())
        layer.process_weights_after_loading()
        layers[fp8_gemm] = layer
    assert layers[True].qtype == "fp8" and layers[True].weight.dtype == torch.float8_e4m3fn
    assert layers[False].qtype is None and torch.equal(layers[False].weight, weight.dequantize(torch.float32))
    torch.testing.assert_close(layers[False](x), x @ weight.dequantize(torch.float32).t())


def test_quantized_weights_go_where_the_layer_was_built():
    """A worker builds its model on its device (CUDA), then loads the weights outside that scope:
    a layer switched to fp8 or GGUF blocks keeps its device (here the meta device stands for it;
    the GPU tests of test_kernels.py run the real thing)."""
    from engine.model.layers.embedding import VocabParallelEmbedding
    from engine.model.layers.linear import Linear

    for qtype in ("fp8", "Q8_0", "Q4_1"):
        with torch.device("meta"):
            layer = Linear(64, 48)
        layer.quantize_as(qtype)
        assert layer.weight.device.type == "meta"
    with torch.device("meta"):
        table = VocabParallelEmbedding(100, 64)
    table.quantize_as("Q8_0")
    assert table.weight.device.type == "meta"


@pytest.fixture(scope="module")
def embedded_dense(tmp_path_factory) -> str:
    """The embedded model's weights (its Q4_1 values) as a dense fp32 safetensors checkpoint: its
    blocks dequantized (equal to transformers' GGUF loader, test_quant.py)."""
    from engine.loading.weights import GGUFWeight, iterate_weights
    from engine.text.tokenizer import load_tokenizer
    from records.model_source import resolve_model

    path, gguf_file, hf_config = resolve_model(None)
    out = str(tmp_path_factory.mktemp("smollm2-dense"))
    tensors = {name: (t.dequantize() if isinstance(t, GGUFWeight) else t).float().contiguous()
               for name, t in iterate_weights(path, gguf_file, hf_config, keep_quantized=True)}
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(out)
    load_tokenizer(path, gguf_file).save_pretrained(out)
    return out


def test_fp8_weights_quality_on_real_text(embedded_dense):
    """The embedded model's projections quantized to fp8 at load (per output channel; activations
    per token), teacher-forced over 1,000 tokens of a book chapter against the same weights exact
    (fp32). Measured: mean KL 0.033, top-1 agreement 0.894; e4m3 weights alone (activations exact)
    0.017 / 0.930. A 135M model feels e4m3's three mantissa bits far more than the 8B models fp8 is
    usually quoted for (Q8_0 on the same weights: 0.0012 / 0.980, test_fp8_kv.py)."""
    ids = quality.text_ids(embedded_dense, 1000)
    exact = quality.teacher_forced_logprobs(ids, 256, embedded_dense, dtype="float32", quantization="none")
    fp8 = quality.teacher_forced_logprobs(ids, 256, embedded_dense, dtype="float32", quantization="fp8")
    result = quality.agreement(exact, fp8)
    assert result.mean_kl <= 0.05 and result.top1 >= 0.86, result
