"""Per decode step, where the time goes outside the model's forward: schedule, prepare (inputs and
attention metadata), forward, logits, sample, update (scheduler bookkeeping), outputs
(detokenization, stop strings, output records) and the rest (the executor's step message, the
engine's own loop), offline in this process, at several batch sizes, on the embedded model and on
a tiny overhead-bound one (2 layers, hidden 256, the embedded model's 49k vocabulary).

    .venv/bin/python benchmarks/step_overhead.py --model embedded --batch 1,64,256
    .venv/bin/python benchmarks/step_overhead.py --model tiny --batch 1,64,256

Only decode steps are timed: every request's prompt is prefilled first (untimed), then the steps in
which all scheduled requests decode one token are. Greedy unless `--temperature` (with `--top-p`,
`--top-k`) says otherwise; `--repetition-penalty`, `--frequency-penalty`, `--presence-penalty` add
penalties. "non-forward" is the step minus forward and
logits (issue 24's target: <= 10% at batch 64 on the embedded model).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # after the repo: benchmarks/kernels.py

from offline import make_prompts

import engine.worker.model_runner as model_runner
from engine import LLM, SamplingParams
from engine.worker.cpu_decode import CpuDecodePlan

PARTS = ["schedule", "prepare", "forward", "logits", "sample", "update", "outputs"]


def make_tiny_model(out: str, hidden: int = 256, layers: int = 2, heads: int | None = None,
                    kv_heads: int | None = None, intermediate: int | None = None, tied: bool = True,
                    max_positions: int = 2048) -> str:
    """A random Llama of `layers` x `hidden` (head_dim 64 unless `heads` says otherwise) with the
    embedded model's tokenizer and vocabulary, weights drawn as the tests draw them (peaked logits)."""
    from transformers import AutoTokenizer, LlamaConfig

    from records.model_source import embedded_model_path

    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    heads = heads or hidden // 64
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate or hidden * 4,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads or max(1, heads // 2), max_position_embeddings=max_positions,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=tied)
    return write_random_model(config, tok, out)


def write_random_model(config: Any, tok: Any, out: str, std: float = 0.15) -> str:
    """A transformers model of `config` with random fp32 matrices of this std (as the tests draw
    them) and `tok`, saved at `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


class StepTimer:
    """Wraps the step's parts with timers that count only while `on` is set."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.llm_engine
        runner = engine.executor.worker.runner
        self.totals: dict[str, float] = defaultdict(float)
        self.on = False
        self._undo: list[Callable[[], None]] = []
        self._wrap("schedule", engine.scheduler, "schedule")
        self._wrap("prepare", runner, "_prepare")
        self._wrap("forward", runner.model, "forward")
        self._wrap("forward", CpuDecodePlan, "run")             # the CPU decode plan's flat forward
        self._wrap("logits", runner.model, "compute_logits")
        self._wrap("sample", model_runner, "sample")
        self._wrap("sample", model_runner, "greedy_ids")         # rows that only take their argmax
        self._wrap("update", engine.scheduler, "update_from_output")
        self._wrap("outputs", engine.output, "process_tokens")
        self._wrap("outputs", engine.output, "make_output")

    def _wrap(self, name: str, obj: Any, attr: str) -> None:
        original = getattr(obj, attr)
        had_own = attr in getattr(obj, "__dict__", {})

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - start

        setattr(obj, attr, wrapper)
        self._undo.append(lambda: setattr(obj, attr, original) if had_own else delattr(obj, attr))

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()


def run(llm: LLM, timer: StepTimer, batch: int, input_len: int, output_len: int, seed: int,
        sampling: dict[str, Any] | None = None) -> dict[str, float]:
    engine = llm.llm_engine
    vocab = engine.config.model_config.vocab_size
    # Deltas, as the serving path asks for them (the offline LLM asks for final outputs only).
    params = SamplingParams(**{"temperature": 0, **(sampling or {})}, max_tokens=output_len, ignore_eos=True,
                            output_kind="delta")
    for i, p in enumerate(make_prompts(batch, input_len, input_len, vocab, seed)):
        engine.add_request(f"s{seed}-{batch}-{i}", None, p, params)
    while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()                                  # prefill, untimed
    timer.totals.clear()
    timer.on = True
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    totals = dict(timer.totals)
    totals["step"] = time.perf_counter() - start
    timer.on = False
    totals["steps"] = steps
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded", help="'embedded', 'tiny' or a path")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", default="1,64,256")
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--max-model-len", type=int, default=512)
    args = ap.parse_args()
    model = {"embedded": None}.get(args.model, args.model)
    if args.model == "tiny":
        model = make_tiny_model(tempfile.mkdtemp(prefix="pdserve-tiny256-"))
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(model, dtype=args.dtype, max_num_seqs=max(batches), max_model_len=args.max_model_len)
    timer = StepTimer(llm)
    run(llm, timer, 4, args.input_len, 8, seed=999)                # warm-up
    print(f"{'batch':>5} {'round':>5} {'step ms':>8} " + " ".join(f"{n:>9}" for n in PARTS)
          + f" {'other':>8} {'non-forward':>11} {'tok/s':>8}")
    for batch in batches:
        for r in range(args.rounds):
            t = run(llm, timer, batch, args.input_len, args.output_len, seed=r,
                    sampling={"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                              "repetition_penalty": args.repetition_penalty,
                              "frequency_penalty": args.frequency_penalty,
                              "presence_penalty": args.presence_penalty})
            step = t["step"]
            share = {n: t.get(n, 0.0) / step for n in PARTS}
            other = 1 - sum(share.values())
            non_forward = 1 - share["forward"] - share["logits"]
            print(f"{batch:>5} {r:>5} {step / t['steps'] * 1e3:>8.2f} "
                  + " ".join(f"{share[n]:>9.1%}" for n in PARTS)
                  + f" {other:>8.1%} {non_forward:>11.1%} {batch * t['steps'] / step:>8.0f}")
    timer.close()


if __name__ == "__main__":
    main()
