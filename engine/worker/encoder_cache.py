"""Images' embeddings on one rank of a vision-language model (vLLM's encoder cache).

A prompt's image is a run of placeholder tokens (records/multimodal.py: ImageInput). When a step
computes any of them, the runner asks `inputs_embeds` for the step's input embeddings: the token
embeddings, with each placeholder row replaced by its row of the image's embeddings. Those come
from the model's vision tower and projector (`encode_image`), once per image content: they are kept
by digest, so a chunked prefill that cuts through an image, a preempted request computed again, and
another request with the same image read them instead of encoding again (`encodes` counts the
encodings). The least recently used leave first once more than `capacity_tokens` rows are kept;
one image larger than that is still kept until the next.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from records.multimodal import ENCODER_CACHE_TOKENS
from records.step import ScheduledRequest

logger = logging.getLogger(__name__)

RECEIVE_TIMEOUT_S = 30.0        # how long an encode replica's embeddings may take to arrive


class EncoderCache:
    def __init__(self, model: Any, capacity_tokens: int = ENCODER_CACHE_TOKENS) -> None:
        self.model = model
        self.capacity_tokens = capacity_tokens
        self.kept: OrderedDict[bytes, torch.Tensor] = OrderedDict()     # digest -> [length, hidden]
        self.kept_tokens = 0
        self.encodes = 0
        self.received = 0           # images whose embeddings came made (from an encode replica)
        # A request's image needed from its first row (not after a prefix hit into it): how often,
        # and how often it was kept (vLLM's encoder cache hit rate).
        self.queries = 0
        self.hits = 0

    def inputs_embeds(self, batch: list[ScheduledRequest], input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's input embeddings [T, hidden] with its image rows in place, or None when no row
        of this step is an image's (the model embeds the tokens itself). `batch` in the order its
        tokens are laid out in `input_ids`."""
        rows: list[int] = []
        pieces: list[torch.Tensor] = []
        base = 0
        for req in batch:
            lo, hi = req.start, req.start + len(req.token_ids)
            for image in req.images:
                first, last = max(lo, image.offset), min(hi, image.offset + image.length)
                if first < last:
                    rows.extend(range(base + first - lo, base + last - lo))
                    if first == image.offset:
                        self.queries += 1
                        self.hits += image.digest in self.kept
                    pieces.append(self.embeddings(image)[first - image.offset:last - image.offset])
            base += hi - lo
        if not rows:
            return None
        embeds = self.model.embed(input_ids)
        index = torch.tensor(rows, dtype=torch.long, device=embeds.device)
        embeds[index] = torch.cat(pieces).to(embeds.dtype)
        return embeds

    def embeddings(self, image: Any) -> torch.Tensor:
        """The image's embeddings [length, hidden], encoded now unless kept."""
        kept = self.kept.get(image.digest)
        if kept is not None:
            self.kept.move_to_end(image.digest)
            return kept
        out = self._received(image) if image.embeddings is not None else None
        if out is not None:
            self.received += 1
        else:
            with torch.inference_mode():
                out = self.model.encode_image(image.pixels)
            self.encodes += 1
        if out.shape[0] != image.length:
            raise ValueError(f"an image's embeddings are {out.shape[0]} rows; the prompt has {image.length} "
                             f"placeholder tokens for it")
        self.kept[image.digest] = out
        self.kept_tokens += out.shape[0]
        while self.kept_tokens > self.capacity_tokens and len(self.kept) > 1:
            _, old = self.kept.popitem(last=False)
            self.kept_tokens -= old.shape[0]
        return out

    def _received(self, image: Any) -> torch.Tensor | None:
        """The embeddings an encode replica made of the image, on this rank's device; None (and a
        warning) when they cannot be read (the replica died, the object is lost): encoded here then."""
        made = image.embeddings
        try:
            if not isinstance(made, torch.Tensor):      # a Ray object reference (this is the step's thread)
                made = made.future().result(timeout=RECEIVE_TIMEOUT_S)
            weight = next(self.model.vision.parameters())
            if made.shape != (image.length, self.model.config.hidden_size):
                raise ValueError(f"shape {list(made.shape)}, not [{image.length}, {self.model.config.hidden_size}]")
            return made.to(weight.device, weight.dtype)
        except Exception as e:  # noqa: BLE001 - any failure to read them: the pixels are here
            logger.warning("an image's embeddings from the encode pool could not be read (%s: %s); encoding "
                           "it here", type(e).__name__, e)
            return None

    def clear(self) -> None:
        """Forget every kept image (the weights that made them changed: engine/weight_updates.py)."""
        self.kept.clear()
        self.kept_tokens = 0

    def encode(self, images: list[Any]) -> list[torch.Tensor]:
        """The embeddings of each image (an encode replica's work), on the CPU."""
        self.queries += len(images)
        self.hits += sum(image.digest in self.kept for image in images)
        return [self.embeddings(image).cpu() for image in images]
