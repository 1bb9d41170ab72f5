"""Image-heavy chat traffic served colocated and with an encode pool, and what an image costs
(issue 72).

1. Tokens an image takes, from the families' own processors (no model needed): LLaVA-1.5 (CLIP at
   336 px: 576 whatever the size), LLaVA-NeXT (its grid of tiles), Qwen2-VL (its patch grid / 4:
   the size decides), Gemma 3 (256), for photos of 448 to 1,024 px.
2. Served, on one node: `--chats` chats of 1 to 4 JPEG photos of 448 to 1,024 px each (a quarter of
   the images repeat an earlier chat's), `--concurrency` at a time, through the official openai
   client, against (a) one colocated replica with 2 CPUs, encoding where it prefills, and (b) an
   encode replica and a colocated replica with 1 CPU each (E + PD). Per variant: time, chats/s,
   time to first token p50/p99, prompt tokens, and each replica's encoder stats (images encoded,
   received made, the cache's hit rate).

The model: a random LLaVA-1.5-shaped one, CLIP ViT-L/14-336 (24 layers, 1024 wide: 576 tokens an
image) over a SmolLM2-135M-shaped Llama (30 layers, 576 wide), bf16, written to --dir once.

    .venv/bin/python benchmarks/image_serving.py [--chats 16] [--concurrency 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = [(448, 448), (768, 576), (1024, 768), (640, 1024), (1024, 1024)]


def photos(n: int, seed: int):
    """`n` smooth random photos (gradients and blobs: JPEG sizes as a photo's, not noise's)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        y, x = np.mgrid[0:h, 0:w] / max(h, w)
        channels = [np.sin(x * rng.uniform(2, 9) + y * rng.uniform(2, 9) + rng.uniform(0, 6)) for _ in range(3)]
        out.append(Image.fromarray((np.stack(channels, -1) * 120 + 128).clip(0, 255).astype("uint8")))
    return out


