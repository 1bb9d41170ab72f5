"""Qwen2-VL and Qwen2.5-VL's vision side: a vision transformer over an image at (nearly) its own
resolution, cut into 14-pixel patches (two frames deep: a still image is its frame twice), with a
two-dimensional rotary embedding; each 2 x 2 block of patches merged into one token of the
language model (transformers' Qwen2VisionTransformerPretrainedModel and Qwen2.5-VL's). Qwen2.5-VL's
blocks are RMS-normed with a gated MLP, and most attend within windows of the image (its
`fullatt_block_indexes` over the whole).

The language model is Qwen2 with multimodal rotary positions (M-RoPE): an image's tokens take their
(row, column) on the image's grid in two thirds of the rotary frequencies
(records/multimodal.py: mrope_positions; `MRoPE` here picks each frequency's position).

Parameter names are transformers' below `visual.` (`patch_embed.proj.weight`,
`blocks.{i}.attn.qkv.weight`, `merger.mlp.0.weight`), so a checkpoint's tensors load by name.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.rmsnorm import RMSNorm
from engine.model.layers.vision import MLP, activation, load_by_name
from kernels import reference

_VISION = ("model.visual.", "visual.")


class _RMSNorm(RMSNorm):
    """Qwen2.5-VL's vision RMSNorm: the language model's (transformers' is the same formula), its
    normed rows alone (no residual stream here)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0]


