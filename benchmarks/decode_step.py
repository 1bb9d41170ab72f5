"""Decode step time at a given context length, offline, on the embedded model (or `--model`) with
LLM()'s defaults and prefix caching off.

    .venv/bin/python benchmarks/decode_step.py [--batch 1,16] [--context 1024] [--dtype bfloat16]

Each batch of random `--context`-token prompts is generated twice, to 1 token (the prefill) and to
1 + `--tokens` tokens (greedy, `ignore_eos`); the step time is the difference over `--tokens`, best
of `--rounds`. Attention over a long context is where the paged decode kernel shows
(docs/perf/journal.md §7k). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline import make_prompts

from engine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--dtype", default=None, help="default: LLM()'s")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    kwargs = {"dtype": args.dtype} if args.dtype else {}
    llm = LLM(args.model, enable_prefix_caching=False, max_model_len=args.context + args.tokens + 1, **kwargs)
    vocab = llm.llm_engine.config.model_config.vocab_size
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = [{"prompt_token_ids": p} for p in make_prompts(batch, args.context, args.context, vocab, 0)]
        best = {}
        for _ in range(args.rounds):
            for n in (1, 1 + args.tokens):
                start = time.perf_counter()
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
                best[n] = min(best.get(n, float("inf")), time.perf_counter() - start)
        step = (best[1 + args.tokens] - best[1]) / args.tokens
        print(f"batch {batch:3d} x context {args.context}: decode step {step * 1e3:7.1f} ms "
              f"(prefill {best[1]:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
