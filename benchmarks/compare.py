"""Run one serving workload against two OpenAI-compatible endpoints, one after the other, in one run,
and print the ratios (B / A) of throughput and latency.

    .venv/bin/python benchmarks/compare.py --a http://127.0.0.1:8000 --b http://127.0.0.1:8001 \\
        --label-a pdserve --label-b vllm --dataset random --input-len 128:512 --output-len 64 \\
        --num-prompts 64 --concurrency 8 --rounds 2

Takes every workload option of benchmarks/serve.py. With `--rounds N` the endpoints alternate
(A B A B ...) so drift on a noisy machine hits both; the ratios are per round, then the median.
Every round sends the same prompts unless `--new-prompts-per-round`: from the second round on they
are prefix-cache hits on both servers (what a warm-cache comparison wants, and what an interference
or prefill comparison must avoid).
Requests with class labels (`--dataset mixed`) get a table per class too; `--scrape-metric` names
add their increase per round (summed over series) to the table. The result JSON keeps every
round's summaries and each endpoint's per-request latencies (for benchmarks/plots.py).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve
import workloads

KEYS = [("request_throughput", None), ("output_token_throughput", None), ("ttft_ms", "median"),
        ("ttft_ms", "p99"), ("tpot_ms", "median"), ("tpot_ms", "p99"), ("itl_ms", "median"),
        ("itl_ms", "p99"), ("e2e_ms", "median")]


def value(summary: dict[str, Any], key: str, stat: str | None) -> float:
    return summary[key] if stat is None else summary[key].get(stat, 0.0)


def table(rounds: list[dict[str, dict[str, Any]]], label_a: str, label_b: str,
          keys: list[tuple[str, str | None]]) -> dict[str, float | None]:
    """Print each key's median over rounds for A and B and the median of the per-round B/A ratios."""
    print(f"\n{'metric':44s} {label_a:>12s} {label_b:>12s} {label_b + '/' + label_a:>10s}")
    ratios = {}
    for key, stat in keys:
        name = key + (f".{stat}" if stat else "")
        a = statistics.median(value(r[label_a], key, stat) for r in rounds)
        b = statistics.median(value(r[label_b], key, stat) for r in rounds)
        per_round = [value(r[label_b], key, stat) / value(r[label_a], key, stat)
                     for r in rounds if value(r[label_a], key, stat)]
        ratios[name] = statistics.median(per_round) if per_round else None
        ratio = f"{ratios[name]:.2f}" if ratios[name] is not None else "-"
        print(f"{name:44s} {a:12.2f} {b:12.2f} {ratio:>10s}")
    return ratios


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="base URL of endpoint A")
    ap.add_argument("--b", required=True, help="base URL of endpoint B")
    ap.add_argument("--label-a", default="A")
    ap.add_argument("--label-b", default="B")
    ap.add_argument("--model-a", default=None)
    ap.add_argument("--model-b", default=None)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--new-prompts-per-round", action="store_true",
                    help="round i draws its workload with seed + i (both endpoints still see the same "
                         "prompts): without it, rounds after the first hit the servers' prefix caches")
    ap.add_argument("--result", default=None)
    serve.add_args(ap)
    args = ap.parse_args(argv)
    slos = serve.parse_slos(args.slo)
    requests = workloads.make_dataset(args)
    rounds: list[dict[str, dict[str, Any]]] = []
    records: dict[str, list[dict[str, Any]]] = {args.label_a: [], args.label_b: []}
    for i in range(args.rounds):
        if args.new_prompts_per_round and i:
            requests = workloads.make_dataset(argparse.Namespace(**{**vars(args), "seed": args.seed + i}))
        one = {}
        for label, url, model in ((args.label_a, args.a, args.model_a), (args.label_b, args.b, args.model_b)):
            run_args = argparse.Namespace(**{**vars(args), "base_url": url.rstrip("/"), "model": model})
            results, wall, delta = asyncio.run(serve.run(run_args, requests))
            one[label] = serve.summarize(results, wall, slos, delta if args.scrape_metric else None)
            serve.print_summary(one[label], f"{label} ({url}), round {i + 1}")
            records[label].extend({**dataclasses.asdict(r), "text": None, "round": i} for r in results)
        rounds.append(one)
    ratios = table(rounds, args.label_a, args.label_b, KEYS + [("metrics_total", m) for m in args.scrape_metric])
    for cls in sorted(rounds[0][args.label_a].get("classes", {})):
        print(f"\n[class {cls}]")
        per_class = [{k: v["classes"][cls] for k, v in r.items()} for r in rounds]
        ratios.update({f"{cls}:{k}": v for k, v in table(per_class, args.label_a, args.label_b, KEYS).items()})
    out = {"rounds": rounds, "ratios": ratios, "args": {k: str(v) for k, v in vars(args).items()},
           "requests": records}
    if args.result:
        Path(args.result).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
