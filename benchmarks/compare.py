"""Run one serving workload against two OpenAI-compatible endpoints, one after the other, in one run,
and print the ratios (B / A) of throughput and latency.

    .venv/bin/python benchmarks/compare.py --a http://127.0.0.1:8000 --b http://127.0.0.1:8001 \\
        --label-a pdserve --label-b vllm --dataset random --input-len 128:512 --output-len 64 \\
        --num-prompts 64 --concurrency 8 --rounds 2

Takes every workload option of benchmarks/serve.py. With `--rounds N` the endpoints alternate
(A B A B ...) so drift on a noisy machine hits both; the ratios are per round, then the median.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve  # noqa: E402  (benchmarks/serve.py)

KEYS = [("request_throughput", None), ("output_token_throughput", None), ("ttft_ms", "median"),
        ("ttft_ms", "p99"), ("tpot_ms", "median"), ("tpot_ms", "p99"), ("itl_ms", "median"),
        ("itl_ms", "p99"), ("e2e_ms", "median")]


def value(summary: dict[str, Any], key: str, stat: str | None) -> float:
    return summary[key] if stat is None else summary[key][stat]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="base URL of endpoint A")
    ap.add_argument("--b", required=True, help="base URL of endpoint B")
    ap.add_argument("--label-a", default="A")
    ap.add_argument("--label-b", default="B")
    ap.add_argument("--model-a", default=None)
    ap.add_argument("--model-b", default=None)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--result", default=None)
    serve.add_args(ap)
    args = ap.parse_args(argv)
    slos = serve.parse_slos(args.slo)
    requests = serve.make_dataset(args)
    rounds: list[dict[str, dict[str, Any]]] = []
    for _ in range(args.rounds):
        one = {}
        for label, url, model in ((args.label_a, args.a, args.model_a), (args.label_b, args.b, args.model_b)):
            run_args = argparse.Namespace(**{**vars(args), "base_url": url.rstrip("/"), "model": model})
            results, wall = asyncio.run(serve.run(run_args, requests))
            one[label] = serve.summarize(results, wall, slos)
            serve.print_summary(one[label], f"{label} ({url})")
        rounds.append(one)
    print(f"\n{'metric':28s} {args.label_a:>12s} {args.label_b:>12s} {args.label_b + '/' + args.label_a:>10s}")
    ratios = {}
    for key, stat in KEYS:
        name = key + (f".{stat}" if stat else "")
        a = statistics.median(value(r[args.label_a], key, stat) for r in rounds)
        b = statistics.median(value(r[args.label_b], key, stat) for r in rounds)
        per_round = [value(r[args.label_b], key, stat) / value(r[args.label_a], key, stat)
                     for r in rounds if value(r[args.label_a], key, stat)]
        ratios[name] = statistics.median(per_round) if per_round else None
        ratio = f"{ratios[name]:.2f}" if ratios[name] is not None else "-"
        print(f"{name:28s} {a:12.2f} {b:12.2f} {ratio:>10s}")
    out = {"rounds": rounds, "ratios": ratios, "args": {k: str(v) for k, v in vars(args).items()}}
    if args.result:
        Path(args.result).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