def _norm(hidden: int, dtype: torch.dtype, rms: bool) -> nn.Module:
    return _RMSNorm(hidden, 1e-6, dtype) if rms else nn.LayerNorm(hidden, eps=1e-6, dtype=dtype)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, hidden * 3, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, self.head_dim).permute(1, 0, 2, 3).unbind(0)
        # (in float32, as transformers applies the vision rotary embedding)
        q, k = (t.to(v.dtype) for t in reference.apply_rotary(q.float(), k.float(), cos, sin))
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))                   # [heads, n, head_dim]
        # Every patch sees every other of its span (the image, or its window), none outside it.
        out = torch.cat([F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], scale=self.head_dim ** -0.5)
                         for a, b in zip(bounds, bounds[1:]) if b > a], dim=1)
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class _Block(nn.Module):
    def __init__(self, config: dict[str, Any], hidden: int, dtype: torch.dtype, v2_5: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(hidden, dtype, v2_5), _norm(hidden, dtype, v2_5)
        self.attn = _Attention(hidden, config["num_heads"], dtype)
        inner, act = int(hidden * config.get("mlp_ratio", 4)), config.get("hidden_act", "quick_gelu")
        self.mlp = _GatedMLP(config, dtype) if v2_5 else MLP(hidden, inner, act, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class _GatedMLP(nn.Module):
    def __init__(self, config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = config["hidden_size"], config["intermediate_size"]
        self.gate_proj, self.up_proj = (nn.Linear(hidden, inner, dtype=dtype) for _ in range(2))
        self.down_proj = nn.Linear(inner, hidden, dtype=dtype)
        self.act = activation(config.get("hidden_act", "silu"), "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _PatchEmbed(nn.Module):
    def __init__(self, config: dict[str, Any], hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = (config.get("in_channels", 3), config.get("temporal_patch_size", 2), config["patch_size"],
                      config["patch_size"])
        self.proj = nn.Conv3d(self.shape[0], hidden, self.shape[1:], stride=self.shape[1:], bias=False, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class _Merger(nn.Module):
    def __init__(self, hidden: int, out: int, merge: int, dtype: torch.dtype, v2_5: bool) -> None:
        super().__init__()
        self.width = hidden * merge * merge
        self.ln_q = _norm(hidden, dtype, v2_5)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width, dtype=dtype), nn.GELU(),
                                 nn.Linear(self.width, out, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVision(nn.Module):
    """Qwen2-VL's (or Qwen2.5-VL's) vision transformer and merger: an image's patches -> the
    embeddings of its placeholder tokens."""

    def __init__(self, mm: dict[str, Any], text_hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        config = mm["vision_config"]
        self.v2_5 = mm["architecture"] == "Qwen2_5_VLForConditionalGeneration"
        hidden = config["hidden_size"] if self.v2_5 else config["embed_dim"]
        out = config["out_hidden_size"] if self.v2_5 else config["hidden_size"]
        if out != text_hidden:
            raise ValueError(f"the vision merger's output ({out}) must be the language model's hidden_size "
                             f"({text_hidden})")
        if hidden % config["num_heads"] or (hidden // config["num_heads"]) % 4:
            raise ValueError(f"vision hidden size {hidden} / num_heads {config['num_heads']} must be a multiple of 4")
        self.merge = config.get("spatial_merge_size", 2)
        self.patch_embed = _PatchEmbed(config, hidden, dtype)
        head_dim = hidden // config["num_heads"]
        theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float)
                                                          / (head_dim // 2)), persistent=False)
        self.blocks = nn.ModuleList(_Block(config, hidden, dtype, self.v2_5) for _ in range(config["depth"]))
        self.merger = _Merger(hidden, out, self.merge, dtype, self.v2_5)
        # Qwen2.5-VL: the blocks that attend over the whole image; the others, within windows of
        # `window_size` pixels.
        self.full = set(config.get("fullatt_block_indexes", ())) if self.v2_5 else None
        self.window = config.get("window_size", 112) // self.merge // config["patch_size"] if self.v2_5 else 0

    @staticmethod
    def own(name: str) -> str | None:
        """A checkpoint tensor's name below `visual.`, or None when it is not the vision side's."""
        prefix = next((p for p in _VISION if name.startswith(p)), None)
        return None if prefix is None else name.removeprefix(prefix)

    def forward(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings [t * h * w / merge^2, hidden] from its processor's tensors
        (`pixel_values` [patches, channels * frames * patch^2], `image_grid_thw` [1, 3])."""
        t, h, w = (int(v) for v in pixels["image_grid_thw"][0])
        x = self.patch_embed(pixels["pixel_values"].to(self.inv_freq.device))
        rows, cols = self._patch_positions(t, h, w)
        # The rotary angles: a quarter of the head's frequencies each for the row and the column.
        freqs = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        whole = [h * w * i for i in range(t + 1)]                 # each frame attends over itself
        order = None
        if self.v2_5:
            order, windows = self._windows(t, h, w)
            unit = self.merge * self.merge
            x = x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)
            cos, sin = (c.view(-1, unit, c.shape[-1])[order].reshape(c.shape) for c in (cos, sin))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, whole if order is None or i in self.full else windows)
        out = self.merger(x)
        return out if order is None else out[torch.argsort(order)]

    def _patch_positions(self, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) in the order the processor lays them out: by blocks of
        merge x merge patches (those that become one token), row by row of blocks."""
        m, device = self.merge, self.inv_freq.device
        rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        rows, cols = (x.reshape(h // m, m, w // m, m).transpose(1, 2).flatten() for x in (rows, cols))
        return rows.repeat(t).float(), cols.repeat(t).float()

    def _windows(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's windows: the order of the merged tokens that puts each window's together
        (window by window, row by row within one), and the patch bounds of the windows in it."""
        gh, gw, size = h // self.merge, w // self.merge, self.window
        index = torch.arange(t * gh * gw, device=self.inv_freq.device).view(t, gh, gw)
        pad_h, pad_w = size - gh % size, size - gw % size
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = padded.shape[1] // size, padded.shape[2] // size
        padded = padded.view(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, size * size)
        counts = (padded >= 0).sum(-1).flatten()
        order = padded.flatten()
        bounds = [0] + (counts.cumsum(0) * self.merge * self.merge).tolist()
        return order[order >= 0], bounds

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool) -> None:
        load_by_name(self, weights, "visual", partial, skip_unknown=False)
