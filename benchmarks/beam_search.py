"""Beam search offline and over HTTP, on the same model and prompts: what the round trips through
the ingress and router cost against the search itself (issue 74: beam groups inside the scheduler
only if the round trips cost more than the search).

Each beam search scores every live beam as a one-token request each step (engine/beam_search.py):
offline those requests go straight into the engine's steps, served each is a request the ingress
routes to a replica and streams back. Start a server first (`make serve`, or `pdserve serve` with
the model given here), then:

    .venv/bin/python benchmarks/beam_search.py --base-url http://127.0.0.1:8000 --width 4 --rounds 2

Prints, per side and round, beam searches per second and scored sequences (beam-steps) per second,
and the served / offline ratio; both sides run the same prompts, alternating.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "Three facts about owls:",
           "def fibonacci(n):", "The best way to learn a language is", "Once upon a time, in a small village,",
           "Explain what a hash table is.", "A recipe for pancakes needs"]


def scored_sequences(width: int, tokens: int) -> int:
    """Sequences one search scores: one at the first step, then `width` live beams each step (an
    upper bound when beams finish early; every search here runs to `tokens` with ignore_eos)."""
    return 1 + width * (tokens - 1)


def run_offline(llm: LLM, prompts: list[str], width: int, tokens: int, concurrency: int) -> float:
    """`concurrency` searches at a time, their beams scored in the same steps (as served)."""
    params = SamplingParams(use_beam_search=True, best_of=width, n=width, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = [o for i in range(0, len(prompts), concurrency)
            for o in llm.generate(prompts[i:i + concurrency], params, use_tqdm=False)]
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs) == width for o in outs)
    return elapsed


def run_served(base_url: str, model: str, prompts: list[str], width: int, tokens: int, concurrency: int) -> float:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=os.environ.get("OPENAI_API_KEY", "none"))

    def one(prompt: str) -> int:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, n=width,
                                        extra_body={"use_beam_search": True, "best_of": width, "ignore_eos": True})
        return len(out.choices)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        got = list(pool.map(one, prompts))
    elapsed = time.perf_counter() - start
    assert got == [width] * len(prompts)
    return elapsed


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True, help="a running pdserve server")
    ap.add_argument("--model", default=None, help="offline model (default: the embedded one, as `make serve`)")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=None,
                    help="searches at a time, on both sides (default: all the prompts at once)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import httpx

    served_model = httpx.get(f"{args.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    llm = LLM(args.model) if args.model else LLM()
    prompts = PROMPTS
    concurrency = args.concurrency or len(prompts)
    per_search = scored_sequences(args.width, args.tokens)
    run_offline(llm, prompts[:1], args.width, 4, 1)                    # warm both sides
    run_served(args.base_url, served_model, prompts[:1], args.width, 4, 1)
    rows: dict[str, list[float]] = {"offline": [], "served": []}
    for r in range(args.rounds):
        rows["offline"].append(run_offline(llm, prompts, args.width, args.tokens, concurrency))
        rows["served"].append(run_served(args.base_url, served_model, prompts, args.width, args.tokens, concurrency))
        print(f"round {r + 1}: " + ", ".join(
            f"{side} {len(prompts) / t[-1]:.2f} searches/s, {len(prompts) * per_search / t[-1]:.0f} sequences/s"
            for side, t in rows.items()), flush=True)
    best = {side: min(t) for side, t in rows.items()}
    result = {"width": args.width, "tokens": args.tokens, "prompts": len(prompts), "concurrency": concurrency,
              "seconds": rows, "searches_per_s": {s: len(prompts) / t for s, t in best.items()},
              "sequences_per_s": {s: len(prompts) * per_search / t for s, t in best.items()},
              "served_over_offline": best["offline"] / best["served"],
              "per_round": [o / s for o, s in zip(rows["offline"], rows["served"])]}
    print(f"best of {args.rounds}: offline {result['searches_per_s']['offline']:.2f}, served "
          f"{result['searches_per_s']['served']:.2f} searches/s; served / offline "
          f"{result['served_over_offline']:.2f} (per round "
          + ", ".join(f"{x:.2f}" for x in result["per_round"])
          + f"; median {statistics.median(result['per_round']):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
