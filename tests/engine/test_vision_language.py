"""Vision-language models (engine/model/models/vision_language.py, engine/worker/encoder_cache.py):
a tiny LLaVA 1.5, a tiny LLaVA-NeXT (its token count per image following the image's size), a tiny
Qwen2-VL and a tiny Qwen2.5-VL (an image at about its own size; M-RoPE) with their real
processors, greedy and token-identical to transformers on images of several sizes and shapes, one
or two per prompt; the same with chunked prefill cutting through an image's placeholders, and
across a P/D transfer (the decode engine pulls the prompt's KV and places its positions by the
images, as M-RoPE moves them); prefix caching keyed by the image (the same text with another image gets another
answer and no hit past the text before the image; the same image again is a hit and is not encoded
again); bad image inputs refused by name with nothing queued."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Text before the image long enough to fill two blocks of 16: a prefix two requests may share.
PREFIX = "USER: " + "Look closely at the picture below and describe every colour you can see in it. " * 2
PROMPT = PREFIX + "<image>\nWhat is it? ASSISTANT:"


def image(height: int, width: int, seed: int):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


IMAGES = [image(40, 50, 0), image(64, 32, 1), image(31, 97, 2), image(32, 32, 3)]


# Qwen2-VL's image placeholder (its chat template writes it for an image part).
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
FAMILIES = ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3_vl"]
# Each family's image placeholder in a prompt (its chat template writes it for an image part).
PLACEHOLDERS = {"qwen": QWEN_IMAGE, "gemma3": "<start_of_image>"}


def in_model_form(path: str, requests: list[tuple[str, list]]) -> list[tuple[str, list]]:
    """The requests with the model's own image placeholder."""
    mark = next((m for family, m in PLACEHOLDERS.items() if family in path), "<image>")
    return [(p.replace("<image>", mark), imgs) for p, imgs in requests]


def hf_processor(path: str):
    """transformers' processor of the checkpoint; Qwen2-VL's built without its video processor
    (which needs torchvision, not installed): its images are processed as they would be."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    if "qwen" not in path:
        return AutoProcessor.from_pretrained(path)
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: arg is None or check(self, name, arg)
    try:
        return Qwen2VLProcessor(image_processor=AutoImageProcessor.from_pretrained(path),
                                tokenizer=AutoTokenizer.from_pretrained(path), video_processor=None)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def hf_answers(path: str, requests: list[tuple[str, list]], max_new_tokens: int = 10) -> list[list[int]]:
    from transformers import AutoModelForImageTextToText

    processor = hf_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt, images in requests:
        enc = processor(text=prompt, images=images, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(ids[0, enc["input_ids"].shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def requests() -> list[tuple[str, list]]:
    """Each image alone, and two in one prompt."""
    return [(PROMPT, [img]) for img in IMAGES] + [("USER: <image> and <image>\nSame? ASSISTANT:", IMAGES[1:3])]


@pytest.fixture(scope="module", params=FAMILIES)
def model_and_expected(request, requests) -> tuple[str, list[tuple[str, list]], list[list[int]]]:
    """A family's tiny model, the requests in its form, and transformers' answers."""
    path = request.getfixturevalue(f"tiny_{request.param}")
    requests = in_model_form(path, requests)
    return path, requests, hf_answers(path, requests)


def _generate(llm: LLM, requests: list[tuple[str, list]]):
    return llm.generate([{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs in requests], GREEDY,
                        use_tqdm=False)


def _encodes(llm: LLM) -> int:
    return llm.llm_engine.executor.worker.runner.encoder.encodes


@pytest.mark.parametrize("chunk", [None, 16])
def test_greedy_equals_transformers(model_and_expected, chunk):
    """By default (each prompt in one step) and with 16-token chunks, which cut through every
    image's placeholders (they start mid-block): each image is encoded once all the same. LLaVA's
    images take 16 tokens each, Gemma 3's 4; LLaVA-NeXT's and Qwen2-VL's as many as their size makes."""
    path, requests, expected = model_and_expected
    llm = LLM(path, dtype="float32", **({"max_num_batched_tokens": chunk} if chunk else {}))
    outs = _generate(llm, requests)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert _encodes(llm) == len(IMAGES)
    encoder = llm.llm_engine.executor.worker.runner.encoder
    assert (encoder.queries, encoder.hits) == (len(IMAGES) + 2, 2)     # the last prompt's two images: kept
    counts = [o.prompt_token_ids.count(llm.llm_engine.image_processor().image_token_id) for o in outs[:len(IMAGES)]]
    # LLaVA 1.5 (one tile) and Gemma 3 (one pooled grid): as many tokens whatever the size.
    fixed = 16 if "llava" in path and "next" not in path else 4 if "gemma3" in path else None
    assert counts == [fixed] * 4 if fixed else len(set(counts)) > 1, counts
    llm.llm_engine.check_no_leaks()


