"""Images in through the HTTP API: the /limited app's "llava" (a tiny LLaVA 1.5 on one replica) and
"gemma3" (a tiny Gemma 3; a tiny Qwen2-VL's through a P/D transfer and an encode pool:
tests/cluster/test_node_loss.py). The official
openai client's base64 image parts answer as transformers does on the same rendered prompt and
images; the same text with another image answers otherwise
and hits the prefix cache only before the image, the same image again hits past it; the Responses
API's `input_image` is the chat's image part; 20 malformed inputs are each a 400 naming the part
and the problem, the model serving after each; an image URL is fetched from an allowed host only
(127.0.0.1 here: another name for the same server is never asked)."""
from __future__ import annotations

import base64
import functools
import io
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import numpy as np
import openai
import pytest
import torch

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
pytestmark = pytest.mark.ray

MAX_TOKENS = 10
TEXT = "Look closely at the picture below and describe every colour you can see in it. " * 2


def image(height: int, width: int, seed: int):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


def png(img, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt)
    return out.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": TEXT},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "\nWhat is it?"}]}]


@functools.cache
def _transformers(path: str) -> tuple:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return (AutoProcessor.from_pretrained(path),
            AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval())


def transformers_answer(path: str, img, placeholder: str = "<image>") -> list[int]:
    """The oracle: the model's chat template with the image's placeholder where its part was,
    the processor, and transformers' greedy generate."""
    processor, model = _transformers(path)
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": TEXT + placeholder + "\nWhat is it?"}],
                                                   add_generation_prompt=True, tokenize=False)
    enc = processor(text=text, images=[img], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
    return ids[0, enc["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def llava(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['base']}/limited/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, url: str, model: str = "llava"):
    return client.chat.completions.create(model=model, messages=messages(url), max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})


def test_gemma3_images_answer_as_transformers(server, llava, tiny_gemma3_vl):
    """The /limited app's "gemma3": its chat image parts become `<start_of_image>` (expanded by its
    processor) and its image tokens attend both ways; two images, two answers, each
    transformers'."""
    answers = [_chat(llava, data_url(png(img)), "gemma3").choices[0].token_ids for img in (image(40, 50, 0),
                                                                                           image(64, 32, 1))]
    assert answers == [transformers_answer(tiny_gemma3_vl, img, "<start_of_image>")
                       for img in (image(40, 50, 0), image(64, 32, 1))]
    assert answers[0] != answers[1]


def test_images_answer_as_transformers(server, llava, tiny_llava):
    first, other = image(40, 50, 0), image(64, 32, 1)
    a = _chat(llava, data_url(png(first)))
    assert a.choices[0].token_ids == transformers_answer(tiny_llava, first)
    jpeg = png(other, "JPEG")                  # (lossy: the oracle reads the same bytes)
    b = _chat(llava, data_url(jpeg, "image/jpeg"))
    from PIL import Image

    assert b.choices[0].token_ids == transformers_answer(tiny_llava, Image.open(io.BytesIO(jpeg))) != \
        a.choices[0].token_ids
    offset = _image_offset(a.prompt_token_ids)
    assert b.usage.prompt_tokens_details.cached_tokens <= offset // 16 * 16
    again = _chat(llava, data_url(png(first)))
    assert again.choices[0].token_ids == a.choices[0].token_ids
    assert again.usage.prompt_tokens_details.cached_tokens > offset          # a hit into the image's blocks
    # The Responses API's input_image is the chat's image part. (The app's qwen3 reasoning parser
    # reads these answers, which open no <think>, as reasoning: compared as that.)
    response = llava.responses.create(model="llava", max_output_tokens=MAX_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": TEXT},
                                     {"type": "input_image", "image_url": data_url(png(first))},
                                     {"type": "input_text", "text": "\nWhat is it?"}]}])
    chat = llava.chat.completions.create(model="llava", messages=messages(data_url(png(first))),
                                         max_tokens=MAX_TOKENS, temperature=0)
    reasoning = [c["text"] for item in response.model_dump()["output"] if item["type"] == "reasoning"
                 for c in item.get("content") or []]
    assert reasoning == [chat.choices[0].message.reasoning] and reasoning[0]


