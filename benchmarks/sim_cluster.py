"""Cluster-scale results from replays of a trace in virtual time (`pdserve simulate`): what a user
sizing a deployment asks, on the Mooncake conversation trace (an hour, 12,031 requests) and the
`h200-llama3-8b` profile by default.

- policies: prefix-aware against round-robin and least-loaded at 8, 32 and 128 replicas (goodput,
  prefix hit rate, TTFT);
- pd: colocated against disaggregated at several P:D ratios, at one total of replicas;
- planner: a decode pool autoscaled by the planner (TTFT and ITL targets) against fixed sizes;
- plan: `pdserve plan`'s pick on a slice of the trace.

Each replay is a `pdserve simulate --json` run (its wall time is reported too).

    .venv/bin/python benchmarks/sim_cluster.py --sections policies,pd,planner,plan --json sim_cluster.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "..", "shared", "traces", "mooncake_conversation.jsonl")


def simulate(args: argparse.Namespace, *flags: str, spec: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "cluster.cli", "simulate", "--trace", args.trace, "--profile", args.profile,
           "--ttft-slo", str(args.ttft_slo), "--itl-slo", str(args.itl_slo), "--json", *flags]
    if spec is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write(spec)
        cmd += ["--config", f.name]
    began = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    s = json.loads(out.stdout.strip().splitlines()[-1])
    s["wall_s"] = round(time.monotonic() - began, 1)
    return s


def row(name: str, s: dict) -> dict:
    keep = ("requests", "completed", "goodput_req_s", "prefix_hit_rate", "throughput_tok_s", "replica_seconds",
            "preemptions", "pd_decisions", "replicas", "wall_s", "prompt_tokens_computed")
    out = {"name": name, **{k: s[k] for k in keep}, "met": s["slo"]["met"],
           "ttft_p50": s["ttft_ms"]["p50"], "ttft_p90": s["ttft_ms"]["p90"], "ttft_p99": s["ttft_ms"]["p99"],
           "itl_p50": s["itl_ms"]["p50"], "itl_p99": s["itl_ms"]["p99"]}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--profile", default="h200-llama3-8b")
    ap.add_argument("--ttft-slo", type=float, default=2000.0)
    ap.add_argument("--itl-slo", type=float, default=50.0)
    ap.add_argument("--sections", default="policies,pd,planner,plan")
    ap.add_argument("--replicas", default="8,32,128", help="policies: the pool sizes")
    ap.add_argument("--pd-total", type=int, default=16, help="pd: replicas in all")
    ap.add_argument("--plan-duration", type=float, default=600.0, help="plan: seconds of the trace searched on")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sections = args.sections.split(",")
    results: dict[str, list] = {}
    if "policies" in sections:
        results["policies"] = [row(f"{policy} x{n}", simulate(args, "--replicas", str(n), "--policy", policy))
                               for n in map(int, args.replicas.split(","))
                               for policy in ("prefix_aware", "round_robin", "least_load")]
    if "pd" in sections:
        total = args.pd_total
        rows = [row(f"colocated {total}", simulate(args, "--replicas", str(total)))]
        for p in (total // 4, total * 3 // 8, total // 2):
            rows.append(row(f"P:D {p}:{total - p}", simulate(args, "--replicas", str(total - p),
                                                            "--prefill-replicas", str(p))))
        results["pd"] = rows
    if "planner" in sections:
        auto = ("pools:\n  decode:\n    replicas: 4\n    autoscaling: {min_replicas: 2, max_replicas: 32, "
                f"ttft_slo_ms: {args.ttft_slo * 0.5:g}, itl_slo_ms: {args.itl_slo * 0.5:g}, window_s: 60, "
                "upscale_delay_s: 10, downscale_delay_s: 120, cooldown_s: 60}\n")
        rows = [row("planner (TTFT/ITL targets, 2..32)", simulate(args, spec=auto))]
        for n in (4, 6, 8, 12):
            rows.append(row(f"fixed {n}", simulate(args, "--replicas", str(n))))
        results["planner"] = rows
    if "plan" in sections:
        out = os.path.join(tempfile.gettempdir(), "pdserve-plan.yaml")
        cmd = [sys.executable, "-m", "cluster.cli", "plan", "--trace", args.trace, "--profile", args.profile,
               "--ttft-slo", str(args.ttft_slo), "--itl-slo", str(args.itl_slo), "--duration",
               str(args.plan_duration), "--pd-ratios", "1:3,1:1", "--max-replicas", "32", "--output", out, "--json"]
        began = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        plan = json.loads(done.stdout.strip().splitlines()[-1])
        plan["wall_s"] = round(time.monotonic() - began, 1)
        plan["spec"] = open(out).read()
        print(json.dumps({k: v for k, v in plan.items() if k != "trials"}, default=str)[:2000], flush=True)
        results["plan"] = plan
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
