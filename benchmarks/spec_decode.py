"""Speculative decoding: n-gram (prompt lookup) against none, on the embedded model, in one run.

    .venv/bin/python benchmarks/spec_decode.py                    # k=4, lookup n in [2, 4], 64 tokens out
    .venv/bin/python benchmarks/spec_decode.py --batch-sizes 1    # one request at a time only

Two workloads, greedy, through the chat template: "summarize" asks the model to restate a passage,
so its output copies spans of the prompt (n-gram lookup's case); "free" asks for new text, where
lookups hit only where the model repeats itself. Each runs one request at a time (latency-bound, where
speculation pays on a CPU) and in batches of 4 (where verifying k + 1 tokens per request costs more
compute than it saves). Prints output tokens/s without and with speculation side by side, the ratio,
the acceptance rate and the mean accepted length, and checks that both outputs are identical.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import LLM, SamplingParams
from engine.text.tokenizer import apply_chat_template

PASSAGES = [
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin covers seven "
    "million square kilometres, of which five and a half million are covered by the rainforest. The "
    "region includes territory belonging to nine nations, and the majority of the forest is in Brazil.",
    "The Great Wall of China is a series of fortifications that were built across the historical northern "
    "borders of ancient Chinese states to protect against nomadic groups. Several walls were built from "
    "as early as the 7th century BC, and the best known sections were built by the Ming dynasty.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and oxygen. It takes place mainly in the leaves, inside chloroplasts, which contain the "
    "green pigment chlorophyll that absorbs light energy.",
    "The printing press was invented by Johannes Gutenberg around 1440. His movable type system made it "
    "possible to produce books quickly and cheaply, which spread literacy across Europe and helped to "
    "start the Renaissance, the Reformation and the Scientific Revolution.",
]
FREE = [
    "Write a short poem about the sea at night.",
    "Give three tips for learning a new language.",
    "Describe your ideal weekend in a few sentences.",
    "Explain why the sky is blue to a child.",
]


def workloads(tokenizer) -> dict[str, list[list[int]]]:
    summarize = [[{"role": "user", "content": f"Rewrite this passage in your own words, keeping its "
                                              f"key phrases:\n\n{p}"}] for p in PASSAGES]
    free = [[{"role": "user", "content": q}] for q in FREE]
    return {name: [apply_chat_template(tokenizer, conv) for conv in convs]
            for name, convs in (("summarize", summarize), ("free", free))}


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, batch_size: int) -> tuple[float, int, list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = [{"prompt_token_ids": p} for p in prompts[i:i + batch_size]]
        outputs += [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o) for o in outputs), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,4", help="comma-separated")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    spec_config = {"method": "ngram", "num_speculative_tokens": args.k,
                   "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    plain = LLM(dtype=args.dtype)
    spec = LLM(dtype=args.dtype, speculative_config=spec_config)
    loads = workloads(plain.get_tokenizer())
    run(plain, loads["free"][:1], 4, 1)                  # warm-up
    run(spec, loads["free"][:1], 4, 1)
    results = {}
    print(f"n-gram k={args.k} n=[{args.lookup_min},{args.lookup_max}], {args.max_tokens} tokens out, "
          f"dtype {args.dtype}, {len(PASSAGES)} prompts per workload")
    print(f"{'workload':<10} {'batch':>5} {'none tok/s':>11} {'ngram tok/s':>12} {'speedup':>8} {'accept':>7} "
          f"{'mean len':>9} {'same':>5}")
    for batch_size, (name, prompts) in ((int(b), w) for b in args.batch_sizes.split(",") for w in loads.items()):
        t_plain, n_plain, out_plain = run(plain, prompts, args.max_tokens, batch_size)
        before = spec.llm_engine.stats()
        t_spec, n_spec, out_spec = run(spec, prompts, args.max_tokens, batch_size)
        after = spec.llm_engine.stats()
        drafts = after.spec.num_draft_tokens - before.spec.num_draft_tokens
        accepted = after.spec.num_accepted_tokens - before.spec.num_accepted_tokens
        verifications = after.spec.num_drafts - before.spec.num_drafts
        row = {"none_tok_per_s": n_plain / t_plain, "ngram_tok_per_s": n_spec / t_spec,
               "speedup": (n_spec / t_spec) / (n_plain / t_plain),
               "acceptance_rate": accepted / max(drafts, 1),
               "mean_accepted_length": 1 + accepted / max(verifications, 1),
               "draft_tokens": drafts, "accepted_tokens": accepted, "identical": out_plain == out_spec}
        results[f"{name}/batch{batch_size}"] = row
        print(f"{name:<10} {batch_size:>5} {row['none_tok_per_s']:>11.1f} {row['ngram_tok_per_s']:>12.1f} "
              f"{row['speedup']:>7.2f}x {row['acceptance_rate']:>7.2f} {row['mean_accepted_length']:>9.2f} "
              f"{str(row['identical']):>5}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