def test_a_pd_transfer_answers_as_transformers(model_and_expected):
    """A prefill engine runs each prompt with its images and leases its KV; a decode engine given
    the same images pulls it (it computes the last prompt token only: no image of its own to
    encode) and answers as transformers does."""
    import dataclasses

    from engine.llm_engine import LLMEngine
    from records.clock import monotonic
    from records.config_resolution import engine_config
    from records.request import NewRequest

    path, requests, expected = model_and_expected
    p, d = (LLMEngine(engine_config(path, dtype="float32", kv_connector="torch_dist", kv_load_timeout_s=120))
            for _ in range(2))
    processor = p.image_processor()
    for i, ((prompt, imgs), want) in enumerate(zip(requests, expected)):
        ids, images = processor.process(prompt, imgs)
        p.enqueue(NewRequest(f"r{i}", prompt, ids, dataclasses.replace(GREEDY, max_tokens=1), monotonic(),
                             {"do_remote_decode": True}, images=images))
        params = _finish(p, f"r{i}").kv_transfer_params
        assert params is not None
        d.enqueue(NewRequest(f"r{i}", prompt, ids, GREEDY, monotonic(), params, images=images))
        assert list(_finish(d, f"r{i}", p).outputs[0].token_ids) == want, i
    while p.has_unfinished_requests() or d.has_unfinished_requests():     # the leases released
        p.step()
        d.step()
    assert d.stats().kv_transfer.load_failures == 0
    assert d.executor.worker.runner.encoder.encodes == 0
    p.check_no_leaks()
    d.check_no_leaks()


def _finish(engine, request_id: str, *others):
    """Step `engine` (and `others`: the prefill engine serves the pull) until the request finishes."""
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out
        for other in others:
            other.step()


@pytest.mark.parametrize("budget", [None, 5])
def test_the_encoder_budget_spreads_images_over_steps(tiny_qwen2_vl, budget):
    """max_num_encoder_input_tokens (vLLM's): four prompts with an image each (4 to 12 tokens) come
    at once. By default (the step's token budget) their images are encoded in the first step;
    with 5 tokens (less than any two) a step encodes one image (the first of a step fits whatever
    its size), the other prompts stopping before their image until a later step, and every answer
    is the same."""
    from records.clock import monotonic
    from records.request import NewRequest

    prompt = PREFIX.replace("<image>", "") + QWEN_IMAGE + "\nWhat is it? ASSISTANT:"
    llm = LLM(tiny_qwen2_vl, dtype="float32", **({"max_num_encoder_input_tokens": budget} if budget else {}))
    engine, runner = llm.llm_engine, llm.llm_engine.executor.worker.runner
    for i, img in enumerate(IMAGES):
        ids, images = engine.image_processor().process(prompt, [img])
        engine.enqueue(NewRequest(f"r{i}", prompt, ids, GREEDY, monotonic(), images=images))
    per_step, outs = [], {}
    while engine.has_unfinished_requests():
        before = runner.encoder.encodes
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
        per_step.append(runner.encoder.encodes - before)
    want = hf_answers(tiny_qwen2_vl, [(prompt, [img]) for img in IMAGES])
    assert [outs[f"r{i}"] for i in range(len(IMAGES))] == want
    assert sum(per_step) == len(IMAGES)
    if budget is None:
        assert per_step[0] == len(IMAGES) and engine.scheduler.encoder.deferred == 0
    else:
        assert max(per_step) == 1 and engine.scheduler.encoder.deferred > 0, per_step
    engine.check_no_leaks()


