"""How a model's weights and KV cache are quantized: a checkpoint's own quantization
(`checkpoint_quant`), what `quantization` resolves to for a model on this machine
(`resolve_quantization`), and an fp8 checkpoint's KV-cache scales (`kv_cache_scales`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from records.cpu_flags import fast_block_kernels
from records.gguf_file import gguf_architecture, gguf_reader

# GGUF weights pdserve keeps in their blocks (kernels/reference.py: the layouts), and the GGUF
# architectures whose tensors it maps without dequantizing (their converters only reorder rows).
GGUF_NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1")


GGUF_NATIVE_ARCHITECTURES = ("llama", "mistral", "qwen2")


# "gguf": a GGUF file's blocks; "int8": an 8-bit weight-only checkpoint's rows, kept as Q8_0 blocks
# (engine/loading/quant_checkpoint.py); "+dense" adds a dense copy for large batches; "fp8": e4m3 weights
# (an fp8 checkpoint's, or a dense checkpoint's quantized at load) multiplied by torch._scaled_mm;
# "none": every weight dense in the model's dtype.
QUANTIZATIONS = ("gguf", "gguf+dense", "int8", "int8+dense", "fp8", "none")


# Those whose weights stay in GGUF blocks (what quantize_activations applies to).
BLOCK_QUANTIZATIONS = ("gguf", "gguf+dense", "int8", "int8+dense")


_DENSE_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class CheckpointQuant:
    """How a safetensors checkpoint stores its linear weights, from config.json's
    `quantization_config`: `weights` "int8" (symmetric, a scale per output channel or per group of
    input features: W8A16) or "fp8" (e4m3, a scale per tensor or per output channel), in the
    `layout` of "compressed-tensors", "gptq" (8-bit; `gptq_v2`: zero points stored as they are, not
    minus one) or "fp8" (vLLM's own fp8 checkpoints)."""
    weights: str
    layout: str
    gptq_v2: bool = False


def checkpoint_quant(hf_config: Any) -> CheckpointQuant | None:
    """The checkpoint's weight quantization (None: dense weights); ValueError, naming the config
    field, for what pdserve cannot read: other methods, bit widths, zero points, act-order, blocks."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(f"quantization_config.weight_block_size: block-wise fp8 scales are not supported "
                             f"(per-tensor and per-channel are); got {qc['weight_block_size']}")
        return CheckpointQuant("fp8", "fp8")
    if method == "gptq":
        if qc.get("bits") != 8:
            raise ValueError(f"quantization_config.bits: pdserve reads 8-bit GPTQ checkpoints (W8A16); got "
                             f"{qc.get('bits')}")
        if not qc.get("sym", True) or qc.get("desc_act"):
            raise ValueError(f"quantization_config: GPTQ checkpoints need sym=true and desc_act=false (no zero "
                             f"points, groups in order); got sym={qc.get('sym')}, desc_act={qc.get('desc_act')}")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format must be gptq or gptq_v2; got {fmt!r}")
        return CheckpointQuant("int8", "gptq", gptq_v2=fmt == "gptq_v2")
    if method == "compressed-tensors":
        return CheckpointQuant(_compressed_tensors_weights(qc), "compressed-tensors")
    raise ValueError(f"quantization_config.quant_method must be one of compressed-tensors (8-bit int or fp8 "
                     f"weights), gptq (8-bit) or fp8; got {method!r} (a dense checkpoint has no quantization_config)")


_CT_FORMATS = {"int": ("pack-quantized", "int-quantized", "naive-quantized"),
               "float": ("float-quantized", "naive-quantized")}


def _compressed_tensors_weights(qc: dict) -> str:
    """"int8" or "fp8": what every config group of a compressed-tensors config quantizes weights to."""
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"quantization_config.sparsity_config: sparse formats are not supported; got "
                         f"{sparsity.get('format')!r}")
    kinds = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w, field = group.get("weights") or {}, f"quantization_config.config_groups.{name}"
        kind = w.get("type")
        if w.get("num_bits") != 8 or kind not in _CT_FORMATS:
            raise ValueError(f"{field}.weights: pdserve reads 8-bit int (W8A16) and fp8 weights; got "
                             f"num_bits={w.get('num_bits')}, type={kind!r}")
        if not w.get("symmetric", True):
            raise ValueError(f"{field}.weights.symmetric must be true (zero points are not supported)")
        if w.get("strategy") not in ("channel", "group", "tensor"):
            raise ValueError(f"{field}.weights.strategy must be channel, group or tensor; got {w.get('strategy')!r}")
        if w.get("actorder") not in (None, False, "static"):
            raise ValueError(f"{field}.weights.actorder: reordered groups are not supported; got {w.get('actorder')!r}")
        fmt = group.get("format") or qc.get("format")
        if fmt not in _CT_FORMATS[kind]:
            raise ValueError(f"{field}: format for {kind} weights must be one of {_CT_FORMATS[kind]}; got {fmt!r}")
        kinds.add("int8" if kind == "int" else "fp8")
    if len(kinds) != 1:
        raise ValueError(f"quantization_config.config_groups must quantize weights to one of int8 or fp8; "
                         f"got {sorted(kinds) or 'no groups'}")
    return kinds.pop()


def resolve_quantization(quantization: str | None, path: str, gguf_file: str | None, hf_config: Any,
                         on_gpu: bool) -> str:
    """`quantization` (None = auto, or one of QUANTIZATIONS) for this model -> one of QUANTIZATIONS.

    "gguf" keeps a GGUF file's Q8_0/Q4_0/Q4_1 weights in their blocks only (about a quarter of bf16's
    bytes), multiplied by the kernel set's `gguf_linear`: on CPU the C++ kernel for decode-sized
    batches, dequantize + GEMM for larger ones. "gguf+dense" also keeps each weight dense in the
    model's dtype (prepacked for oneDNN) for batches of `gguf_dense_min_rows` rows or more: the
    blocks are 1.7x faster at batch 1, the dense GEMM 2x faster from ~12 rows (docs/perf/journal.md
    §9). "int8"/"int8+dense" do the same with an int8 checkpoint's weights (as Q8_0 blocks). "fp8"
    keeps an fp8 checkpoint's e4m3 weights, or quantizes a dense checkpoint's linear weights at load.
    "none" dequantizes at load. Auto: a checkpoint's own quantization where it pays (the block
    kernels: on GPU, or on a CPU where they were measured faster, with a dense copy there; fp8: on
    GPU only, since CPUs have no fp8 GEMM), else "none"."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None (auto); got {quantization!r}")
    if gguf_file is None:
        return _checkpoint_quantization(quantization, path, checkpoint_quant(hf_config), on_gpu)
    if quantization == "none" or (quantization is None and (on_gpu or not fast_block_kernels())):
        return "none"
    if quantization not in (None, "gguf", "gguf+dense"):
        raise ValueError(f"quantization={quantization!r} needs a safetensors checkpoint; {gguf_file} is a GGUF "
                         f"file (quantization='gguf', 'gguf+dense' or 'none')")
    reader = gguf_reader(os.path.join(path, gguf_file))
    arch = gguf_architecture(reader)
    if quantization is None and (arch not in GGUF_NATIVE_ARCHITECTURES or _unsupported(reader)):
        return "none"
    if arch not in GGUF_NATIVE_ARCHITECTURES:
        raise ValueError(f"quantization={quantization!r} supports GGUF architectures {GGUF_NATIVE_ARCHITECTURES}; "
                         f"{gguf_file} is {arch!r} (quantization='none' dequantizes it)")
    unsupported = _unsupported(reader)
    if unsupported:
        raise ValueError(f"quantization={quantization!r} keeps {GGUF_NATIVE_TYPES} blocks; {gguf_file} also has "
                         f"{unsupported} tensors (quantization='none' dequantizes them)")
    return quantization or "gguf+dense"


