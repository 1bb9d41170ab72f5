"""Rotary position embedding with a precomputed cos/sin table; default and llama3 scaling."""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kernels.dispatch import kernels_for

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings of an HF config, old (`rope_theta` + `rope_scaling`) or new (`rope_parameters`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type must be one of {SUPPORTED_ROPE_TYPES}; got {rope_type!r}")
    params["rope_type"] = rope_type
    return params


def compute_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if params["rope_type"] == "llama3":
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
        inv_freq = compute_inv_freq(head_dim, params)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)                      # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]

    def forward(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.kernels or kernels_for(query)).apply_rotary(query, key, cos, sin)
