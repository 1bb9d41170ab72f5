"""The encoder's share of a step (vLLM's encoder compute budget): at most
`max_num_encoder_input_tokens` image tokens are encoded per step, so a burst of images does not
stretch one step (and every running decode with it) by many vision-tower passes.

The scheduler asks `fit` how much of a prompt chunk may run: a chunk reaching an image not encoded
yet stops before it once the step's budget is spent (the image starts the next step's). An image
counts once: when its first tokens are computed; after that its embeddings are in the runner's
encoder cache (engine/worker/encoder_cache.py), which this mirrors by digest with the same
capacity, so the rest of an image a chunk cut through, or another request's same image, costs nothing;
nor does an image an encode replica made (records/multimodal.py: ImageInput.embeddings). The
mirror is an estimate of the runner's work, never of correctness: a mirrored image the runner
dropped is encoded again there, uncounted. The first image of a step always fits, whatever its
size, so no prompt waits for good.

`whole_images` (a model whose image tokens attend to one another both ways: Gemma 3): a chunk
never ends inside an image either, since the image's first tokens need its last ones' keys in
the same step; it stops before the image, or waits for a step with room for the rest of it.
"""
from __future__ import annotations

from collections import OrderedDict

from records.multimodal import ENCODER_CACHE_TOKENS, ImageInput
from records.request import Request


class EncoderBudget:
    def __init__(self, max_tokens: int, whole_images: bool = False, capacity_tokens: int = ENCODER_CACHE_TOKENS
                 ) -> None:
        self.max_tokens = max_tokens
        self.whole_images = whole_images
        self.capacity_tokens = capacity_tokens
        self.kept: OrderedDict[bytes, int] = OrderedDict()      # digest -> tokens (the runner's cache)
        self.kept_tokens = 0
        self.left = max_tokens
        self.deferred = 0           # chunks cut short, or requests held back, for the budget

    def new_step(self) -> None:
        self.left = self.max_tokens

    def fit(self, request: Request, start: int, n: int) -> int:
        """How many of the `n` tokens from position `start` may run this step: up to the first
        image not encoded yet that the step's budget has no room for (`charge` takes them)."""
        if not request.images or start >= request.num_prompt_tokens:
            return n
        left = self.left
        for image in request.images:
            end = image.offset + image.length
            if end <= start or image.offset >= start + n:
                continue
            if self.whole_images and start + n < end:           # it would end inside the image
                return max(0, image.offset - start)
            if self._made(image):
                continue
            if left < image.length and left < self.max_tokens:
                self.deferred += 1
                return max(0, image.offset - start)
            left -= image.length
        return n

    def charge(self, request: Request, start: int, n: int) -> None:
        """The chunk [start, start + n) is scheduled: its images not encoded yet are now."""
        for image in request.images:
            if image.offset < start + n and image.offset + image.length > start and not self._made(image):
                self.left -= image.length
                self.kept[image.digest] = image.length
                self.kept_tokens += image.length
                while self.kept_tokens > self.capacity_tokens and len(self.kept) > 1:
                    self.kept_tokens -= self.kept.popitem(last=False)[1]

    def _made(self, image: ImageInput) -> bool:
        """Whether the image needs no encoding: made elsewhere, or kept (a chunk cut through it
        before, another request's)."""
        if image.embeddings is not None:
            return True
        if image.digest in self.kept:
            self.kept.move_to_end(image.digest)
            return True
        return False
