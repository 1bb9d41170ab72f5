"""CPU attention per layer: the compiled kernels (kernels/cpu_ops.py) against the torch reference
(block gather + SDPA, kernels/reference.py), side by side on the same paged cache.

    .venv/bin/python benchmarks/cpu_attention.py [--kind decode|prefill|both] [--dtype bfloat16]
        [--rounds 3] [--layers 1] [--json out.json]

Shapes: the embedded SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64) and Llama-3-8B (32/8/128).
Decode: batch x context as a decode batch meets them. Prefill: whole prompts, and chunks of a prompt
whose first part is already cached (chunked prefill, prefix hits). Each sequence's blocks are drawn
at random from the pool (the engine's free queue hands out blocks in any order once requests come
and go). Each size alternates the two kernels for --rounds rounds and keeps each one's best, then
prints both and their ratio; for decode the compiled kernel's K/V read rate (bytes of K and V it must
read over its time), for prefill its arithmetic rate (causal attention's multiply-adds over its
time). With --layers N each decode size gets N separate caches and a timed call runs every one of them
once, as a model's decode step does: K/V then come from memory, not from a cache that the last call
left warm (times are per layer). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from kernels import cpu_ops, reference

SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
SIZES = [(1, 2048), (16, 256), (16, 1024), (64, 400)]
# (query_lens, seq_lens) of one prefill step's segments.
PREFILL_SIZES = [([512], [512]), ([256] * 4, [256] * 4), ([64] * 16, [64] * 16), ([256, 256], [768, 512])]
BLOCK = 16


def paged(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    width = -(-context // BLOCK)
    num_blocks = batch * width
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g).view(batch, width)
    query = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    return query, cache, tables, torch.full((batch,), context)


def paged_prefill(query_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    need = [-(-n // BLOCK) for n in seq_lens]
    cache = torch.randn(2, sum(need), BLOCK, kv_heads, head_dim, generator=g).to(dtype)
    ids = torch.randperm(sum(need), generator=g)
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    query = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    return query, cache, tables


def mean_ms(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def best_of(rounds: int, calls: int, kernels: dict, args: tuple) -> dict[str, float]:
    """Each kernel's best mean time per call over `rounds` rounds that alternate the kernels."""
    times = dict.fromkeys(kernels, float("inf"))
    for _ in range(rounds):
        for name, fn in kernels.items():
            times[name] = min(times[name], mean_ms(lambda: fn(*args), calls))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="both", choices=["decode", "prefill", "both"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1,
                    help="decode: time one call per layer over this many separate caches (a model's step), per layer")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"C++ kernels: {cpu_ops.load()}; {torch.get_num_threads()} threads; {args.dtype}")
    rows = []
    for model, (heads, kv_heads, head_dim) in SHAPES.items():
        scale = head_dim ** -0.5
        for batch, context in SIZES if args.kind in ("decode", "both") else ():
            layers = [paged(batch, context, heads, kv_heads, head_dim, dtype) for _ in range(args.layers)]
            calls = max(2, int(2e6 // (batch * context * kv_heads * args.layers)))
            times = best_of(args.rounds, calls, {
                name: lambda fn=fn: [fn(q, cache, tables, lens, scale) for q, cache, tables, lens in layers]
                for name, fn in (("cpu", cpu_ops.decode_attention), ("reference", reference.decode_attention))}, ())
            times = {name: ms / args.layers for name, ms in times.items()}
            kv_bytes = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
            row = {"kind": "decode", "model": model, "batch": batch, "context": context, "layers": args.layers,
                   "cpu_ms": times["cpu"], "reference_ms": times["reference"],
                   "speedup": times["reference"] / times["cpu"], "cpu_kv_gb_per_s": kv_bytes / times["cpu"] / 1e6}
            rows.append(row)
            print(f"{model:13s} decode batch {batch:3d} x {context:5d}: cpu {times['cpu']:7.3f} ms, reference "
                  f"{times['reference']:7.3f} ms, {row['speedup']:4.1f}x; K/V read {row['cpu_kv_gb_per_s']:5.1f} GB/s")
        for query_lens, seq_lens in PREFILL_SIZES if args.kind in ("prefill", "both") else ():
            q, cache, tables = paged_prefill(query_lens, seq_lens, heads, kv_heads, head_dim, dtype)
            # Causal query-key pairs (each query row sees the keys up to its position) x heads x head_dim;
            # each costs two multiply-adds (the score and the weighted value), four flops.
            work = sum(ql * (sl - ql) + ql * (ql + 1) // 2 for ql, sl in zip(query_lens, seq_lens)) * heads * head_dim
            calls = max(2, int(3e8 // work))
            times = best_of(args.rounds, calls,
                            {"cpu": cpu_ops.prefill_attention, "reference": reference.prefill_attention},
                            (q, cache, tables, query_lens, seq_lens, scale))
            shape = f"{len(query_lens)} x {query_lens[0]} of {seq_lens[0]}"
            row = {"kind": "prefill", "model": model, "query_lens": query_lens, "seq_lens": seq_lens,
                   "cpu_ms": times["cpu"], "reference_ms": times["reference"],
                   "speedup": times["reference"] / times["cpu"], "cpu_gflop_per_s": 4 * work / times["cpu"] / 1e6}
            rows.append(row)
            print(f"{model:13s} prefill {shape:17s}: cpu {times['cpu']:7.3f} ms, reference {times['reference']:7.3f} "
                  f"ms, {row['speedup']:4.1f}x; {row['cpu_gflop_per_s']:5.1f} GFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
