"""CPU matmul paths for bf16 weights, side by side, per row count: what `cpu_fp32_gemm` decides on.

    .venv/bin/python benchmarks/cpu_linear.py            # the embedded model's shapes

For each row count M prints microseconds per call of: plain `F.linear` in bf16, the oneDNN-prepacked
bf16 weight, and fp32 GEMM on operands upcast per call (what `engine.model.layers.linear.linear` does at
M >= CPU_FP32_MIN_ROWS where `cpu_fp32_gemm` times it faster on this CPU), and the ratio plain / chosen
path.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from engine.model.layers.cpu_gemm import cpu_fp32_gemm, linear, packed_linear, prepack


def per_call_us(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,32,64,96,128,256,512")
    ap.add_argument("--shapes", default="3072x576,576x1536,960x576", help="out x in, comma separated")
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"fp32 GEMM for many bf16 rows: {cpu_fp32_gemm(torch.bfloat16)}")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        w = torch.randn(n, k, dtype=torch.bfloat16)
        packed = prepack(w)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            plain = per_call_us(lambda: F.linear(x, w), args.repeat)
            pk = per_call_us(lambda: packed_linear(x, packed), args.repeat) if packed is not None else float("nan")
            up = per_call_us(lambda: F.linear(x.float(), w.float()).bfloat16(), args.repeat)
            chosen = per_call_us(lambda: linear(x, w, None, packed), args.repeat)
            print(f"{n}x{k} M={m:4d}: bf16 {plain:8.0f} us  prepacked {pk:8.0f} us  fp32-upcast {up:8.0f} us"
                  f"  -> linear() {chosen:8.0f} us ({plain / chosen:.2f}x plain)", flush=True)


if __name__ == "__main__":
    main()