def test_a_chunk_never_ends_inside_a_gemma3_image(tiny_gemma3_vl):
    """Gemma 3's image tokens attend to one another both ways, so the first need the last ones' keys:
    with a token budget that would end the first chunk two tokens into the image, the chunk stops
    before it and the next takes it whole (the answer is transformers'); an image longer than the
    step's budget is refused by name, nothing queued."""
    from records.clock import monotonic
    from records.request import NewRequest

    [(prompt, imgs)] = in_model_form(tiny_gemma3_vl, [(PROMPT, [IMAGES[0]])])
    processor = LLM(tiny_gemma3_vl, dtype="float32").llm_engine.image_processor()
    ids, (image,) = processor.process(prompt, imgs)
    llm = LLM(tiny_gemma3_vl, dtype="float32", max_num_batched_tokens=image.offset + 2)
    engine = llm.llm_engine
    engine.enqueue(NewRequest("r", prompt, ids, GREEDY, monotonic(), images=(image,)))
    chunks, schedule, out = [], engine.scheduler.schedule, None

    def recorded():
        step = schedule()
        chunks.append([len(r.token_ids) for r in step.scheduled])
        return step

    engine.scheduler.schedule = recorded
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    assert chunks[0] == [image.offset] and chunks[1][0] >= image.length, chunks
    assert list(out.outputs[0].token_ids) == hf_answers(tiny_gemma3_vl, [(prompt, imgs)])[0]
    small = LLM(tiny_gemma3_vl, dtype="float32", max_num_batched_tokens=3).llm_engine
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(3\) must hold an image's 4 tokens"):
        small.enqueue(NewRequest("r", prompt, ids, GREEDY, monotonic(), images=(image,)))
    assert not small.has_unfinished_requests()
    engine.check_no_leaks()


def test_a_migrated_request_and_the_offload_tier_keep_their_images(tiny_qwen2_vl):
    """A request with an image resumed on another engine after tokens the lost one generated (the
    router's migration: records/request.py Continuation) goes on as the whole run does, its
    positions moved by the image as before; an image prompt's blocks evicted to the host tier come
    back from it keyed by the image (hits, no recompute of them) with the same answer."""
    from records.clock import monotonic
    from records.request import Continuation, NewRequest

    [(prompt, imgs)] = in_model_form(tiny_qwen2_vl, [(PROMPT, [IMAGES[0]])])
    whole = list(_generate(LLM(tiny_qwen2_vl, dtype="float32"), [(prompt, imgs)])[0].outputs[0].token_ids)
    engine = LLM(tiny_qwen2_vl, dtype="float32").llm_engine
    ids, images = engine.image_processor().process(prompt, imgs)
    engine.enqueue(NewRequest("moved", prompt, ids, GREEDY, monotonic(), continuation=Continuation(tuple(whole[:4])),
                              images=images))
    # (the final output holds the resumed tokens too: the 6 after them are this engine's)
    assert list(_finish(engine, "moved").outputs[0].token_ids) == whole
    engine.check_no_leaks()

    tiered = LLM(tiny_qwen2_vl, dtype="float32", num_kv_blocks=8, max_model_len=128,
                 kv_offloading_size=64 * 8192 / (1 << 30))          # (64 blocks of this model's 8 KiB)
    others = in_model_form(tiny_qwen2_vl, [(PROMPT, [img]) for img in IMAGES[1:]])
    first = _generate(tiered, [(prompt, imgs)])[0]
    for other in others:                                            # its blocks leave the pool for the tier
        _generate(tiered, [other])
    again = _generate(tiered, [(prompt, imgs)])[0]
    tier = tiered.llm_engine.stats().kv_tier
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids) == whole
    assert tier.host_hit_blocks >= 1 and tier.load_failures == 0, tier     # (the block holding the image)
    tiered.llm_engine.check_no_leaks()