def _checkpoint_quantization(quantization: str | None, path: str, quant: CheckpointQuant | None,
                             on_gpu: bool) -> str:
    """resolve_quantization for a safetensors checkpoint stored with `quant` (None: dense)."""
    have = "dense" if quant is None else quant.weights
    if quantization is None:
        if have == "int8" and (on_gpu or fast_block_kernels()):
            return "int8" if on_gpu else "int8+dense"
        return "fp8" if have == "fp8" and on_gpu else "none"
    if quantization == "none" or (quantization == "fp8" and have in ("dense", "fp8")):
        return quantization
    if quantization.startswith("int8") and have == "int8":
        return quantization
    if quantization.startswith("gguf"):
        raise ValueError(f"quantization={quantization!r} needs a .gguf model file; {path!r} is a checkpoint "
                         f"directory")
    raise ValueError(f"quantization={quantization!r} does not fit this checkpoint's {have} weights; use "
                     f"{'int8, int8+dense' if have == 'int8' else 'fp8'} or none")


def _unsupported(reader: Any) -> list[str]:
    """The types of a GGUF file's matrices that are neither dense nor kept in blocks."""
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    return sorted(types - set(GGUF_NATIVE_TYPES) - set(_DENSE_TYPES))


# Where fp8 checkpoints keep a layer's KV-cache scales (vLLM reads the same names): one per K and
# per V, or one for both (older checkpoints), or as the K/V projections' output scales (ModelOpt).
_KV_SCALE_NAMES = {"self_attn.k_scale": (0,), "self_attn.v_scale": (1,), "self_attn.kv_scale": (0, 1),
                   "self_attn.k_proj.output_scale": (0,), "self_attn.v_proj.output_scale": (1,)}


def kv_cache_scales(path: str, gguf_file: str | None, hf_config: Any) -> tuple[tuple[float, float], ...]:
    """Each layer's (K scale, V scale) for an fp8 KV cache, from the checkpoint's safetensors files
    (only those tensors are read); () when it has none (every scale 1.0, vLLM's default). A
    stored value x = K / k_scale, and K = x * k_scale on load."""
    if gguf_file is not None:
        return ()
    from safetensors import safe_open  # noqa: PLC0415

    num_layers = hf_config.num_hidden_layers
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    found = False
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                parts = key.removeprefix("model.").split(".", 2)
                if parts[0] != "layers" or len(parts) < 3 or parts[2] not in _KV_SCALE_NAMES:
                    continue
                value = float(f.get_tensor(key).float().reshape(-1)[0])
                if not value > 0 or value == float("inf"):
                    raise ValueError(f"kv_cache_dtype='fp8': {key} in {name} must be a positive finite scale; "
                                     f"got {value}")
                for i in _KV_SCALE_NAMES[parts[2]]:
                    scales[int(parts[1])][i] = value
                found = True
    return tuple((k, v) for k, v in scales) if found else ()