def _image_offset(ids: list[int]) -> int:
    """Where the prompt's image placeholders start (its most frequent id: 16 in a row)."""
    return ids.index(max(set(ids), key=ids.count))


class _Counting(BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self) -> None:
        _Counting.hits += 1
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        body = png(image(8, 8, 5))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_malformed_images_are_400s_naming_the_part(server, llava):
    """Twenty bad inputs, each a 400 naming the part (or field) and the problem; the model answers
    after each. An image on the allowed host is fetched once and answers as the same image in the
    request; the same server named otherwise is refused without a request reaching it."""
    http = HTTPServer(("127.0.0.1", 0), _Counting)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    good = data_url(png(image(40, 50, 0)))
    fetched = _chat(llava, f"http://127.0.0.1:{http.server_address[1]}/cat.png")
    assert _Counting.hits == 1
    assert fetched.choices[0].token_ids == _chat(llava, data_url(png(image(8, 8, 5)))).choices[0].token_ids
    from PIL import Image

    big = png(Image.new("1", (9000, 9000)))            # 81 Mpixels in a few KB: a decompression bomb
    one = "messages[0].content[0]"

    def alone(part: dict) -> list[dict]:
        return [{"role": "user", "content": [part]}]

    image_part = {"type": "image_url", "image_url": {"url": good}}
    # (messages, what the message says, the part it names first (None: a request-wide limit), body extras)
    cases = [
        (messages(f"http://localhost:{http.server_address[1]}/cat.png"), "not fetched", "messages[0].content[1]"),
        (messages("file:///etc/passwd"), "not read", "messages[0].content[1]"),
        (messages("data:image/png;base64,!!!not-base64!!!"), "base64 does not decode", "messages[0].content[1]"),
        (messages("data:text/plain;base64," + base64.b64encode(b"hello").decode()), "base64 data URL",
         "messages[0].content[1]"),
        (messages("data:image/png,rawbytes"), "base64 data URL", "messages[0].content[1]"),
        (messages(data_url(b"")), "not a readable image", "messages[0].content[1]"),
        (messages(data_url(b"GIF89a but not really")), "not a readable image", "messages[0].content[1]"),
        (messages(data_url(png(image(40, 50, 0))[:70])), "not a readable image", "messages[0].content[1]"),
        (messages(data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)), "not a readable image", "messages[0].content[1]"),
        (messages(data_url(big)), "9000x9000 pixels", "messages[0].content[1]"),
        (alone({"type": "image_url", "image_url": {}}), "image_url must be", one),
        (alone({"type": "image_url", "image_url": 7}), "image_url must be", one),
        (alone({"type": "image_url", "image_url": {"url": ["x"]}}), "image_url must be", one),
        (alone({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
         "must be 'text' or 'image_url'", one),
        (alone({"type": "image", "image": good}), "must be 'text' or 'image_url'", one),
        ([{"role": "user", "content": [image_part] * 3}], "at most 2 images", None),
        (alone(image_part), "do not take images", None, {"truncate_prompt_tokens": 8}),
        (alone(image_part), "do not take images", None, {"use_beam_search": True, "n": 2}),
    ]
    for msgs, match, named, *extra in cases:
        with pytest.raises(openai.BadRequestError) as e:
            llava.chat.completions.create(model="llava", messages=msgs, max_tokens=2,
                                          extra_body=extra[0] if extra else None)
        assert match in e.value.body["message"], (match, e.value.body)
        assert named is None or e.value.body["message"].startswith(named), (named, e.value.body)
        assert httpx.get(f"{server['base']}/limited/health").json()["healthy"] is True
    # The text-only model refuses an image part; the Responses API a bad input_image.
    tiny = openai.OpenAI(base_url=f"{server['base']}/limited/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="this model takes no images"):
        tiny.chat.completions.create(model="tiny", messages=messages(good), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not a readable image"):
        llava.responses.create(model="llava", max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": data_url(b"nope")}]}])
    http.shutdown()
    assert _Counting.hits == 1
    assert _chat(llava, good).usage.completion_tokens == MAX_TOKENS         # still serving
    assert httpx.get(f"{server['base']}/limited/health").json()["healthy"] is True
