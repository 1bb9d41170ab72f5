"""The C++ GGUF kernel against the dense paths, per row count of x: where `gguf_dense_min_rows` and
`gguf_dequant_min_rows` (kernels/cpu_ops.py) should switch on this CPU.

    .venv/bin/python benchmarks/cpu_gguf.py [--rows 1,4,8,12,16,32,64] [--shapes 1536x576,576x1536]
        [--qtype Q4_1] [--dtype float32] [--copies 12] [--threads N] [--library path/to/cpu_ops-*.so]

For each shape (out x in) and row count prints microseconds per call of: the blocks' kernel
(`torch.ops.pdserve_cpu.gguf_linear`), the same blocks times x quantized to int8 per block
(`gguf_linear_int8`, quantize_activations; the C++ op at every row count), dequantize per call +
`F.linear` (what a blocks-only layer does from `gguf_dequant_min_rows`), and the dense weight
prepacked for oneDNN through `engine.model.layers.linear.linear` (the dense copy of
quantization="gguf+dense"). Weights are random,
quantized by the gguf package, and cycle through `--copies` copies so that the caches hold none;
each figure is the best of `--rounds`. `--library` loads another build of the extension (e.g. the
previous commit's, from ~/.cache/pdserve/kernels) instead of this tree's, for an A/B in
separate processes. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.layers.cpu_gemm import linear, prepack
from kernels import cpu_ops, gguf_format

QTYPE_IDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}


def quantized(rows: int, cols: int, qtype: str, seed: int) -> torch.Tensor:
    import gguf

    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.1
    return torch.from_numpy(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype)))


def best_us(fn, copies: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(copies):
            fn(i)
        best = min(best, (time.perf_counter() - start) / copies)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,12,16,32,64")
    ap.add_argument("--shapes", default="1536x576,576x1536", help="out x in, comma separated")
    ap.add_argument("--qtype", default="Q4_1", choices=sorted(QTYPE_IDS))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--copies", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--library", default=None, help="a built cpu_ops library to load instead of this tree's")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.library:
        torch.ops.load_library(args.library)
    else:
        cpu_ops.load()
    dtype, qid = getattr(torch, args.dtype), QTYPE_IDS[args.qtype]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; AVX2 kernel: {cpu_ops.ymm_gguf_kernel()}; "
          f"library {args.library or cpu_ops.library_path()}", flush=True)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        blocks = [quantized(n, k, args.qtype, seed) for seed in range(args.copies)]
        dense = [gguf_format.dequantize_gguf(b, args.qtype, dtype) for b in blocks]
        packed = [prepack(d) for d in dense]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).to(dtype)
            kernel = best_us(lambda i: torch.ops.pdserve_cpu.gguf_linear(x, blocks[i], qid), args.copies, args.rounds)
            dequant = best_us(lambda i: F.linear(x, torch.ops.pdserve_cpu.gguf_dequantize(blocks[i], qid, dtype)),
                              args.copies, args.rounds)
            dense_us = best_us(lambda i: linear(x, dense[i], None, packed[i]), args.copies, args.rounds)
            int8 = best_us(lambda i: torch.ops.pdserve_cpu.gguf_linear_int8(x, blocks[i], qid), args.copies,
                           args.rounds)
            print(f"{args.qtype} {n}x{k} M={rows:4d}: blocks {kernel:8.0f} us, int8 x {int8:8.0f} us, "
                  f"dequantize + GEMM {dequant:8.0f} us, dense{' (prepacked)' if packed[0] is not None else ''} "
                  f"{dense_us:8.0f} us; blocks / dense {dense_us / kernel:.2f}x, int8 / dense "
                  f"{dense_us / int8:.2f}x", flush=True)


if __name__ == "__main__":
    main()
