"""LLaVA (1.5): a CLIP vision tower, a two-layer projector, and a language model (Llama, Mistral,
Qwen2) whose prompt carries each image as a run of placeholder tokens; their embeddings are the
projected features of the image's patches (transformers' LlavaForConditionalGeneration).

`with_vision(text_class)` is the language model's class with the tower and projector on its first
pipeline stage (`encode_image`); the model runner puts an image's rows into the prompt's embeddings
(engine/worker/encoder_cache.py) and the language model runs as it does for text. The multimodal
config rides on the text config as `vision_language` (records/model_source.py), so everything the
engine reads of the language model (layers, heads, vocabulary) is the text config's.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cache
from typing import Any

import torch
from torch import nn

from engine.model.layers.vision import CLIPVisionTower, activation
from records.multimodal import image_token_id

# A checkpoint's prefixes: the language model's (transformers 4.5x's and older ones'), the tower's
# and the projector's.
_TEXT = (("model.language_model.", "model."), ("language_model.model.", "model."),
         ("language_model.lm_head.", "lm_head."))
_TOWER = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.", "vision_tower.")
_PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")


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
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        depth = vision["num_hidden_layers"]
        indices = [i % (depth + 1) for i in self.feature_layers]       # hidden_states[-2]: layer depth - 1
        self.strategy = mm.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full'; got {self.strategy!r}")
        self.vision_tower = CLIPVisionTower(vision, dtype, max(indices))
        self.indices = indices
        self.multi_modal_projector = LlavaProjector(vision["hidden_size"] * len(indices), text_hidden,
                                                    mm.get("projector_hidden_act", "gelu"),
                                                    mm.get("multimodal_projector_bias", True), dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower.hidden_states(pixel_values)
        features = torch.cat([states[i] for i in self.indices], dim=-1)
        if self.strategy == "default":
            features = features[:, 1:]                  # without the class token
        return self.multi_modal_projector(features)

    def load_weights(self, tower: list[tuple[str, torch.Tensor]], projector: list[tuple[str, torch.Tensor]],
                     partial: bool) -> None:
        self.vision_tower.load_weights(tower, partial)
        params = dict(self.multi_modal_projector.named_parameters())
        for name, tensor in projector:
            if name not in params or params[name].shape != tensor.shape:
                raise ValueError(f"multi_modal_projector.{name}: not a projector tensor of this shape "
                                 f"({list(tensor.shape)})")
            with torch.no_grad():
                params[name].copy_(tensor.to(params[name].dtype))
        if not projector and not partial:
            raise ValueError("checkpoint lacks the multi_modal_projector tensors")


class VisionLanguageModel:
    """Mixed in before a language model class (`with_vision`)."""

    loaded_apart = ("vision.",)

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, dtype, max_positions)      # type: ignore[call-arg]
        mm = config.vision_language
        self.image_token_id = image_token_id(mm)
        # Only the first stage embeds the prompt.
        self.vision = LlavaVision(mm, config.hidden_size, dtype) if self.is_first_stage else None

    def encode_image(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """The embeddings [placeholder tokens, hidden] of one image (its processor's tensors)."""
        assert self.vision is not None
        weight = self.vision.multi_modal_projector.linear_1.weight
        return self.vision(pixels["pixel_values"].to(weight.device, weight.dtype))[0]

    def load_weights(self, weights: Iterable[tuple[str, Any]], dense_copies: bool = False,
                     partial: bool = False) -> None:
        tower: list[tuple[str, torch.Tensor]] = []
        projector: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                vision = next((p for p in _TOWER if name.startswith(p)), None)
                if vision is not None:
                    tower.append((name.removeprefix(vision), tensor))
                    continue
                proj = next((p for p in _PROJECTOR if name.startswith(p)), None)
                if proj is not None:
                    projector.append((name.removeprefix(proj), tensor))
                    continue
                for old, new in _TEXT:
                    if name.startswith(old):
                        name = new + name.removeprefix(old)
                        break
                yield name, tensor

        super().load_weights(text(), dense_copies, partial)      # type: ignore[misc]
        if self.vision is not None:
            self.vision.load_weights(tower, projector, partial)


@cache
def with_vision(text_class: type[nn.Module]) -> type[nn.Module]:
    """`text_class` (a language model's class) with LLaVA's vision tower and projector."""
    return type(f"Llava{text_class.__name__}", (VisionLanguageModel, text_class), {})
