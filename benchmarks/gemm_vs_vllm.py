"""A layer's GEMMs, pdserve's own CPU GEMM against the one vLLM's CPU build runs, in one process:
calls alternate within each round, so the host's drift between processes (which moved whole offline
runs by 0.9-1.2x on one Zen 3: docs/perf/journal.md §49) cancels.

    .venv/bin/python benchmarks/gemm_vs_vllm.py --vllm-python /work/vllm-venv/bin/python \\
        [--dtype float32|bfloat16] [--rows 768,2048] [--shapes smollm2-135m] [--rounds 6] [--threads 2]

The parent builds (or finds) pdserve's C++ kernels for this CPU and runs the worker under vLLM's
python with the environment vLLM's engine gives a CPU worker (`vllm_op_env`); the worker loads the
kernels' library into that process (both venvs must hold the same torch: it was built against it).
Per shape (out x in features of a transformer layer's linears: fused QKV, O, fused gate/up, down):

- pdserve: `f32_pack` / `f32_linear` (kernels/csrc/f32_gemm.cpp) for fp32, `bf16_pack` /
  `bf16_linear` (bf16_gemm.cpp, CPUs with AVX512-BF16) for bf16: what `linear()` runs where
  `own_gemm` holds (engine/model/layers/cpu_gemm.py).
- vLLM: `dispatch_cpu_unquantized_gemm` on a `torch.nn.Linear` of the weight, then the
  `layer.cpu_linear` it chose, as vLLM's linear layers call it (oneDNN's prepacked `onednn_mm` on
  x86 without AMX; its SGL kernel where AMX is; zentorch where installed on a Zen).

Both outputs are checked against `x @ w.T` in fp32 first. Each side keeps its best mean per call over
--rounds rounds (which side runs first alternates); printed: GFLOP/s per shape, the ratio, and the
layer's GEMM time (the sum over the shapes) on each side.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# out_features x in_features of one layer's linears
SHAPES = {
    "smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}


def worker(args: argparse.Namespace) -> None:
    # This script's folder holds a kernels.py; nothing here imports a package by that name, but vLLM's
    # imports then see the same path as in its engine.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    torch.ops.load_library(args.library)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ops = torch.ops.pdserve_cpu
    # Both ops are always registered; where the CPU lacks their ISA they raise saying which.
    pack, own_linear = ((ops.bf16_pack, ops.bf16_linear) if dtype == torch.bfloat16
                        else (ops.f32_pack, ops.f32_linear))
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES[args.shapes].items():
            w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
            x = torch.randn(m, k, generator=gen).to(dtype)
            layer = torch.nn.Linear(k, n, bias=False, dtype=dtype)
            layer.weight.data = w
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            panels = pack(w)
            sides = {"pdserve": lambda: own_linear(x, panels, n, None),
                     "vllm": lambda: layer.cpu_linear(x, layer.weight, None)}
            ref = x.float() @ w.float().t()
            errors = {side: ((f().float() - ref).norm() / ref.norm()).item() for side, f in sides.items()}
            bound = 1e-2 if dtype == torch.bfloat16 else 1e-5
            if max(errors.values()) > bound:
                raise SystemExit(f"{name} at {m} rows: relative error {errors} over {bound}")
            calls = max(1, int(args.seconds * 100e9 / (2 * m * n * k)))   # ~seconds at 100 GFLOP/s
            best = {side: float("inf") for side in sides}
            for r in range(args.rounds):
                for side in (("pdserve", "vllm") if r % 2 == 0 else ("vllm", "pdserve")):
                    start = time.perf_counter()
                    for _ in range(calls):
                        sides[side]()
                    best[side] = min(best[side], (time.perf_counter() - start) / calls)
            # Which GEMM vLLM's dispatch chose, by the name its lambda calls.
            names = layer.cpu_linear.__code__.co_names if hasattr(layer.cpu_linear, "__code__") else ()
            chosen = next((c for c in ("onednn_mm", "weight_packed_linear_cpu", "zentorch_linear_unary")
                           if c in names), "torch.nn.functional.linear")
            rows.append({"rows": m, "shape": name, "n": n, "k": k, "s": best, "errors": errors, "vllm_gemm": chosen})
    print("RESULT " + json.dumps({"torch": torch.__version__, "rows": rows}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rows", default="768,2048", help="row counts (tokens in a step), comma-separated")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=0.2, help="about this long per side per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--library", help=argparse.SUPPRESS)      # the worker's: the kernels' .so
    args = ap.parse_args()
    if args.library:
        worker(args)
        return
    import torch
    from offline_vs_vllm import run_worker, vllm_op_env

    # This script's folder holds a kernels.py that would shadow the package named `kernels`.
    sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]
    from kernels import cpu_ops

    cmd = [args.vllm_python, str(Path(__file__).resolve()), "--library", cpu_ops.load(), "--dtype", args.dtype,
           "--rows", args.rows, "--shapes", args.shapes, "--rounds", str(args.rounds),
           "--seconds", str(args.seconds), "--threads", str(args.threads), "--seed", str(args.seed)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), **vllm_op_env(args.vllm_python, args.threads))
    result = run_worker(cmd, env, "worker", cwd=ROOT)
    if result["torch"] != torch.__version__:
        print(f"warning: vLLM's venv has torch {result['torch']}, the kernels were built against {torch.__version__}")
    chosen = sorted({r["vllm_gemm"] for r in result["rows"]})
    print(f"{args.shapes}, {args.dtype}, {args.threads} threads; best of {args.rounds} alternating rounds; "
          f"vLLM's GEMM: {', '.join(chosen)}")
    print(f"{'rows':>5} {'shape':8} {'pdserve GFLOP/s':>16} {'vLLM GFLOP/s':>13} {'pdserve/vLLM':>13}")
    layer: dict[int, dict[str, float]] = {}
    for r in result["rows"]:
        flops = 2 * r["rows"] * r["n"] * r["k"]
        ours, theirs = (flops / r["s"][side] / 1e9 for side in ("pdserve", "vllm"))
        print(f"{r['rows']:>5} {r['shape']:8} {ours:16.1f} {theirs:13.1f} {ours / theirs:13.2f}")
        for side in ("pdserve", "vllm"):
            layer.setdefault(r["rows"], {}).setdefault(side, 0.0)
            layer[r["rows"]][side] += r["s"][side]
    for m, t in layer.items():
        print(f"{m:>5} rows, the layer's GEMMs: pdserve {t['pdserve'] * 1e3:.2f} ms, vLLM {t['vllm'] * 1e3:.2f} ms: "
              f"pdserve {t['vllm'] / t['pdserve']:.2f}x")


if __name__ == "__main__":
    main()
