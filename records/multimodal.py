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
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt: its placeholder tokens are prompt positions [offset, offset + length);
    `pixels` are its processor's tensors (`pixel_values` [1, 3, H, W], ...); `digest` a sha256 of
    them. `embeddings`: what the model's vision tower and projector made of it elsewhere (an encode
    replica: a tensor [length, hidden], or a Ray object reference to one), so the replica that
    prefills it need not encode it; None: it encodes the pixels itself (as it does when they
    cannot be read). `grid`: (frames, rows, columns) of its tokens where the model places them in
    two dimensions (Qwen2-VL's M-RoPE: `mrope_positions`), else None."""
    digest: bytes
    offset: int
    length: int
    pixels: dict[str, Any]
    embeddings: Any = None
    grid: tuple[int, int, int] | None = None

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


def mrope_positions(start: int, count: int, images: tuple[ImageInput, ...]) -> tuple[list[int], list[int], list[int]]:
    """The multimodal rotary positions (temporal, height, width) of prompt positions [start, start +
    count) (Qwen2-VL's M-RoPE: transformers' get_rope_index). A text token's three are one
    position; an image's tokens sit on its grid from the position after the text before it, and
    the text after it goes on from that position plus the grid's longer side: each image moves
    the tokens after it by (longer side - its length). Positions past the prompt (generated
    tokens) are text."""
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])
    shift = 0                                   # how far the images before p have moved it
    p, end = start, start + count
    for image in sorted((i for i in images if i.grid is not None), key=lambda i: i.offset):
        frames, height, width = image.grid
        if p < image.offset:                    # text before this image
            upto = min(end, image.offset)
            for row in rows:
                row.extend(range(p + shift, upto + shift))
            p = upto
        first = image.offset + shift            # where the image's grid starts
        for k in range(max(p, image.offset) - image.offset, min(end, image.offset + image.length) - image.offset):
            rows[0].append(first + k // (height * width))
            rows[1].append(first + k // width % height)
            rows[2].append(first + k % width)
        p = max(p, min(end, image.offset + image.length))
        shift += max(height, width) - image.length
    for row in rows:
        row.extend(range(p + shift, end + shift))
    return rows


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


DEFAULT_MAX_IMAGES = 16
# Rows of image embeddings a rank keeps (engine/worker/encoder_cache.py; the scheduler's mirror of
# it: engine/core/encoder_budget.py).
ENCODER_CACHE_TOKENS = 16384


@dataclass(frozen=True)
class MediaAccess:
    """What a prompt's images may be: at most `max_images` of them (vLLM's `limit_mm_per_prompt`),
    in the request itself (base64 data URLs, or bytes and PIL images offline), or fetched from
    http(s) URLs on `allowed_domains` (vLLM's `allowed_media_domains`; none by default: no request
    makes the server reach any address) or read from files under `allowed_local_path` (vLLM's
    `allowed_local_media_path`; none by default)."""
    max_images: int = DEFAULT_MAX_IMAGES
    allowed_domains: tuple[str, ...] = field(default_factory=tuple)
    allowed_local_path: str | None = None

    @classmethod
    def of(cls, limit_mm_per_prompt: dict[str, int] | None, allowed_media_domains: list[str] | None,
           allowed_local_media_path: str | None) -> MediaAccess:
        """From the engine arguments; ValueError naming the field."""
        domains = tuple(d.lower() for d in allowed_media_domains or ())
        if any(not isinstance(d, str) or not d or "/" in d for d in domains):
            raise ValueError(f"allowed_media_domains must list host names (e.g. 'images.example.com'); got "
                             f"{allowed_media_domains!r}")
        if allowed_local_media_path is not None and not os.path.isdir(allowed_local_media_path):
            raise ValueError(f"allowed_local_media_path must be a directory; got {allowed_local_media_path!r}")
        local = os.path.realpath(allowed_local_media_path) if allowed_local_media_path is not None else None
        return cls(max_images_per_prompt(limit_mm_per_prompt), domains, local)


def max_images_per_prompt(limit_mm_per_prompt: dict[str, int] | None) -> int:
    """vLLM's `limit_mm_per_prompt` ({"image": n}; None: DEFAULT_MAX_IMAGES) as the image count."""
    if limit_mm_per_prompt is None:
        return DEFAULT_MAX_IMAGES
    if not isinstance(limit_mm_per_prompt, dict) or set(limit_mm_per_prompt) - {"image"}:
        raise ValueError(f"limit_mm_per_prompt must be {{'image': n}} (images are the modality served); got "
                         f"{limit_mm_per_prompt!r}")
    n = limit_mm_per_prompt.get("image", DEFAULT_MAX_IMAGES)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"limit_mm_per_prompt.image must be an integer >= 0; got {n!r}")
    return n


def image_token_id(vision_language: dict[str, Any]) -> int:
    """The placeholder token of a vision-language config (as a dict: records/model_source.py)."""
    token = vision_language.get("image_token_id", vision_language.get("image_token_index"))
    if not isinstance(token, int):
        raise ValueError(f"the model's config names no image token (image_token_index); got {token!r}")
    return token
