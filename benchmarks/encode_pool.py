"""What an image costs and what moving its embeddings costs (issue 72: an encode pool, E/P/D).

1. Encoding: a LLaVA-1.5-shaped random model's CLIP ViT-L/14 tower at 336 px (24 layers, 1024 wide:
   576 patch tokens) and its projector into a 4096-wide language model, on this CPU (the tower
   alone: the language model is not built), per image; and the processor's share (resize, crop,
   normalise) of a 1024x768 photo.
2. Moving the embeddings (576 x 4096 in bf16: 4.7 MB; 2,880 rows for a LLaVA-NeXT-sized image) from
   one Ray actor (the encode replica: `ray.put`) to another (the prefill replica's worker: its
   reference read, `future().result()`), as router/routing/encode.py moves them; beside them the
   same bytes returned by value through a third process (the ingress), the other way a caller
   could route them.

    .venv/bin/python benchmarks/encode_pool.py [--runs 5]

Prints medians. The transfers are within one node here (Ray's shared-memory store; between nodes
the object store streams them over the network, which this machine cannot show).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch


def clip_l_projector(dtype: torch.dtype):
    from engine.model.models.llava import LlavaVision

    mm = {"vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                            "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
                            "hidden_act": "quick_gelu", "model_type": "clip_vision_model"},
          "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu"}
    with torch.device("cpu"):
        vision = LlavaVision(mm, 4096, dtype).eval()
    for p in vision.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return vision


def bench_encode(runs: int) -> None:
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    from PIL import Image

    photo = Image.new("RGB", (1024, 768), (120, 80, 40))
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        pixels = processor(images=[photo], return_tensors="pt")["pixel_values"]
        times.append(time.perf_counter() - began)
    print(f"processor, 1024x768 -> 336x336: {statistics.median(times) * 1e3:7.1f} ms", flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        vision = clip_l_projector(dtype)
        times = []
        with torch.inference_mode():
            for _ in range(runs):
                began = time.perf_counter()
                out = vision(pixels.to(dtype))
                times.append(time.perf_counter() - began)
        print(f"encode (CLIP-L/336 + projector, {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} "
              f"threads): {statistics.median(times) * 1e3:7.1f} ms -> {list(out.shape[1:])}", flush=True)


def bench_transfer(runs: int) -> None:
    import ray

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=1)
    class Encoder:
        def __init__(self) -> None:        # the embeddings it "made" (made once: only moves are timed)
            self.made = {rows: torch.randn(rows, 4096).to(torch.bfloat16) for rows in (576, 2880)}

        def make(self, rows: int) -> list:
            return [ray.put(self.made[rows])]

        def by_value(self, rows: int) -> torch.Tensor:
            return self.made[rows]

    @ray.remote(num_cpus=1)
    class Prefill:
        def read(self, refs: list) -> float:
            began = time.perf_counter()
            made = refs[0].future().result(timeout=60)
            return time.perf_counter() - began + 0 * made.shape[0]

        def take(self, made: torch.Tensor) -> int:
            return made.shape[0]

    encoder, prefill = Encoder.remote(), Prefill.remote()
    for rows in (576, 2880):
        mb = rows * 4096 * 2 / 1e6
        by_ref, by_value = [], []
        for _ in range(runs):
            began = time.perf_counter()
            refs = ray.get(encoder.make.remote(rows))
            ray.get(prefill.read.remote(refs))
            by_ref.append(time.perf_counter() - began)
            began = time.perf_counter()
            made = ray.get(encoder.by_value.remote(rows))          # into this process (an ingress) ...
            ray.get(prefill.take.remote(made))                       # ... and on to the prefill replica
            by_value.append(time.perf_counter() - began)
        print(f"{rows} x 4096 bf16 ({mb:.1f} MB): by reference {statistics.median(by_ref) * 1e3:6.1f} ms, "
              f"by value through the caller {statistics.median(by_value) * 1e3:6.1f} ms", flush=True)
    ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    bench_encode(args.runs)
    bench_transfer(args.runs)


if __name__ == "__main__":
    main()
