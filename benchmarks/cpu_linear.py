"""CPU matmul paths for bf16 or fp32 weights, side by side, per row count: what `linear()` decides between.

    .venv/bin/python benchmarks/cpu_linear.py            # the embedded model's shapes, bf16
    .venv/bin/python benchmarks/cpu_linear.py --dtype float32

For each row count M prints microseconds per call of: plain `F.linear` (oneDNN's bf16 GEMM, MKL's
sgemm for fp32), oneDNN's prepacked weight, pdserve's own GEMM (kernels/csrc/bf16_gemm.cpp on a CPU
with AVX512-BF16, kernels/csrc/f32_gemm.cpp with AVX2 or AVX-512 FMA), for bf16 fp32 GEMM on operands
upcast per call, and `linear()` with the weight `prepack` made here (the faster of these this process
chose: `own_gemm`, `cpu_fp32_gemm`, `fp32_packed_min_rows`). Each call takes the next of `--weights`
copies of the weight in turn, so that, as in a model's step, the weights come from memory rather than
from the cache (`--weights 1`: the same weight every call).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from engine.model.layers.cpu_gemm import (
    OwnPanels,
    cpu_fp32_gemm,
    linear,
    own_gemm,
    own_gemm_built,
    packed_linear,
    prepack,
)


def per_call_us(fn, items: list, repeat: int) -> float:
    """Microseconds per call of fn(item), over `repeat` passes through the items, best of three."""
    for item in items:
        fn(item)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            for item in items:
                fn(item)
        best = min(best, (time.perf_counter() - start) / (repeat * len(items)) * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,32,64,96,128,256,512")
    ap.add_argument("--shapes", default="3072x576,576x1536,960x576", help="out x in, comma separated")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--weights", type=int, default=16, help="copies of each weight, taken in turn")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    own = own_gemm_built(dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; own GEMM built: {own}, "
          f"chosen: {own_gemm(dtype)}"
          + (f"; fp32 GEMM for many bf16 rows: {cpu_fp32_gemm(dtype)}" if dtype == torch.bfloat16 else ""))
    nan = float("nan")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        ws = [torch.randn(n, k, dtype=dtype) for _ in range(args.weights)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
        panels = [OwnPanels(w) for w in ws] if own else []
        chosen = [(w, prepack(w)) for w in ws]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, dtype=dtype)
            plain = per_call_us(lambda w: F.linear(x, w), ws, args.repeat)
            pk = per_call_us(lambda p: packed_linear(x, p), onednn, args.repeat)
            ours = per_call_us(lambda p: p.matmul(x), panels, args.repeat) if own else nan
            up = (per_call_us(lambda w: F.linear(x.float(), w.float()).bfloat16(), ws, args.repeat)
                  if dtype == torch.bfloat16 else nan)
            lin = per_call_us(lambda wp: linear(x, wp[0], None, wp[1]), chosen, args.repeat)
            gflops = 2 * m * n * k / (min(t for t in (pk, ours, lin) if t == t) * 1e3) if m else nan
            print(f"{n}x{k} M={m:4d}: F.linear {plain:8.1f} us  oneDNN prepacked {pk:8.1f}  own {ours:8.1f}  "
                  f"fp32-upcast {up:8.1f}  -> linear() {lin:8.1f} us ({pk / lin:.2f}x oneDNN's prepacked; "
                  f"fastest {gflops:.0f} GFLOP/s)", flush=True)


if __name__ == "__main__":
    main()
