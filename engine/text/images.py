"""Images into a prompt for a vision-language model: the images themselves (`load_image`: a PIL
image, encoded bytes, a base64 `data:` URL, or where the operator allows it (records/multimodal.py:
MediaAccess) an http(s) URL on an allowed host or a file under an allowed directory; every bad one
a ValueError naming what is wrong) and the model's own HF processor (`ImageProcessor`), which
resizes and normalizes each image exactly as the model was trained to see it and expands each
image placeholder in the prompt into the run of tokens its embeddings take (records/multimodal.py:
ImageInput).
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from records.multimodal import ImageInput, MediaAccess, digest_of, image_token_id, placeholder_runs

MAX_IMAGE_BYTES = 20 << 20          # an encoded image's size
MAX_IMAGE_PIXELS = 64 << 20         # width x height of a decoded one (a decompression bomb's guard)
FETCH_TIMEOUT_S = 10.0


NO_MEDIA = MediaAccess()        # images in the request only


def load_image(source: Any, field: str = "image", media: MediaAccess = NO_MEDIA) -> Any:
    """An RGB PIL image from a PIL image, encoded bytes, a base64 `data:image/...` URL, or a URL
    `media` allows; ValueError naming `field` for anything else, an undecodable or truncated image,
    or one over the limits."""
    from PIL import Image  # noqa: PLC0415

    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, str):
            source = _url_bytes(source, field, media)
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
            why = ("no image format PIL reads: PNG, JPEG, WebP, GIF, ..." if isinstance(e, Image.UnidentifiedImageError)
                   else str(e))
            raise ValueError(f"{field} is not a readable image ({why})") from None
    _check_pixels(image.size, field)
    return image if image.mode == "RGB" else image.convert("RGB")


def _check_pixels(size: tuple[int, int], field: str) -> None:
    width, height = size
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{field}: the image is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} pixels "
                         f"(and at least 1x1) are taken")


def _url_bytes(url: str, field: str, media: MediaAccess) -> bytes:
    """The bytes a URL names: a data URL's own, an allowed host's answer, an allowed file's."""
    scheme = url.split(":", 1)[0].lower()
    if scheme in ("http", "https"):
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if host not in media.allowed_domains:
            raise ValueError(f"{field}: {host or url[:40]!r} is not an allowed media domain, not fetched (remote "
                             f"images come only from allowed_media_domains: {list(media.allowed_domains)})")
        return _fetch(url, field)
    if scheme == "file":
        return _local_file(urllib.parse.unquote(urllib.parse.urlsplit(url).path), field, media)
    head, sep, data = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ValueError(f"{field} must be a base64 data URL (data:image/png;base64,...), or a URL the server "
                         f"allows (allowed_media_domains, allowed_local_media_path); got {url[:40]!r}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field}: the data URL's base64 does not decode") from None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect could lead anywhere: an allowed host's answer must be the image itself."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        raise urllib.error.HTTPError(req.full_url, code, f"redirected to {newurl[:60]} (not followed)", headers, fp)


