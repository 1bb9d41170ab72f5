"""CPU matmul paths for bf16 weights, side by side, per row count: what `linear()` decides between.

    .venv/bin/python benchmarks/cpu_linear.py            # the embedded model's shapes

For each row count M prints microseconds per call of: plain `F.linear` in bf16, oneDNN's prepacked
bf16 weight, pdserve's own bf16 GEMM (kernels/csrc/bf16_gemm.cpp, on a CPU with AVX512-BF16), fp32
GEMM on operands upcast per call, and `linear()` with the weight `prepack` made here (the faster of
these this process chose: `own_bf16_gemm`, `cpu_fp32_gemm`). Each call takes the next of `--weights`
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
    Bf16Panels,
    cpu_fp32_gemm,
    linear,
    own_bf16_gemm,
    own_bf16_gemm_built,
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
    args = ap.parse_args()
    own = own_bf16_gemm_built()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; own bf16 GEMM built: {own}, "
          f"chosen: {own_bf16_gemm()}; fp32 GEMM for many bf16 rows: {cpu_fp32_gemm(torch.bfloat16)}")
    nan = float("nan")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        ws = [torch.randn(n, k, dtype=torch.bfloat16) for _ in range(args.weights)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
        panels = [Bf16Panels(w) for w in ws] if own else []
        chosen = [(w, prepack(w)) for w in ws]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            plain = per_call_us(lambda w: F.linear(x, w), ws, args.repeat)
            pk = per_call_us(lambda p: packed_linear(x, p), onednn, args.repeat)
            ours = per_call_us(lambda p: p.matmul(x), panels, args.repeat) if own else nan
            up = per_call_us(lambda w: F.linear(x.float(), w.float()).bfloat16(), ws, args.repeat)
            lin = per_call_us(lambda wp: linear(x, wp[0], None, wp[1]), chosen, args.repeat)
            print(f"{n}x{k} M={m:4d}: bf16 {plain:8.1f} us  oneDNN prepacked {pk:8.1f}  own {ours:8.1f}  "
                  f"fp32-upcast {up:8.1f}  -> linear() {lin:8.1f} us ({pk / lin:.2f}x oneDNN's prepacked)",
                  flush=True)


if __name__ == "__main__":
    main()
