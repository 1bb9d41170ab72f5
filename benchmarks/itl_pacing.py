"""Prefill paced to an ITL target (`itl_target_ms`, engine/core/step_budget.py) against the whole
step budget, offline: one in-process engine per setting under the same closed-loop mixed load
(`--streams` requests in flight; a `--long-fraction` of them `--long-len`-token prompts with 4 output
tokens, the rest 16-64 tokens with 64 out), alternating, fresh requests each round. Prints per round
the output tok/s, the short streams' inter-token gaps (p50 / p90 / p99), the long prompts' TTFT and
the pacer's mean cap (docs/perf/journal.md §52).

    .venv/bin/python benchmarks/itl_pacing.py --model <fp32 SmolLM2> --target-ms 400 --rounds 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))     # (after the project: benchmarks/kernels.py is not it)

from workloads import BenchRequest, make_dataset

from engine.llm_engine import LLMEngine
from records.config_resolution import engine_config
from records.sampling_params import SamplingParams


def workload(args: argparse.Namespace, vocab_size: int, seed: int, n: int) -> list[BenchRequest]:
    """The `mixed` dataset of benchmarks/workloads.py (what the served comparison sends): chats of
    16-64 tokens and 64 out, a `--long-fraction` of `--long-len`-token prompts with 4 out, token ids
    drawn from the model's vocabulary."""
    return make_dataset(argparse.Namespace(
        dataset="mixed", seed=seed, num_prompts=n, warmup=0, vocab_size=vocab_size, input_len="16:64",
        output_len="64", long_fraction=args.long_fraction, long_input_len=str(args.long_len), long_output_len="4"))


def run(engine: LLMEngine, requests: list[BenchRequest], streams: int) -> dict[str, float]:
    pending, live, last = list(enumerate(requests)), {}, {}
    gaps, ttfts, caps, tokens = [], [], [], 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(live) < streams:
            i, request = pending.pop(0)
            live[f"r{i}"] = (request.cls, time.perf_counter())
            engine.add_request(f"r{i}", None, request.prompt, SamplingParams(
                max_tokens=request.output_len, temperature=0, ignore_eos=True, output_kind="delta"))
        outputs, now = engine.step(), time.perf_counter()
        if engine.scheduler.budget.prompt_cap is not None:
            caps.append(engine.scheduler.budget.prompt_cap)
        for out in outputs:
            kind, arrived = live[out.request_id]
            new = len(out.outputs[0].token_ids)
            tokens += new
            if new and out.request_id in last and kind == "short":
                gaps.append(now - last[out.request_id])
            elif new and out.request_id not in last and kind == "long":
                ttfts.append(now - arrived)
            if new:
                last[out.request_id] = now
            if out.finished:
                del live[out.request_id]
    wall = time.perf_counter() - start
    q = statistics.quantiles(gaps, n=100)
    return {"tok_s": tokens / wall, "itl_p50_ms": q[49] * 1e3, "itl_p90_ms": q[89] * 1e3, "itl_p99_ms": q[98] * 1e3,
            "long_ttft_p50_ms": statistics.median(ttfts) * 1e3 if ttfts else 0.0,
            "mean_cap": statistics.mean(caps) if caps else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--target-ms", type=float, default=400.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long-fraction", type=float, default=0.2)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    engines = {target: LLMEngine(engine_config(args.model, dtype=args.dtype, max_model_len=2048,
                                                     num_kv_blocks=2048, itl_target_ms=target))
               for target in (None, args.target_ms)}
    vocab = next(iter(engines.values())).config.model_config.vocab_size
    for engine in engines.values():                       # warm up
        run(engine, workload(args, vocab, 1, args.streams), args.streams)
    for r in range(args.rounds):
        requests = workload(args, vocab, 10 + r, args.requests)
        for target, engine in engines.items():
            m = run(engine, requests, args.streams)
            print(f"round {r} target {target}: {m['tok_s']:.1f} tok/s, short ITL p50/p90/p99 {m['itl_p50_ms']:.0f}/"
                  f"{m['itl_p90_ms']:.0f}/{m['itl_p99_ms']:.0f} ms, long TTFT p50 {m['long_ttft_p50_ms']:.0f} ms, "
                  f"mean cap {m['mean_cap']:.0f}", flush=True)


if __name__ == "__main__":
    main()