def test_mrope_positions_are_transformers(tiny_qwen2_vl):
    """records/multimodal.py's M-RoPE positions of a prompt with two images, asked for in chunks
    that start and end inside the images, and past the prompt: transformers' get_rope_index's, and
    its delta for the generated tokens."""
    from transformers import Qwen2VLModel

    from records.multimodal import mrope_positions

    prompt, imgs = in_model_form(tiny_qwen2_vl, [("USER: <image> and <image>\nSame? ASSISTANT:", IMAGES[1:3])])[0]
    enc = hf_processor(tiny_qwen2_vl)(text=prompt, images=imgs, return_tensors="pt")
    want, delta = Qwen2VLModel.from_pretrained(tiny_qwen2_vl).get_rope_index(
        enc["input_ids"], enc["mm_token_type_ids"], enc["image_grid_thw"])
    ids, images = LLM(tiny_qwen2_vl, dtype="float32").llm_engine.image_processor().process(prompt, imgs)
    assert ids == enc["input_ids"][0].tolist() and all(image.grid is not None for image in images)
    n = len(ids)
    got = [[], [], []]
    for start in range(0, n + 3, 5):
        for row, part in zip(got, mrope_positions(start, 5, images)):
            row.extend(part)
    assert [row[:n] for row in got] == want[:, 0].tolist()
    assert [row[n:n + 3] for row in got] == [[n + int(delta) + i for i in range(3)]] * 3


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3_vl"])
def test_prefix_cache_is_keyed_by_the_image(family, request):
    """The same prompt with another image: another answer, a hit on the text before the image only;
    the same image again: a hit through the image (and, with M-RoPE, the text after it placed as
    the image moved it), and no second encoding."""
    path = request.getfixturevalue(f"tiny_{family}")
    requests = in_model_form(path, [(PROMPT, [IMAGES[0]]), (PROMPT, [IMAGES[1]])])
    expected = hf_answers(path, requests)
    llm = LLM(path, dtype="float32")
    first, other, again = (_generate(llm, [requests[i]])[0] for i in (0, 1, 0))
    offset = first.prompt_token_ids.index(llm.llm_engine.image_processor().image_token_id)
    assert [list(o.outputs[0].token_ids) for o in (first, other, again)] == [expected[0], expected[1], expected[0]]
    assert other.num_cached_tokens == offset // 16 * 16 > 0
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16 > offset      # into the image
    assert _encodes(llm) == 2
    llm.llm_engine.check_no_leaks()


