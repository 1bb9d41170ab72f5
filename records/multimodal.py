"""Images in a prompt (vision-language models: engine/model/models/llava.py).

The model's processor (engine/text/images.py) turns a prompt and its images into token ids, in
which each image is a run of placeholder tokens, and the image's tensors. An `ImageInput` names one
image's run and carries its tensors and a digest of their content: the digest keys the encoder
cache (a repeated image is encoded once: engine/worker/encoder_cache.py) and the prompt's block
hashes (records/hashing.py: two prompts alike but for an image share no block from the first that
holds it).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt: its placeholder tokens are prompt positions [offset, offset + length);
    `pixels` are its processor's tensors (`pixel_values` [1, 3, H, W], ...); `digest` a sha256 of
    them."""
    digest: bytes
    offset: int
    length: int
    pixels: dict[str, Any]

    @property
    def key(self) -> tuple[int, int, bytes]:
        """(offset, length, digest): what the block hashes read."""
        return self.offset, self.length, self.digest


def digest_of(pixels: dict[str, Any]) -> bytes:
    """A sha256 of an image's tensors (names, dtypes, shapes and bytes), the same in every process."""
    import torch  # noqa: PLC0415 - records stay importable without torch

    h = hashlib.sha256()
    for name in sorted(pixels):
        tensor = pixels[name].contiguous()
        h.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def placeholder_runs(token_ids: list[int], token_id: int, lengths: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of each image's placeholders in `token_ids`, given each image's number of
    placeholder tokens in order (adjacent images make one run of `token_id`s, cut by `lengths`).
    ValueError when the prompt's placeholders do not match the images."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(token_ids)
    while i < n:
        if token_ids[i] != token_id:
            i += 1
            continue
        j = i
        while j < n and token_ids[j] == token_id:
            j += 1
        runs.append((i, j - i))
        i = j
    out: list[tuple[int, int]] = []
    pending = list(lengths)
    for start, length in runs:
        while length > 0 and pending and pending[0] <= length:
            out.append((start, pending[0]))
            start, length = start + pending[0], length - pending.pop(0)
        if length:
            break
    if pending or len(out) != len(lengths) or sum(r[1] for r in runs) != sum(lengths):
        raise ValueError(f"the prompt's image placeholders ({sum(r[1] for r in runs)} tokens) do not match its "
                         f"{len(lengths)} image(s) of {lengths} tokens: give one image placeholder per image")
    return out


def image_token_id(vision_language: dict[str, Any]) -> int:
    """The placeholder token of a vision-language config (as a dict: records/model_source.py)."""
    token = vision_language.get("image_token_id", vision_language.get("image_token_index"))
    if not isinstance(token, int):
        raise ValueError(f"the model's config names no image token (image_token_index); got {token!r}")
    return token
