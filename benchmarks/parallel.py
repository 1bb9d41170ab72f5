"""Ray executor overhead and the pipeline bubble.

1. Per-step overhead of the Ray executor: the same engine (one rank) driven in-process and through
   one Ray worker actor (`distributed_executor_backend="ray"`), timing decode steps of a batch on a
   tiny random model (where the model's own time is small, so the difference is the executor's:
   pickling the SchedulerOutput, the round trip over the worker's StepChannel connection, the
   result).
2. Pipeline bubble: output tokens/s of the embedded model with pipeline_parallel_size=2 against 1,
   same workload, one CPU per rank: PP=2 stepping one batch at a time (stage 0, then stage 1: the
   bubble), with two micro-batches per step (stage 1 runs micro-batch 1 while stage 0 runs
   micro-batch 2), and with two batches of disjoint requests in the stages at once
   (max_concurrent_batches=2: stage 0 runs the next step's batch while stage 1 finishes this one).

Run: .venv/bin/python benchmarks/parallel.py [--steps 50] [--skip-pp]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import torch

from engine.llm_engine import LLMEngine
from records.config_resolution import engine_config
from records.sampling_params import SamplingParams


def tiny_model(path: str) -> str:
    """A 2-layer random Llama with the embedded model's tokenizer, saved under `path`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from records.model_source import embedded_model_path

    gguf = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def decode_step_ms(engine: LLMEngine, batch: int, steps: int) -> list[float]:
    """Milliseconds per engine step once `batch` requests are all decoding."""
    params = SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", None, [5 + i, 17, 23, 99], params)
    engine.step()                                   # the prefills
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    engine.abort_request([f"r{i}" for i in range(batch)])
    engine.step()
    return times


def executor_overhead(steps: int, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = tiny_model(d)
        args = dict(dtype="float32", max_model_len=512, num_kv_blocks=256)
        local = LLMEngine(engine_config(path, **args))
        # The worker gets as many torch threads as this process has, so only the executor differs.
        remote = LLMEngine(engine_config(path, distributed_executor_backend="ray",
                                               worker_num_cpus=torch.get_num_threads(), **args))
        # Interleave the two so machine noise hits both alike.
        runs = {"in_process": [], "ray": []}
        for _ in range(3):
            runs["in_process"] += decode_step_ms(local, batch, steps)
            runs["ray"] += decode_step_ms(remote, batch, steps)
        remote.executor.shutdown()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"batch": batch, "in_process_ms": med["in_process"], "ray_ms": med["ray"],
            "overhead_ms": med["ray"] - med["in_process"]}


PP_VARIANTS = (          # name, pp, micro-batches per step, batches in the stages at once
    ("pp1", 1, 1, 1),
    ("pp2_sync", 2, 1, 1),
    ("pp2_micro", 2, 2, 1),
    ("pp2_overlap", 2, 1, 2),
)


def pp_throughput(num_prompts: int, max_tokens: int) -> dict:
    """Output tokens/s of the embedded model for each of PP_VARIANTS on the same prompts."""
    prompts = [[(i * 31 + j * 7) % 30000 + 5 for j in range(64 + 16 * (i % 8))] for i in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    for name, pp, micro, concurrent in PP_VARIANTS:
        engine = LLMEngine(engine_config(None, dtype="bfloat16", max_model_len=1024, pipeline_parallel_size=pp,
                                               distributed_executor_backend="ray", worker_num_cpus=1,
                                               pipeline_micro_batches=micro, max_concurrent_batches=concurrent))
        for i, ids in enumerate(prompts):
            engine.add_request(f"p{i}", None, ids, params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        elapsed = time.perf_counter() - start
        out[f"{name}_tok_s"] = num_prompts * max_tokens / elapsed
        engine.executor.shutdown()
    for name, *_ in PP_VARIANTS[1:]:
        out[f"ratio_{name}_over_pp1"] = out[f"{name}_tok_s"] / out["pp1_tok_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip-pp", action="store_true")
    args = ap.parse_args()
    from cluster.launch import init_ray

    init_ray(num_cpus=4)
    result = {"executor": executor_overhead(args.steps, args.batch)}
    e = result["executor"]
    print(f"decode step, tiny model, batch {e['batch']}: in-process {e['in_process_ms']:.2f} ms, "
          f"Ray executor {e['ray_ms']:.2f} ms, overhead {e['overhead_ms']:.2f} ms")
    if not args.skip_pp:
        result["pp"] = pp_throughput(args.num_prompts, args.max_tokens)
        p = result["pp"]
        print(f"embedded model, {args.num_prompts} prompts x {args.max_tokens} tokens, bf16, 1 CPU per rank: "
              f"PP=1 {p['pp1_tok_s']:.1f} tok/s; " + "; ".join(
                  f"{name} {p[name + '_tok_s']:.1f} tok/s ({p['ratio_' + name + '_over_pp1']:.2f}x)"
                  for name, *_ in PP_VARIANTS[1:]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