def test_bad_image_inputs_are_refused_by_name(tiny_llava, tiny_llama):
    llm = LLM(tiny_llava, dtype="float32")

    def refused(prompt: dict, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": "USER: hello ASSISTANT:"}, prompt], GREEDY, use_tqdm=False)

    png = io.BytesIO()
    IMAGES[0].save(png, format="PNG")
    refused({"prompt": PROMPT, "multi_modal_data": {"image": [IMAGES[0], IMAGES[1]]}},
            r"1 image placeholder\(s\) \('<image>'\) for 2 image\(s\)")
    refused({"prompt": PROMPT, "multi_modal_data": {"image": b"not an image"}},
            r"multi_modal_data.image\[0\] is not a readable image")
    refused({"prompt": PROMPT, "multi_modal_data": {"image": png.getvalue()[:60]}},
            r"multi_modal_data.image\[0\] is not a readable image")
    refused({"prompt": PROMPT, "multi_modal_data": {"image": "https://example.com/cat.png"}},
            "'example.com' is not an allowed media domain, not fetched")
    refused({"prompt": PROMPT, "multi_modal_data": {"image": "file:///etc/hostname"}},
            "file URLs are read only under allowed_local_media_path")
    refused({"prompt": PROMPT, "multi_modal_data": {"video": IMAGES[0]}}, "multi_modal_data must be")
    refused({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": IMAGES[0]}}, "needs the prompt as text")
    assert not llm.llm_engine.has_unfinished_requests()
    # A data URL and encoded bytes are the same image as the PIL one.
    import base64

    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": src}} for src in (url, png.getvalue())],
                        GREEDY, use_tqdm=False)
    want = list(_generate(llm, [(PROMPT, [IMAGES[0]])])[0].outputs[0].token_ids)
    assert [list(o.outputs[0].token_ids) for o in outs] == [want, want]
    limited = LLM(tiny_llava, dtype="float32", limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match=r"at most 1 images \(limit_mm_per_prompt\); got 2"):
        limited.generate({"prompt": "<image><image>", "multi_modal_data": {"image": IMAGES[:2]}})
    assert not limited.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="limit_mm_per_prompt must be"):
        LLM(tiny_llava, dtype="float32", limit_mm_per_prompt={"video": 1})
    text_only = LLM(tiny_llama, dtype="float32")
    with pytest.raises(ValueError, match="this model takes no images"):
        text_only.generate({"prompt": PROMPT, "multi_modal_data": {"image": IMAGES[0]}}, GREEDY)
    llm.llm_engine.check_no_leaks()


def test_urls_from_allowed_hosts_and_paths_only(tiny_llava, tmp_path):
    """allowed_media_domains: an image on an allowed host is fetched (and answers as the same image
    in the request); a host not listed, even one naming the same server, is never asked; a
    redirect is not followed. allowed_local_media_path: a file under it is read, one outside
    (through `..` too) is not."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    body = io.BytesIO()
    IMAGES[0].save(body, format="PNG")
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            if self.path == "/moved.png":
                self.send_response(302)
                self.send_header("Location", "http://example.com/cat.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body.getvalue())))
            self.end_headers()
            self.wfile.write(body.getvalue())

        def log_message(self, *args: object) -> None:
            pass

    http = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    port = http.server_address[1]
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "cat.png").write_bytes(body.getvalue())
    (tmp_path / "secret.png").write_bytes(body.getvalue())
    llm = LLM(tiny_llava, dtype="float32", allowed_media_domains=["127.0.0.1"],
              allowed_local_media_path=str(tmp_path / "images"))
    want = list(_generate(llm, [(PROMPT, [IMAGES[0]])])[0].outputs[0].token_ids)
    for source in (f"http://127.0.0.1:{port}/cat.png", f"file://{tmp_path}/images/cat.png"):
        assert list(_generate(llm, [(PROMPT, [source])])[0].outputs[0].token_ids) == want
    assert hits == ["/cat.png"]
    for source, match in ((f"http://localhost:{port}/cat.png", "'localhost' is not an allowed media domain"),
                          (f"http://127.0.0.1:{port}/moved.png", "not followed"),
                          (f"file://{tmp_path}/secret.png", "read only under allowed_local_media_path"),
                          (f"file://{tmp_path}/images/../secret.png", "read only under allowed_local_media_path"),
                          (f"file://{tmp_path}/images/none.png", "cannot be read")):
        with pytest.raises(ValueError, match=match):
            _generate(llm, [(PROMPT, [source])])
    assert hits == ["/cat.png", "/moved.png"]
    http.shutdown()
    with pytest.raises(ValueError, match="allowed_media_domains must list host names"):
        LLM(tiny_llava, allowed_media_domains=["http://x.com/"])
    llm.llm_engine.check_no_leaks()


def test_embeddings_made_elsewhere_are_read_not_encoded(tiny_llava):
    """An encode replica's part (LLMEngine.encode_images) and the prefilling replica's: a request
    whose images carry their embeddings answers as one that encodes them, and encodes nothing;
    embeddings that cannot be read (of the wrong shape here) are encoded from the pixels instead."""
    import dataclasses

    from records.request import NewRequest

    encoder = LLM(tiny_llava, dtype="float32")
    processor = encoder.llm_engine.image_processor()
    ids, (img,) = processor.process(PROMPT, [IMAGES[2]])
    [made] = encoder.llm_engine.encode_images([img])
    assert made.shape == (img.length, 64) and _encodes(encoder) == 1
    prefill = LLM(tiny_llava, dtype="float32")
    engine = prefill.llm_engine
    for rid, image in (("made", dataclasses.replace(img, embeddings=made)),
                       ("bad", dataclasses.replace(img, digest=b"other", embeddings=torch.zeros(3, 3)))):
        engine.enqueue(NewRequest(rid, PROMPT, ids, GREEDY, 0.0, images=(image,)))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
    runner = engine.executor.worker.runner
    assert outs["made"] == outs["bad"] == list(_generate(encoder, [(PROMPT, [IMAGES[2]])])[0]
                                                       .outputs[0].token_ids)
    assert (runner.encoder.received, runner.encoder.encodes) == (1, 1)
    engine.check_no_leaks()


def test_a_weight_update_reaches_the_vision_tower_and_forgets_its_images(tiny_llava, tmp_path):
    """An RL trainer's update of the projector (the checkpoint's own names): an image encoded before
    is encoded again, and the answer is a fresh engine's of the new weights."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    name = "multi_modal_projector.linear_2.weight"
    tensors = load_file(os.path.join(tiny_llava, "model.safetensors"))
    assert name in tensors
    new = tensors[name] + 0.2 * torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(4))
    for file in os.listdir(tiny_llava):
        if file != "model.safetensors":
            shutil.copy(os.path.join(tiny_llava, file), tmp_path / file)
    save_file({**tensors, name: new.contiguous()}, str(tmp_path / "model.safetensors"))
    llm = LLM(tiny_llava, dtype="float32")
    before = list(_generate(llm, [(PROMPT, [IMAGES[0]])])[0].outputs[0].token_ids)
    llm.update_weights([(name, new)])
    after = list(_generate(llm, [(PROMPT, [IMAGES[0]])])[0].outputs[0].token_ids)
    assert after != before and _encodes(llm) == 2
    assert after == list(_generate(LLM(str(tmp_path), dtype="float32"), [(PROMPT, [IMAGES[0]])])[0]
                         .outputs[0].token_ids)


def test_the_serve_command_line_sets_the_encode_pool_and_the_images_limits(tiny_llava, tiny_llama):
    """`pdserve serve --encode-replicas N` and vLLM's image flags become the spec; an encode pool for
    a model that takes no images is refused naming the pool."""
    import argparse

    from cluster.config import ClusterConfig
    from cluster.serve_args import add_serve_args, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    config = config_from_args(parser.parse_args([
        tiny_llava, "--encode-replicas", "2", "--prefill-replicas", "1", "--allowed-media-domains", "a.com", "b.org",
        "--limit-mm-per-prompt", '{"image": 3}']))
    assert (sorted(config.pools), config.pools["encode"].replicas, config.mode) == (
        ["decode", "encode", "prefill"], 2, "disaggregated")
    assert (config.engine.allowed_media_domains, config.engine.limit_mm_per_prompt) == (["a.com", "b.org"],
                                                                                        {"image": 3})
    assert config.engine_config("encode").model_config.media.max_images == 3
    with pytest.raises(ValueError, match="pools.encode: model .* takes no images"):
        ClusterConfig(model=tiny_llama, pools={"decode": {}, "encode": {}}).engine_config("encode")
