"""pdserve against vLLM's CPU build (or any two endpoints): a matrix of workloads x concurrencies,
each cell a `compare.py` run (A and B alternating over rounds), then one table of the ratios.

    .venv/bin/python benchmarks/vs_vllm.py --a http://127.0.0.1:8000 --b http://127.0.0.1:8001 \\
        --concurrency 1,12,32 --rounds 2 --result vs_vllm.json

Workloads (random token-id prompts, `ignore_eos`, fresh prompts every round so no round is a
prefix-cache hit; each cell draws from its own seeds, `--seed` + 1,000 x its index, because
`make_dataset` with one seed yields the same first prompts at any count: a cell that reused its
predecessor's seeds re-sent that cell's prompts, a prefix-cache hit for whichever server still held
them, the one with the larger KV cache):
- decode-heavy: 16-32 prompt tokens, 128 output tokens;
- prefill-heavy: 512-1024 prompt tokens, 16 output tokens;
- decode-sampled: decode-heavy's shape sampled (temperature 0.8, top-p 0.95) as chat clients send;
- random-384x64: 384 prompt tokens, 64 output tokens (`vllm bench serve --dataset-name random`'s
  shape as users run it first).
A cell sends `--prompts-per-stream` x its concurrency timed requests (at least `--min-prompts`).
Each cell also reports the prompt tokens each server's prefix cache served during it (its
`prefix_cache_hits_total` counter, pdserve's or vLLM's, before and after the cell), and warns where
that is not 0: every prompt is new, so a hit means the comparison is not the one it claims to be.
Start both servers first; docs/perf/journal.md §1 says how vLLM's CPU build is installed and started.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare
import httpx
import serve

WORKLOADS = {
    "decode-heavy": ["--input-len", "16:32", "--output-len", "128"],
    "prefill-heavy": ["--input-len", "512:1024", "--output-len", "16"],
    # decode-heavy sampled as chat clients do (the rest are greedy)
    "decode-sampled": ["--input-len", "16:32", "--output-len", "128", "--temperature", "0.8", "--top-p", "0.95"],
    # `vllm bench serve`'s random dataset as users run it first (384 in / 64 out)
    "random-384x64": ["--input-len", "384", "--output-len", "64"],
}
HIT_COUNTERS = ["pdserve:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"]
COLUMNS = [("output_token_throughput", "tok/s"), ("ttft_ms.median", "TTFT p50 ms"),
           ("itl_ms.median", "ITL p50 ms"), ("itl_ms.p99", "ITL p99 ms")]


def prefix_cache_hits(url: str) -> float | None:
    """Prompt tokens the server's prefix cache has served so far (its counter under pdserve's or
    vLLM's name, every series summed), or None where its /metrics does not answer."""
    try:
        r = httpx.get(f"{url.rstrip('/')}/metrics", timeout=30)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    return sum(serve.parse_prometheus(r.text, HIT_COUNTERS).values())


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--label-a", default="pdserve")
    ap.add_argument("--label-b", default="vllm")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"some of {list(WORKLOADS)}")
    ap.add_argument("--concurrency", default="1,12,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts-per-stream", type=int, default=3)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="cell k's round i draws with seed + 1000 k + i")
    ap.add_argument("--result", default=None)
    args = ap.parse_args(argv)
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        ap.error(f"--workloads: unknown {sorted(unknown)}; choose from {list(WORKLOADS)}")
    cells = []
    urls = {args.label_a: args.a, args.label_b: args.b}
    for workload in args.workloads.split(","):
        for c in (int(x) for x in args.concurrency.split(",")):
            seed = args.seed + 1000 * len(cells)   # rounds take seed + i; cells never share prompts
            print(f"\n=== {workload}, concurrency {c} ===", flush=True)
            hits_before = {label: prefix_cache_hits(url) for label, url in urls.items()}
            out = compare.main([
                "--a", args.a, "--b", args.b, "--label-a", args.label_a, "--label-b", args.label_b,
                "--dataset", "random", *WORKLOADS[workload], "--concurrency", str(c),
                "--num-prompts", str(max(args.min_prompts, args.prompts_per_stream * c)),
                "--warmup", "2", "--rounds", str(args.rounds), "--new-prompts-per-round",
                "--seed", str(seed), "--quiet"])
            medians = {label: {name: statistics.median(
                compare.value(r[label], *(name.split(".") + [None])[:2]) for r in out["rounds"])
                for name, _ in COLUMNS} for label in (args.label_a, args.label_b)}
            hits = {}
            for label, url in urls.items():
                after = prefix_cache_hits(url)
                hits[label] = None if after is None or hits_before[label] is None else after - hits_before[label]
            print(f"prefix-cache hit tokens in this cell: {hits}", flush=True)
            for label, n in hits.items():
                if n:
                    print(f"warning: {label}'s prefix cache served {n:.0f} prompt tokens of this cell: its prompts "
                          f"were not all new to it, so the cell does not compare what it says", flush=True)
            cells.append({"workload": workload, "concurrency": c, "medians": medians,
                          "ratios": {name: out["ratios"][name] for name, _ in COLUMNS},
                          "prefix_cache_hit_tokens": hits})
    a, b = args.label_a, args.label_b
    print("\n| workload | c | " + " | ".join(f"{title} {a} / {b} ({a}/{b})" for _, title in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for cell in cells:
        row = []
        for name, _ in COLUMNS:
            va, vb = cell["medians"][a][name], cell["medians"][b][name]
            ratio = cell["ratios"][name]
            row.append(f"{va:.1f} / {vb:.1f} ({1 / ratio:.2f})" if ratio else f"{va:.1f} / {vb:.1f}")
        print(f"| {cell['workload']} | {cell['concurrency']} | " + " | ".join(row) + " |")
    if args.result:
        Path(args.result).write_text(json.dumps(cells, indent=1))
    return cells


if __name__ == "__main__":
    main()
