"""LLaVA (1.5): a CLIP vision tower, a two-layer projector, and a language model (Llama, Mistral,
Qwen2) whose prompt carries each image as a run of placeholder tokens; their embeddings are the
projected features of the image's patches (transformers' LlavaForConditionalGeneration).
LLaVA-NeXT ("anyres": LlavaNextForConditionalGeneration) sees an image at the grid resolution that
fits it best (`image_grid_pinpoints`) as tiles of the tower's size plus the whole image shrunk to
one: the tiles' features are stitched back into the image's grid, its padding cut off, each row
ended by a learned `image_newline`, after the whole image's features; the number of tokens follows
the image's size.

engine/model/models/vision_language.py puts `LlavaVision` beside the language model.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.model.layers.vision import CLIPVisionTower, activation, load_by_name

# A checkpoint's prefixes (transformers 4.5x's and older ones'): the tower's and the projector's.
_TOWER = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.", "vision_tower.")
_PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")
_NEWLINE = ("model.image_newline", "image_newline")


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias, dtype=dtype)
        self.act = activation(act, "projector_hidden_act")
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision(nn.Module):
    """The tower and projector of a LlavaConfig (as a dict): an image's pixel values -> the
    embeddings of its placeholder tokens."""

    def __init__(self, mm: dict[str, Any], text_hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        vision = mm["vision_config"]
        layers = mm.get("vision_feature_layer", -2)
        depth = vision["num_hidden_layers"]
        # The hidden states read (index 0: the embeddings; -2: layer depth - 1), concatenated.
        indices = [i % (depth + 1) for i in ([layers] if isinstance(layers, int) else layers)]
        self.strategy = mm.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full'; got {self.strategy!r}")
        self.vision_tower = CLIPVisionTower(vision, dtype, max(indices))
        self.indices = indices
        self.multi_modal_projector = LlavaProjector(vision["hidden_size"] * len(indices), text_hidden,
                                                    mm.get("projector_hidden_act", "gelu"),
                                                    mm.get("multimodal_projector_bias", True), dtype)
        # LLaVA-NeXT's resolutions (height, width) and the embedding that ends each row of tiles.
        self.pinpoints = mm.get("image_grid_pinpoints")
        self.tile, self.grid = vision["image_size"], vision["image_size"] // vision["patch_size"]
        self.image_newline = nn.Parameter(torch.empty(text_hidden, dtype=dtype)) if self.pinpoints else None

    def forward(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings [placeholder tokens, hidden] from its processor's tensors."""
        weight = self.multi_modal_projector.linear_1.weight
        pixel_values = pixels["pixel_values"].to(weight.device, weight.dtype)
        if self.pinpoints is None:
            return self._features(pixel_values)[0]
        height, width = (int(v) for v in pixels["image_sizes"][0])
        rows, cols = (side // self.tile for side in best_resolution((height, width), self.pinpoints))
        tiles = self._features(pixel_values[0, :rows * cols + 1])          # the whole image, then its tiles
        if len(tiles) == 1:
            return torch.cat([tiles[0], self.image_newline[None]])
        grid = tiles[1:].view(rows, cols, self.grid, self.grid, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        grid = unpad(grid, height, width)
        grid = torch.cat([grid, self.image_newline[:, None, None].expand(*grid.shape[:-1], 1)], dim=-1)
        return torch.cat([tiles[0], grid.flatten(1, 2).transpose(0, 1)])

    def _features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The projected features [images or tiles, tokens, hidden] of a batch of tower-sized pictures."""
        states = self.vision_tower.hidden_states(pixel_values)
        features = torch.cat([states[i] for i in self.indices], dim=-1)
        if self.strategy == "default":
            features = features[:, 1:]                  # without the class token
        return self.multi_modal_projector(features)

    @staticmethod
    def own(name: str) -> str | None:
        """A checkpoint tensor's name as this module's (`vision_tower.`, `multi_modal_projector.`,
        `image_newline`), or None when it is not the vision side's."""
        if name in _NEWLINE:
            return "image_newline"
        for prefixes, local in ((_TOWER, "vision_tower."), (_PROJECTOR, "multi_modal_projector.")):
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            if prefix is not None:
                return local + name.removeprefix(prefix)
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool) -> None:
        """Tensors named as `own` names them."""
        weights = list(weights)
        newline = [t for n, t in weights if n == "image_newline"]
        if self.image_newline is not None:
            if not newline and not partial:
                raise ValueError("checkpoint lacks image_newline (a LLaVA-NeXT model's)")
            if newline:
                with torch.no_grad():
                    self.image_newline.copy_(newline[0].to(self.image_newline.dtype))
        self.vision_tower.load_weights([(n.removeprefix("vision_tower."), t) for n, t in weights
                                        if n.startswith("vision_tower.")], partial)
        load_by_name(self.multi_modal_projector, [(n.removeprefix("multi_modal_projector."), t) for n, t in weights
                                                  if n.startswith("multi_modal_projector.")],
                     "multi_modal_projector", partial, skip_unknown=False)


def best_resolution(size: tuple[int, int], pinpoints: list[list[int]]) -> tuple[int, int]:
    """The (height, width) of `pinpoints` an image of `size` (height, width) fits best: the most of
    its pixels kept, then the fewest wasted (transformers' select_best_resolution, which the
    processor used to tile it)."""
    height, width = size
    best, most, least = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most or (kept == most and wasted < least):
            best, most, least = (h, w), kept, wasted
    assert best is not None
    return best


def unpad(grid: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The features [hidden, rows, cols] of a tiled image without the rows or columns of the
    padding that made the image (height x width) the grid's aspect (transformers' unpad_image)."""
    rows, cols = grid.shape[1:]
    if width / height > cols / rows:
        kept = int(round(height * (cols / width), 7))
        pad = (rows - kept) // 2
        return grid[:, pad:rows - pad, :]
    kept = int(round(width * (rows / height), 7))
    pad = (cols - kept) // 2
    return grid[:, :, pad:cols - pad]
