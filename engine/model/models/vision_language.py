"""A language model that takes images: `with_vision(text_class)` is the language model's class
with the model's vision side (LLaVA's tower and projector: engine/model/models/llava.py; Qwen2-VL's
vision transformer and merger: engine/model/models/qwen2_vl.py; Gemma 3's SigLIP tower and
projector: engine/model/models/gemma3_vision.py) on its first pipeline stage
(`encode_image`). The model runner puts an image's rows into the prompt's embeddings
(engine/worker/encoder_cache.py) and the language model runs as it does for text, with the
multimodal rotary positions where the model has them (Qwen2-VL's M-RoPE: `MRoPE`).

The multimodal config rides on the text config as `vision_language` (records/model_source.py), so
everything the engine reads of the language model (layers, heads, vocabulary) is the text config's.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cache
from typing import Any

import torch
from torch import nn

from engine.model.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model.models.gemma3_vision import Gemma3Vision
from engine.model.models.llava import LlavaVision
from engine.model.models.qwen2_vl import QwenVision
from records.model_source import images_attend_both_ways
from records.multimodal import image_token_id

# The language model's tensors in a vision-language checkpoint (transformers 4.5x's and later,
# and older ones'), as the text model's.
_TEXT = (("model.language_model.", "model."), ("language_model.model.", "model."),
         ("language_model.lm_head.", "lm_head."))
VISION_CLASSES: dict[str, type[nn.Module]] = {
    "LlavaForConditionalGeneration": LlavaVision,
    "LlavaNextForConditionalGeneration": LlavaVision,
    "Qwen2VLForConditionalGeneration": QwenVision,
    "Qwen2_5_VLForConditionalGeneration": QwenVision,
    "Gemma3ForConditionalGeneration": Gemma3Vision,
}


class MRoPE:
    """Multimodal rotary embedding (Qwen2-VL): positions [3, T] (temporal, height, width:
    records/multimodal.py mrope_positions), each rotary frequency turned by one of the three, in
    sections of `mrope_section` frequencies. A text token's three positions are one, so the runner
    passes plain positions [T] for any step without an image's tokens (the text rope is the same)."""

    def __init__(self, section: list[int], head_dim: int) -> None:
        if sum(section) * 2 != head_dim or len(section) != 3:
            raise ValueError(f"rope mrope_section must be 3 counts of frequencies summing to head_dim / 2 "
                             f"({head_dim // 2}); got {section}")
        which = [i for i, n in enumerate(section) for _ in range(n)]
        self.which = torch.tensor(which + which)        # the position row of each of the head's dims

    def lookup(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.which.device != positions.device:
            self.which = self.which.to(positions.device)            # (once: the model's device)
        index = self.which[None, None, :].expand(1, positions.shape[1], -1)
        return tuple(table[positions].gather(0, index)[0] for table in (rotary.cos, rotary.sin))  # type: ignore


class VisionLanguageModel:
    """Mixed in before a language model class (`with_vision`)."""

    loaded_apart = ("vision.",)

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, dtype, max_positions)      # type: ignore[call-arg]
        mm = config.vision_language
        image_token_id(mm)                                  # (a config without one is refused at load)
        self.vision_class = VISION_CLASSES[mm["architecture"]]
        # Only the first stage embeds the prompt.
        self.vision = self.vision_class(mm, config.hidden_size, dtype) if self.is_first_stage else None
        section = rope_parameters(config).get("mrope_section")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.mrope = MRoPE(list(section), head_dim) if section else None
        # An image's tokens attend to one another both ways (Gemma 3): the runner marks their spans.
        self.bidirectional_images = images_attend_both_ways(config)

    def layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, RotaryEmbedding]]:
        if positions.dim() == 1:
            return super().layer_ropes(positions)          # type: ignore[misc]
        assert self.mrope is not None, "positions [3, T] are M-RoPE's"
        cos, sin = self.mrope.lookup(self.rotary, positions)    # type: ignore[attr-defined]
        return [(cos, sin, self.rotary)] * len(self.layers)     # type: ignore[attr-defined]

    def encode_image(self, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
        """The embeddings [placeholder tokens, hidden] of one image (its processor's tensors)."""
        assert self.vision is not None
        return self.vision(pixels)

    def load_weights(self, weights: Iterable[tuple[str, Any]], dense_copies: bool = False,
                     partial: bool = False) -> None:
        vision: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                own = self.vision_class.own(name)       # type: ignore[attr-defined]
                if own is not None:
                    vision.append((own, tensor))
                    continue
                for old, new in _TEXT:
                    if name.startswith(old):
                        name = new + name.removeprefix(old)
                        break
                yield name, tensor

        super().load_weights(text(), dense_copies, partial)      # type: ignore[misc]
        if self.vision is not None:
            self.vision.load_weights(vision, partial)


@cache
def with_vision(text_class: type[nn.Module]) -> type[nn.Module]:
    """`text_class` (a language model's class) with the vision side its config names."""
    return type(f"Vision{text_class.__name__}", (VisionLanguageModel, text_class), {})