def _fetch(url: str, field: str) -> bytes:
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        with opener.open(url, timeout=FETCH_TIMEOUT_S) as response:
            body = response.read(MAX_IMAGE_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ValueError(f"{field}: fetching {url[:80]!r} failed ({getattr(e, 'reason', e)})") from None
    if len(body) > MAX_IMAGE_BYTES:
        raise ValueError(f"{field}: the image is over {MAX_IMAGE_BYTES} bytes")
    return body


def _local_file(path: str, field: str, media: MediaAccess) -> bytes:
    root = media.allowed_local_path
    real = os.path.realpath(path)
    if root is None or os.path.commonpath([root, real]) != root:
        raise ValueError(f"{field}: file URLs are read only under allowed_local_media_path "
                         f"({root}); {path!r} is not, not read")
    try:
        if os.path.getsize(real) > MAX_IMAGE_BYTES:
            raise ValueError(f"{field}: the image is over {MAX_IMAGE_BYTES} bytes")
        with open(real, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{field}: {path!r} cannot be read ({e.strerror})") from None


class ImageProcessor:
    """The model's HF processor (AutoProcessor of the checkpoint directory); for Qwen2-VL's family,
    where transformers' processor needs torchvision (for videos), its image processor and tokenizer
    with the placeholders expanded as that processor does (`_GridProcessor`)."""

    def __init__(self, path: str, vision_language: dict[str, Any], media: MediaAccess) -> None:
        self.merge = vision_language.get("vision_config", {}).get("spatial_merge_size") if _grid_model(
            vision_language) else None
        self.processor = _load_processor(path, vision_language, self.merge)
        self.image_token_id = image_token_id(vision_language)
        self.media = media
        # What marks an image in a prompt (one per image), and what the chat path puts in a message
        # for an image part (Qwen2-VL's chat template wraps it in vision start and end tokens).
        self.image_token = getattr(self.processor, "image_token", None) or "<image>"
        self.placeholder = (f"<|vision_start|>{self.image_token}<|vision_end|>" if self.merge is not None
                            else self.image_token)

    def process(self, prompt: str, images: list[Any], fields: list[str] | None = None,
                add_special_tokens: bool = True) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt's token ids (each image's placeholder expanded) and its images, in order.
        `fields`: what to call each image in an error (default `multi_modal_data.image[i]`);
        `add_special_tokens` False for a prompt a chat template rendered (it has them already)."""
        if len(images) > self.media.max_images:
            raise ValueError(f"a prompt may carry at most {self.media.max_images} images (limit_mm_per_prompt); "
                             f"got {len(images)}")
        fields = fields or [f"multi_modal_data.image[{i}]" for i in range(len(images))]
        loaded = [load_image(image, field, self.media) for image, field in zip(images, fields, strict=True)]
        count = prompt.count(self.image_token)
        if count != len(loaded):
            raise ValueError(f"the prompt has {count} image placeholder(s) ({self.placeholder!r}) for "
                             f"{len(loaded)} image(s): put one where each image goes")
        encoded = self.processor(text=prompt, images=loaded, return_tensors="pt",
                                 add_special_tokens=add_special_tokens)
        ids = encoded["input_ids"][0].tolist()
        grids = encoded.get("image_grid_thw")
        if grids is not None:         # Qwen2-VL's: the images' patches in one tensor, as many as each grid's
            patches = encoded["pixel_values"].split(grids.prod(-1).tolist())
            per_image = [{"pixel_values": patches[i], "image_grid_thw": grids[i:i + 1]} for i in range(len(loaded))]
            merged = [(int(t), int(h) // self.merge, int(w) // self.merge) for t, h, w in grids.tolist()]
            lengths = [t * h * w for t, h, w in merged]
        else:       # each image's own tensors (pixel_values, LLaVA-NeXT's image_sizes): a row per image
            pictures = len(encoded["pixel_values"])
            if pictures != len(loaded):
                raise ValueError(f"the model's image processor made {pictures} pictures of {len(loaded)} image(s) "
                                 f"(Gemma 3's pan-and-scan crops?): not supported; set do_pan_and_scan false in its "
                                 f"preprocessor_config.json")
            per_image = [{name: value[i:i + 1].clone() for name, value in encoded.items()
                          if name not in _TEXT_FIELDS and len(value) == len(loaded)}
                         for i in range(len(loaded))]
            merged = [None] * len(loaded)
            lengths = self._tokens_per_image(loaded, ids)
        runs = placeholder_runs(ids, self.image_token_id, lengths)
        return ids, tuple(ImageInput(digest_of(p), offset, length, p, grid=grid)
                          for p, (offset, length), grid in zip(per_image, runs, merged))

    def _tokens_per_image(self, images: list[Any], ids: list[int]) -> list[int]:
        """Each image's number of placeholder tokens, as the processor expands them (it says, by
        the images' sizes: LLaVA-NeXT's vary with the size); else an equal share of the prompt's."""
        count = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if count is not None:
            return list(count(image_sizes=[(image.height, image.width) for image in images]).num_image_tokens)
        total = sum(1 for t in ids if t == self.image_token_id)
        return [total // len(images)] * len(images)


# A processor's outputs that are the prompt's, not an image's.
_TEXT_FIELDS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "num_crops")


def _grid_model(vision_language: dict[str, Any]) -> bool:
    """Whether the model places an image's tokens on its grid (Qwen2-VL, Qwen2.5-VL)."""
    return vision_language.get("architecture") in GRID_ARCHITECTURES


GRID_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


def _load_processor(path: str, vision_language: dict[str, Any], merge: int | None) -> Any:
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer  # noqa: PLC0415

    try:
        return AutoProcessor.from_pretrained(path)
    except ImportError:
        if merge is None:
            raise
    except (OSError, ValueError) as e:
        raise ValueError(f"model {path!r}: its image processor does not load ({e}); a vision-language "
                         f"checkpoint ships processor_config.json / preprocessor_config.json") from None
    try:
        image_processor, tokenizer = AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"model {path!r}: its image processor does not load ({e}); a vision-language "
                         f"checkpoint ships preprocessor_config.json") from None
    token = tokenizer.convert_ids_to_tokens(image_token_id(vision_language))
    return _GridProcessor(image_processor, tokenizer, token, merge)


class _GridProcessor:
    """Qwen2-VL's processor for images: the image processor's patches and grids, and the text with
    each image token repeated once per token of that image's merged grid (transformers'
    Qwen2VLProcessor, whose video half needs torchvision)."""

    def __init__(self, image_processor: Any, tokenizer: Any, image_token: str, merge: int) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.image_token, self.merge = image_token, merge

    def __call__(self, text: str, images: list[Any], return_tensors: str, add_special_tokens: bool) -> dict[str, Any]:
        out = dict(self.image_processor(images=images, return_tensors=return_tensors))
        pieces = text.split(self.image_token)
        counts = (out["image_grid_thw"].prod(-1) // self.merge ** 2).tolist()
        text = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:], strict=True))
        out.update(self.tokenizer(text, return_tensors=return_tensors, add_special_tokens=add_special_tokens))
        return out
