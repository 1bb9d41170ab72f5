"""How well a profile calibrated here predicts a real server: the same trace slice replayed against
a real `pdserve serve` (the embedded model, 2 replicas of 1 CPU: colocated, and the default P/D
topology of 1 prefill + 1 decode over NIXL) and against its simulation (`pdserve simulate`, same
spec and trace, the profile's cost model), side by side in one run; the error of TTFT p50 / p90,
ITL p50 and output throughput (simulated / real - 1).

The profile is `pdserve profile` of the embedded model on one thread (what a replica of 1 CPU
gets), calibrated first unless `--profile` names one. The trace is the Mooncake conversation trace
scaled to what 2 cores serve (prompts 1/40 as long, their 512-token blocks 13 tokens, outputs 1/8,
arrivals 1/4 as fast), the same prompts on both sides (cluster/sim/trace.py: TraceTokens).

    .venv/bin/python benchmarks/sim_fidelity.py --duration 480 --json fidelity.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve as bench  # benchmarks/serve.py
from workloads import make_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "..", "shared", "traces", "mooncake_conversation.jsonl")
TOPOLOGIES = {
    "colocated": "mode: colocated\npools:\n  decode: {replicas: 2, num_cpus: 1}\n",
    "disaggregated": "mode: disaggregated\npools:\n  prefill: {replicas: 1, num_cpus: 1}\n"
                     "  decode: {replicas: 1, num_cpus: 1}\n",
}
COMPARED = (("ttft_p50", "TTFT p50"), ("ttft_p90", "TTFT p90"), ("itl_p50", "ITL p50"), ("throughput", "throughput"))


def real_run(spec: str, args: argparse.Namespace) -> dict:
    bench_args = trace_args(args)
    with bench.served(f"{spec}serving: {{port: PORT}}\n") as base:
        bench_args.base_url = base
        warm = argparse.Namespace(**{**vars(bench_args), "dataset": "random", "input_len": "64", "output_len": "8",
                                     "num_prompts": 4, "warmup": 0, "seed": 99})
        asyncio.run(bench.run(warm, make_dataset(warm)))        # compile and warm both replicas first
        bench_args.scrape_metric = ["pdserve:router_decisions_total", "pdserve:prompt_tokens_computed_total",
                                    "pdserve:kv_blocks_transferred_total"]
        results, wall, delta = asyncio.run(bench.run(bench_args, make_dataset(bench_args)))
    s = bench.summarize(results, wall)
    decisions = {re.search(r'reason="(\w+)"', k).group(1): int(v) for k, v in delta.items()
                 if k.startswith("pdserve:router_decisions_total") and 'pool="pd"' in k and v}
    totals = bench.metric_totals(delta)
    return {"ttft_p50": s["ttft_ms"]["median"], "ttft_p90": s["ttft_ms"]["p90"], "itl_p50": s["itl_ms"]["median"],
            "throughput": s["output_token_throughput"], "completed": s["completed"], "failed": s["failed"],
            "pd_decisions": decisions,
            "prompt_tokens_computed": int(totals.get("pdserve:prompt_tokens_computed_total", 0)),
            "kv_blocks_pulled": int(totals.get("pdserve:kv_blocks_transferred_total", 0))}


def simulated_run(spec: str, profile: str, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(spec)
    cmd = [sys.executable, "-m", "cluster.cli", "simulate", "--trace", args.trace, "--config", f.name,
           "--profile", profile, "--json", "--seed", "0", "--rate-scale", str(args.rate_scale),
           "--prompt-scale", str(args.prompt_scale), "--output-scale", str(args.output_scale),
           "--duration", str(args.duration)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    s = json.loads(out.stdout.strip().splitlines()[-1])
    return {"ttft_p50": s["ttft_ms"]["p50"], "ttft_p90": s["ttft_ms"]["p90"], "itl_p50": s["itl_ms"]["p50"],
            "throughput": s["throughput_tok_s"], "completed": s["completed"], "failed": s["failed"],
            "pd_decisions": s["pd_decisions"], "prompt_tokens_computed": s["prompt_tokens_computed"],
            "kv_blocks_pulled": s["kv_blocks_pulled"]}


def trace_args(args: argparse.Namespace) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    bench.add_args(ap)
    ns = ap.parse_args(["--dataset", "trace", "--trace", args.trace, "--warmup", "0", "--quiet",
                        "--rate-scale", str(args.rate_scale), "--prompt-scale", str(args.prompt_scale),
                        "--output-scale", str(args.output_scale), "--duration", str(args.duration)])
    return ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="a calibrated profile (default: calibrate one now)")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--duration", type=float, default=480.0,
                    help="seconds of the (scaled) trace to replay (480: ~340 requests; a p90 of 160 is mostly noise)")
    ap.add_argument("--rate-scale", type=float, default=0.25)
    ap.add_argument("--prompt-scale", type=float, default=1 / 40)
    ap.add_argument("--output-scale", type=float, default=1 / 8)
    ap.add_argument("--topologies", default="colocated,disaggregated")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # --duration counts seconds of the scaled trace; the trace reader counts the original's.
    args.duration = args.duration * args.rate_scale
    profile = args.profile
    if profile is None:
        profile = os.path.join(tempfile.gettempdir(), "pdserve-fidelity-profile.json")
        subprocess.run([sys.executable, "-m", "cluster.cli", "profile", "--output", profile, "--threads", "1"],
                       cwd=ROOT, check=True)
    rows = {}
    for topology in args.topologies.split(","):
        spec = TOPOLOGIES[topology]
        real = real_run(spec, args)
        sim = simulated_run(spec, profile, args)
        rows[topology] = {"real": real, "simulated": sim,
                          "error": {k: round(sim[k] / real[k] - 1, 4) if real[k] else None for k, _ in COMPARED}}
        print(f"== {topology}: {real['completed']} requests real ({real['failed']} failed), "
              f"{sim['completed']} simulated")
        for key, name in COMPARED:
            error = rows[topology]["error"][key]
            print(f"  {name:<11} real {real[key]:9.1f}  simulated {sim[key]:9.1f}  error {error:+.1%}")
        for key in ("pd_decisions", "prompt_tokens_computed", "kv_blocks_pulled"):
            print(f"  {key}: real {real[key]}, simulated {sim[key]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": profile, "args": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
