"""A tiny mixture of experts' decode step against a dense model of the same active parameters, offline
in this process on the CPU (issue 56's bound: the MoE step at most 1.5x the dense one).

The two models share everything but the MLP: a Mixtral of E experts with k per token and expert
intermediate size I against a Mistral whose MLP has intermediate size k * I (the same weights read
per token at batch 1; at larger batches the MoE reads more experts, as any MoE does). Both random,
with the embedded model's tokenizer and vocabulary. Decode steps only (prompts prefilled untimed),
the two models alternating over rounds; the ratio per batch size is the median round's.

    .venv/bin/python benchmarks/moe.py --batch 1,8,32 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from offline import make_prompts
from step_overhead import write_random_model

from engine import LLM, SamplingParams


def make_models(root: str, hidden: int, layers: int, experts: int, top_k: int, inter: int) -> tuple[str, str]:
    from transformers import AutoTokenizer, MistralConfig, MixtralConfig

    from records.model_source import embedded_model_path

    path = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    common = dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                  num_key_value_heads=max(1, hidden // 128), max_position_embeddings=2048, sliding_window=None,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    configs = {"moe": MixtralConfig(**common, intermediate_size=inter, num_local_experts=experts,
                                    num_experts_per_tok=top_k),
               "dense": MistralConfig(**common, intermediate_size=inter * top_k)}
    out = {name: write_random_model(config, tok, os.path.join(root, name), std=0.05)
           for name, config in configs.items()}
    return out["moe"], out["dense"]


def decode_seconds_per_step(llm: LLM, batch: int, input_len: int, output_len: int, seed: int) -> float:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, input_len, input_len, engine.config.model_config.vocab_size, seed)):
        engine.add_request(f"b{seed}-{batch}-{i}", None, p, params)
    while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()                                  # prefill, untimed
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--inter", type=int, default=1024, help="each expert's intermediate size")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        moe_path, dense_path = make_models(root, args.hidden, args.layers, args.experts, args.top_k, args.inter)
        llms = {name: LLM(path, dtype=args.dtype, max_model_len=512)
                for name, path in (("moe", moe_path), ("dense", dense_path))}
        print(f"hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-{args.top_k} of "
              f"intermediate {args.inter} vs dense {args.inter * args.top_k}; {args.dtype}; "
              f"kernels {llms['moe'].llm_engine.executor.worker.runner.kernels.__name__}")
        for batch in (int(b) for b in args.batch.split(",")):
            times: dict[str, list[float]] = {"moe": [], "dense": []}
            for r in range(args.rounds + 1):           # round 0 warms up
                for name, llm in llms.items():
                    t = decode_seconds_per_step(llm, batch, 16, args.output_len, seed=r)
                    if r:
                        times[name].append(t)
            moe, dense = statistics.median(times["moe"]), statistics.median(times["dense"])
            print(f"batch {batch:3d}: moe {moe * 1e3:7.2f} ms/step, dense {dense * 1e3:7.2f} ms/step, "
                  f"ratio {moe / dense:.2f}x")


if __name__ == "__main__":
    main()
