"""Where an engine step's time goes: the model (`execute_model`: forward and sampling), the
scheduler, and the per-token output work on the engine thread (incremental detokenization, stop
strings, building the outputs), for a decode-heavy batch run offline in this process.

    .venv/bin/python benchmarks/step_breakdown.py --dtype bfloat16 --batch 1,16,64

The output work is what vLLM moves to its frontend process; this says what it costs here, per
output token and as a share of the step (docs/perf/journal.md §7).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline import make_prompts

from engine import LLM, SamplingParams


def timed(totals: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return wrapper


def run(llm: LLM, batch: int, input_len: int, output_len: int, stop: list[str], seed: int) -> dict[str, float]:
    engine = llm.llm_engine
    totals: dict[str, float] = defaultdict(float)
    parts = {"model": (engine.executor, "execute_model"), "schedule": (engine.scheduler, "schedule"),
             "update": (engine.scheduler, "update_from_output"),
             "detokenize+stop": (engine.output, "process_tokens"), "outputs": (engine.output, "make_output")}
    originals = {name: getattr(obj, attr) for name, (obj, attr) in parts.items()}
    for name, (obj, attr) in parts.items():
        setattr(obj, attr, timed(totals, name, originals[name]))
    try:
        vocab = engine.config.model_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, stop=stop or None)
        for i, p in enumerate(make_prompts(batch, input_len, input_len, vocab, seed)):
            engine.add_request(f"s{seed}-{i}", None, p, params)
        steps = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        totals["step"] = time.perf_counter() - start
    finally:
        for name, (obj, attr) in parts.items():
            setattr(obj, attr, originals[name])
    totals["steps"] = steps
    totals["tokens"] = batch * output_len
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--input-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--stop", action="append", default=[], help="stop strings (never matched by the "
                    "random prompts' outputs in practice; they add the stop-string scan)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(int(b) for b in args.batch.split(",")))
    run(llm, 4, args.input_len, 8, args.stop, seed=999)           # warm-up
    names = ["model", "schedule", "update", "detokenize+stop", "outputs"]
    print(f"{'batch':>5} {'round':>5} {'step ms':>8} " + " ".join(f"{n:>16}" for n in names)
          + f" {'other':>8} {'output work us/token':>21}")
    for batch in (int(b) for b in args.batch.split(",")):
        for r in range(args.rounds):
            t = run(llm, batch, args.input_len, args.output_len, args.stop, seed=r)
            share = {n: t[n] / t["step"] for n in names}
            other = 1 - sum(share.values())
            per_token_us = (t["detokenize+stop"] + t["outputs"]) / t["tokens"] * 1e6
            print(f"{batch:>5} {r:>5} {t['step'] / t['steps'] * 1e3:>8.2f} "
                  + " ".join(f"{share[n]:>15.1%} " for n in names) + f"{other:>8.1%} {per_token_us:>21.1f}")


if __name__ == "__main__":
    main()
