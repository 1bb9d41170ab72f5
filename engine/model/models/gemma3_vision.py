"""Gemma 3's vision side: a SigLIP vision transformer (engine/model/layers/vision.py) over the image
resized to its size (896 x 896 pixels: 64 x 64 patches), its patch features average-pooled to
`mm_tokens_per_image` (256: 16 x 16), RMS-normed (Gemma's 1 + weight) and projected to the language
model's width (transformers' Gemma3MultiModalProjector). In the language model the image's tokens
attend to one another both ways (the rest stays causal: engine/model/layers/attention.py,
`prefill_spans`), so a prompt chunk never ends inside an image (engine/core/encoder_budget.py).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.vision import SiglipVisionTower, load_by_name

_TOWER = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.", "vision_tower.")
_PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")


class Gemma3Projector(nn.Module):
    def __init__(self, mm: dict[str, Any], text_hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        vision = mm["vision_config"]
        hidden = vision["hidden_size"]
        self.mm_input_projection_weight = nn.Parameter(torch.empty(hidden, text_hidden, dtype=dtype))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(hidden, dtype=dtype))
        self.eps = vision.get("layer_norm_eps", 1e-6)
        self.side = vision["image_size"] // vision["patch_size"]
        tokens_per_side = int(mm.get("mm_tokens_per_image", 256) ** 0.5)
        if tokens_per_side ** 2 != mm.get("mm_tokens_per_image", 256) or self.side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image must be a square whose side divides the image's "
                             f"{self.side} patches a side; got {mm.get('mm_tokens_per_image')}")
        self.kernel = self.side // tokens_per_side

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision hidden] -> [images, tokens, text hidden]."""
        images, _, hidden = features.shape
        grid = features.transpose(1, 2).reshape(images, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.mm_soft_emb_norm.weight.float())
        return torch.matmul(x.type_as(features), self.mm_input_projection_weight)


class Gemma3Vision(nn.Module):
    """The tower and projector of a Gemma3Config (as a dict): an image's pixel values -> the
    embeddings of its `mm_tokens_per_image` placeholder tokens."""

    def __init__(self, mm: dict[str, Any], text_hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vision_tower = SiglipVisionTower(mm["vision_config"], dtype)
        self.multi_modal_projector = Gemma3Projector(mm, text_hidden, dtype)

    @staticmethod
    def own(name: str) -> str | None:
        """A checkpoint tensor's name as this module's (`vision_tower.`, `multi_modal_projector.`),
        or None when it is not the vision side's."""
        for prefixes, local in ((_TOWER, "vision_tower."), (_PROJECTOR, "multi_modal_projector.")):
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            if prefix is not None:
                return local + name.removeprefix(prefix)
        return None

    def forward(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings [tokens, hidden] from its processor's `pixel_values` [1, 3, H, W]."""
        return self.multi_modal_projector(self.vision_tower(pixels["pixel_values"]))[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool) -> None:
        """Tensors named as `own` names them (the tower's pooling head, which no model reads, skipped)."""
        weights = [(n, t) for n, t in weights if not n.startswith("vision_tower.head.")]
        load_by_name(self, weights, "vision", partial, skip_unknown=False)
