"""LoRA adapters as requests name them, and the checks of a PEFT adapter directory (no torch).

A request runs under an adapter when it carries a `LoRARequest` (vLLM's record: name, integer id,
path). An adapter is a PEFT directory: `adapter_config.json` and `adapter_model.safetensors`, whose
tensors are named `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`.
`read_adapter` checks one against the base model and the engine's limits from the config and the
safetensors header alone, so a bad adapter is refused (ValueError naming the field) before its
request is queued; the model side (engine/worker/lora_slots.py) loads the tensors.

What runs is PEFT's plain LoRA: y = W x + (alpha / r) B A x (alpha / sqrt(r) with `use_rslora`) on
the attention and MLP projections. Other PEFT features change the arithmetic (DoRA, biases,
modules_to_save, embedding or LM-head adapters) and are refused by name rather than ignored.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from records.model_source import is_moe_layer

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


@dataclass(frozen=True)
class LoRARequest:
    """Run a request under the adapter at `lora_path`, called `lora_name` (the name the API's
    `model` field takes, and the key of the adapter's slot and of its prefix-cache blocks).
    `lora_int_id` is vLLM's integer id, kept for compatibility; pdserve keys adapters by name."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string; got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1; got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty path; got {self.lora_path!r}")

    @property
    def cache_key(self) -> tuple[str, str, str]:
        """Part of every block hash of a request under this adapter (records/hashing.py): its KV
        differs from the base model's and from any other adapter's from the first token on."""
        return ("lora", self.lora_name, os.path.abspath(self.lora_path))


@dataclass(frozen=True)
class LoRAConfig:
    """The engine's adapter pool: up to `max_loras` adapters in one batch (their slots), ranks up to
    `max_lora_rank`, and `max_cpu_loras` adapters kept loaded in host memory (least recently used
    leave first)."""
    max_loras: int = 8
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None        # None: 4 x max_loras

    def __post_init__(self) -> None:
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1; got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be an integer in [1, 512]; got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}); "
                             f"got {self.max_cpu_loras!r}")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else 4 * self.max_loras


@dataclass(frozen=True)
class AdapterInfo:
    """What `read_adapter` found: the scaling of B A, the rank, each tensor's name -> (layer,
    module, "A" | "B") and its shape."""
    rank: int
    scaling: float
    tensors: dict[str, tuple[int, str, str]]
    shapes: dict[str, tuple[int, int]]


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(input features, output features) of each adapter target in the base model (full, not per
    TP rank)."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def read_adapter(path: str, hf_config: Any, max_rank: int) -> AdapterInfo:
    """Check the PEFT adapter at `path` against the base model and `max_rank` (ValueError naming the
    field: `lora_path`, `r`, `target_modules`, a tensor's shape, ...)."""
    config_path = os.path.join(path, ADAPTER_CONFIG)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(config_path) or not os.path.isfile(weights_path):
        raise ValueError(f"lora_path must be a PEFT adapter directory with {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; "
                         f"got {path!r}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"lora_path: {ADAPTER_CONFIG} is not readable JSON ({e})") from None
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"peft_type must be 'LORA'; got {peft_type!r}")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"r must be a positive integer; got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"r ({rank}) must be <= max_lora_rank ({max_rank}): raise max_lora_rank to serve this adapter")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"lora_alpha must be a number; got {alpha!r}")
    # PEFT features that change the arithmetic: each must have its plain value (the first listed).
    plain = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
             "modules_to_save": (None, []), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
             "layers_to_transform": (None, []), "layers_pattern": (None, [])}
    for key, allowed in plain.items():
        if config.get(key) not in allowed:
            raise ValueError(f"{key} must be {allowed[0]!r} (pdserve runs plain LoRA); got {config[key]!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes = module_shapes(hf_config)
    tensors: dict[str, tuple[int, str, str]] = {}
    shapes_of: dict[str, tuple[int, int]] = {}
    for name, (dtype, shape) in _safetensors_header(weights_path).items():
        layer, module, which = _parse_name(name, hf_config.num_hidden_layers)
        if module in ("gate_proj", "up_proj", "down_proj") and is_moe_layer(hf_config, layer):
            raise ValueError(f"target_modules: layer {layer}'s MLP is a mixture of experts, which pdserve serves "
                             f"without LoRA; the adapter targets its {module!r} (attention projections work)")
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype must be one of {sorted(_SAFETENSORS_DTYPES)}; got {dtype!r}")
        fan_in, fan_out = shapes[module]
        expected = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(shape) != expected:
            raise ValueError(f"{name}: shape must be {list(expected)} for this base model and r={rank}; got "
                             f"{list(shape)} (an adapter trained for another base model?)")
        tensors[name] = (layer, module, which)
        shapes_of[name] = expected
    pairs: dict[tuple[int, str], set[str]] = {}
    for layer, module, which in tensors.values():
        pairs.setdefault((layer, module), set()).add(which)
    half = [f"layers.{layer}.{module}" for (layer, module), have in sorted(pairs.items()) if have != {"A", "B"}]
    if half:
        raise ValueError(f"lora_path: each target needs lora_A and lora_B; only one of them for {half[:3]}")
    if not tensors:
        raise ValueError(f"lora_path: {ADAPTER_WEIGHTS} holds no LoRA tensors")
    return AdapterInfo(rank=rank, scaling=float(scaling), tensors=tensors, shapes=shapes_of)


def _parse_name(name: str, num_layers: int) -> tuple[int, str, str]:
    """`base_model.model.model.layers.{i}.{block}.{module}.lora_{A|B}.weight` -> (i, module, A|B)."""
    parts = name.removeprefix(_PEFT_PREFIX).split(".")
    # model.layers.{i}.{self_attn|mlp}.{module}.lora_X.weight
    if (len(parts) != 7 or parts[0] != "model" or parts[1] != "layers" or not parts[2].isdigit()
            or parts[6] != "weight" or parts[5] not in ("lora_A", "lora_B")):
        raise ValueError(f"target_modules: pdserve serves LoRA on {list(TARGET_MODULES)} of the decoder "
                         f"layers; the adapter has tensor {name!r}")
    layer, module = int(parts[2]), parts[4]
    if module not in TARGET_MODULES:
        raise ValueError(f"target_modules must be among {list(TARGET_MODULES)}; the adapter targets {module!r}")
    if layer >= num_layers:
        raise ValueError(f"{name}: layer {layer} does not exist; the base model has {num_layers} layers")
    return layer, module, parts[5][-1]


def _safetensors_header(path: str) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) from a safetensors file's JSON header (the tensors are not read)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError("header too large")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(f"lora_path: {ADAPTER_WEIGHTS} is not a safetensors file ({e})") from None
    return {name: (meta["dtype"], meta["shape"]) for name, meta in header.items() if name != "__metadata__"}
