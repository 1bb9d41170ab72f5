"""Images into a prompt for a vision-language model: the images themselves (`load_image`: a PIL
image, encoded bytes, or a base64 `data:` URL; every bad one a ValueError naming what is wrong)
and the model's own HF processor (`ImageProcessor`), which resizes and normalizes each image exactly
as the model was trained to see it and expands each image placeholder in the prompt into the run
of tokens its embeddings take (records/multimodal.py: ImageInput).
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from records.multimodal import ImageInput, digest_of, image_token_id, placeholder_runs

MAX_IMAGE_BYTES = 20 << 20          # an encoded image's size
MAX_IMAGE_PIXELS = 64 << 20         # width x height of a decoded one (a decompression bomb's guard)


def load_image(source: Any, field: str = "image") -> Any:
    """An RGB PIL image from a PIL image, encoded bytes or a base64 `data:image/...` URL; ValueError
    naming `field` for anything else, an undecodable or truncated image, or one over the limits."""
    from PIL import Image  # noqa: PLC0415

    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, str):
            source = _data_url_bytes(source, field)
        if not isinstance(source, (bytes, bytearray)):
            raise ValueError(f"{field} must be a PIL image, image bytes or a base64 data:image URL; "
                             f"got {type(source).__name__}")
        if len(source) > MAX_IMAGE_BYTES:
            raise ValueError(f"{field}: the image is {len(source)} bytes; at most {MAX_IMAGE_BYTES} are taken")
        try:
            image = Image.open(io.BytesIO(source))
            _check_pixels(image.size, field)
            image.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            if isinstance(e, ValueError) and str(e).startswith(field):
                raise
            raise ValueError(f"{field} is not a readable image ({e})") from None
    _check_pixels(image.size, field)
    return image if image.mode == "RGB" else image.convert("RGB")


def _check_pixels(size: tuple[int, int], field: str) -> None:
    width, height = size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{field}: the image is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} pixels "
                         f"(and at least 1x1) are taken")


def _data_url_bytes(url: str, field: str) -> bytes:
    head, sep, data = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ValueError(f"{field} must be a base64 data URL (data:image/png;base64,...); remote and file URLs "
                         f"are not fetched; got {url[:40]!r}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field}: the data URL's base64 does not decode") from None


class ImageProcessor:
    """The model's HF processor (AutoProcessor of the checkpoint directory)."""

    def __init__(self, path: str, vision_language: dict[str, Any]) -> None:
        from transformers import AutoProcessor  # noqa: PLC0415

        try:
            self.processor = AutoProcessor.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"model {path!r}: its image processor does not load ({e}); a vision-language "
                             f"checkpoint ships processor_config.json / preprocessor_config.json") from None
        self.image_token_id = image_token_id(vision_language)
        self.placeholder = getattr(self.processor, "image_token", None) or "<image>"

    def process(self, prompt: str, images: list[Any]) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids (each image's placeholder expanded) and its images, in order."""
        loaded = [load_image(image, f"multi_modal_data.image[{i}]") for i, image in enumerate(images)]
        count = prompt.count(self.placeholder)
        if count != len(loaded):
            raise ValueError(f"the prompt has {count} image placeholder(s) ({self.placeholder!r}) for "
                             f"{len(loaded)} image(s): put one where each image goes")
        encoded = self.processor(text=prompt, images=loaded, return_tensors="pt")
        ids = encoded["input_ids"][0].tolist()
        pixels = encoded["pixel_values"]
        per_image = [{"pixel_values": pixels[i:i + 1].clone()} for i in range(len(loaded))]
        total = sum(1 for t in ids if t == self.image_token_id)
        runs = placeholder_runs(ids, self.image_token_id, [total // len(loaded)] * len(loaded))
        return ids, tuple(ImageInput(digest_of(p), offset, length, p) for p, (offset, length) in zip(per_image, runs))