def token_counts() -> list[dict]:
    """Tokens per image by family and size, as each family's processor counts them (Gemma 3: its
    config's mm_tokens_per_image, 256, whatever the size)."""
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    qwen = Qwen2VLImageProcessorPil()            # the checkpoints' default pixel bounds
    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]     # LLaVA-NeXT 7B's
    tiles = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                       image_grid_pinpoints=pinpoints)
    next_ = LlavaNextProcessor(image_processor=tiles, tokenizer=_tokenizer(), patch_size=14,
                               vision_feature_select_strategy="default", image_token="<image>",
                               num_additional_image_tokens=1)
    counts = next_._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in SIZES]).num_image_tokens
    return [{"size": f"{w}x{h}", "llava_1_5": 576, "llava_next": n,
             "qwen2_vl": qwen.get_number_of_image_patches(h, w, {}) // 4, "gemma3": 256}
            for (w, h), n in zip(SIZES, counts, strict=True)]


def _tokenizer():
    """The embedded model's tokenizer with LLaVA's `<image>` token."""
    from transformers import AutoTokenizer

    from records.model_source import embedded_model_path

    gguf = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return tokenizer


def build_model(path: str) -> None:
    """The random LLaVA-1.5-shaped checkpoint and its processor, unless `path` has them."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _tokenizer()
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       tie_word_embeddings=True)
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, projection_dim=768)
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                         vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 336},
                                                      crop_size={"height": 336, "width": 336}),
                   tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default", image_token="<image>",
                   num_additional_image_tokens=1, chat_template=tokenizer.chat_template).save_pretrained(path)


def chats(n: int, seed: int) -> list[list[str]]:
    """Each chat's images as data URLs: 1 to 4 photos, a quarter of them an earlier chat's."""
    import random

    rng = random.Random(seed)
    pool = photos(n * 4, seed)
    urls = []
    for img in pool:
        out = io.BytesIO()
        img.save(out, format="JPEG", quality=85)
        urls.append("data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode())
    used: list[str] = []
    out: list[list[str]] = []
    fresh = iter(urls)
    for _ in range(n):
        images = []
        for _ in range(rng.randint(1, 4)):
            images.append(rng.choice(used) if used and rng.random() < 0.25 else next(fresh))
            used.append(images[-1])
        out.append(images)
    return out


async def workload(base: str, plan: list[list[str]], concurrency: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=1800)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    tokens = {"prompt": 0, "completion": 0}
    failed: list[str] = []

    async def one(i: int, images: list[str]) -> None:
        content = [{"type": "text", "text": f"Chat {i}: compare these pictures."}]
        content += [{"type": "image_url", "image_url": {"url": url}} for url in images]
        async with gate:
            start = time.monotonic()
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                    temperature=0.0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True})
                first = None
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.monotonic() - start
                    if chunk.usage is not None:
                        tokens["prompt"] += chunk.usage.prompt_tokens
                        tokens["completion"] += chunk.usage.completion_tokens
                if first is not None:
                    ttft.append(first)
            except Exception as e:  # noqa: BLE001 - counted and reported
                failed.append(f"{type(e).__name__}: {e}"[:200])

    start = time.monotonic()
    await asyncio.gather(*[one(i, images) for i, images in enumerate(plan)])
    seconds = time.monotonic() - start
    ttft.sort()
    return {"seconds": round(seconds, 1), "chats_per_s": round(len(plan) / seconds, 3),
            "ttft_p50_s": round(statistics.median(ttft), 2) if ttft else None,
            "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 2) if ttft else None,
            "prompt_tokens": tokens["prompt"], "completion_tokens": tokens["completion"], "failed": failed}


def run_variant(label: str, pools: dict, args: argparse.Namespace, plan: list[list[str]]) -> dict:
    import ray

    from cluster.config import ClusterConfig
    from cluster.launch import serve_cluster, shutdown
    from cluster.manager import MANAGER_NAME

    name = f"images-{label}"
    config = ClusterConfig(model=args.dir, engine={"dtype": "bfloat16", "max_model_len": 4096, "max_num_seqs": 8},
                           mode="colocated", pools=pools, name=name,
                           serving={"port": args.port, "wait_for_pools": True, "max_body_bytes": 64 << 20})
    serve_cluster(config, blocking=False)
    try:
        result = asyncio.run(workload(f"http://127.0.0.1:{args.port}", plan, args.concurrency, args.max_tokens))
        manager = ray.get_actor(MANAGER_NAME, namespace=name)
        _, members = ray.get(manager.membership.remote())
        stats = {f"{pool}-{i}": ray.get(h.encoder_stats.remote())
                 for pool, replicas in members.items() for i, h in enumerate(replicas.values())}
    finally:
        shutdown(config)
    for s in stats.values():
        s["hit_rate"] = round(s["hits"] / s["queries"], 3) if s["queries"] else None
    return {"label": label, **result, "encoder": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/pdserve-llava-bench", help="where the random model is written once")
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--variants", default="colocated,encode-pool")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    report: dict = {"args": vars(args), "tokens_per_image": token_counts()}
    print(f"{'size':>10} {'LLaVA-1.5':>10} {'LLaVA-NeXT':>11} {'Qwen2-VL':>9} {'Gemma 3':>8}")
    for r in report["tokens_per_image"]:
        print(f"{r['size']:>10} {r['llava_1_5']:>10} {r['llava_next']:>11} {r['qwen2_vl']:>9} {r['gemma3']:>8}")
    build_model(args.dir)
    plan = chats(args.chats, args.seed)
    print(f"{args.chats} chats, {sum(map(len, plan))} images ({len({u for c in plan for u in c})} distinct)")

    from cluster.launch import init_ray

    init_ray(num_cpus=3)
    variants = {"colocated": {"decode": {"replicas": 1, "num_cpus": 2}},
                "encode-pool": {"decode": {"replicas": 1, "num_cpus": 1}, "encode": {"replicas": 1, "num_cpus": 1}}}
    report["variants"] = [run_variant(label, variants[label], args, plan) for label in args.variants.split(",")]
    print(f"{'variant':<12} {'seconds':>8} {'chats/s':>8} {'TTFT p50':>9} {'p99':>6} {'prompt tok':>10}  encoders")
    for v in report["variants"]:
        print(f"{v['label']:<12} {v['seconds']:>8} {v['chats_per_s']:>8} {v['ttft_p50_s']:>9} {v['ttft_p99_s']:>6} "
              f"{v['prompt_tokens']:>10}  {v['encoder']}  failed {len(v['failed'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
