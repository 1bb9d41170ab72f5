"""Bytes of the step message the Ray executor sends its worker ranks (TP/PP) per decode step: the
step delta (engine/worker/step_codec.py) against the whole SchedulerOutput the executor used to pickle,
at several batch sizes and contexts, on the tiny model of benchmarks/step_overhead.py.

    .venv/bin/python benchmarks/step_bytes.py --batch 64 --context 128,2048

Counted in this process (the in-process executor, its steps passed through the encoder as a Ray
executor's are): the message is the same bytes a worker would read. Decode steps are those in
which every scheduled request computes one token.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from step_overhead import make_tiny_model

from engine import LLM, SamplingParams
from engine.worker.step_codec import StepEncoder


def measure(model: str, batch: int, context: int, output_len: int) -> tuple[int, int]:
    """(median delta bytes, median whole-SchedulerOutput bytes) over the decode steps."""
    llm = LLM(model, dtype="bfloat16", max_model_len=context + output_len + 16, max_num_seqs=batch,
              max_num_batched_tokens=batch * context, num_kv_blocks=batch * (-(-(context + output_len) // 16) + 1))
    executor, encoder = llm.llm_engine.executor, StepEncoder()
    exchange = executor._exchange
    deltas, wholes = [], []

    def counted(sched, kv_ops):
        if sched is not None:
            delta = len(pickle.dumps((encoder.encode(sched), kv_ops), protocol=pickle.HIGHEST_PROTOCOL))
            if sched.scheduled and all(len(s.token_ids) == 1 for s in sched.scheduled) \
                    and len(sched.scheduled) == batch:
                deltas.append(delta)
                wholes.append(len(pickle.dumps((sched, kv_ops), protocol=pickle.HIGHEST_PROTOCOL)))
        return exchange(sched, kv_ops)

    executor._exchange = counted
    prompts = [[(31 * i + 7 * j) % 40000 + 100 for j in range(context)] for i in range(batch)]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return int(statistics.median(deltas)), int(statistics.median(wholes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="64", help="comma-separated batch sizes")
    ap.add_argument("--context", default="128,2048", help="comma-separated prompt lengths")
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    contexts = [int(c) for c in args.context.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp, max_positions=max(contexts) + args.output_len + 64)
        print(f"{'batch':>5} {'context':>7} {'delta B/step':>12} {'whole B/step':>12} {'ratio':>6}")
        for batch in (int(b) for b in args.batch.split(",")):
            for context in contexts:
                delta, whole = measure(model, batch, context, args.output_len)
                print(f"{batch:>5} {context:>7} {delta:>12,} {whole:>12,} {whole / delta:>6.1f}")


if __name__ == "__main__":
    main()
