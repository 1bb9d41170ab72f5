"""Rotary position embedding with a precomputed cos/sin table; default, linear, llama3 and LongRoPE
(Phi-3) scaling."""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kernels.dispatch import kernels_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of an HF config, old (`rope_theta` + `rope_scaling`) or new (`rope_parameters`);
    where they differ by layer type (Gemma 3: `sliding_attention` / `full_attention`), those of
    `layer_type` (default: the full-attention layers')."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "full_attention" in params:
        params = dict(params[layer_type or "full_attention"])
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    if "full_attention" in scaling:
        scaling = scaling[layer_type or "full_attention"] or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "mrope":            # Qwen2-VL's older configs: M-RoPE's frequencies are the default ones
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type must be one of {SUPPORTED_ROPE_TYPES}; got {rope_type!r}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor must be 1.0 (rotary over the whole head); got {partial!r}")
    params["rope_type"] = rope_type
    if rope_type == "longrope":
        params.setdefault("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None))
        params.setdefault("max_position_embeddings", getattr(hf_config, "max_position_embeddings", None))
    return params


def longrope_tables(head_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """LongRoPE (Phi-3): inverse frequencies with the short and the long factors, the position from
    which the long ones apply (original_max_position_embeddings) and the cos/sin scale
    (transformers' `_compute_longrope_parameters`)."""
    base, original = float(params["rope_theta"]), int(params["original_max_position_embeddings"])
    factor = params.get("factor") or params["max_position_embeddings"] / original
    scale = params.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    short, long = (1.0 / (torch.tensor(params[k], dtype=torch.float32) * base ** shape)
                   for k in ("short_factor", "long_factor"))
    return short, long, original, float(scale)


def compute_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if params["rope_type"] == "linear":
        inv_freq = inv_freq / params["factor"]
    elif params["rope_type"] == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    kernels: ModuleType | None = None     # bound once by ModelRunner (bind_kernels); else looked up per call

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any],
                 dtype: torch.dtype) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.int64).float()
        scale = 1.0
        if params["rope_type"] == "longrope":
            # Positions from original_max_position_embeddings on take the long factors (vLLM's
            # table; transformers switches a whole forward pass to them once it reaches there, so
            # the two agree while a sequence stays below that length)
            short, long, original, scale = longrope_tables(head_dim, params)
            freqs = torch.where(t[:, None] < original, torch.outer(t, short), torch.outer(t, long))
        else:
            freqs = torch.outer(t, compute_inv_freq(head_dim, params))     # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]

    def forward(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.kernels or kernels_for(query)).apply_rotary(query, key, cos, sin)

    def rotate_(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a query and key nothing else reads (views of the QKV projection's output):
        in place where the kernel set can (`apply_rotary_`: the C++ CPU kernels), else new tensors."""
        kernels = self.kernels or kernels_for(query)
        in_place = getattr(kernels, "apply_rotary_", None)
        if in_place is None:
            return kernels.apply_rotary(query, key, cos, sin)
        in_place(query, key, cos, sin)
        return query, key
