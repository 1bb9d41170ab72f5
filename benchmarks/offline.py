"""Offline throughput: pdserve against HF `generate` (static padded batches), same model and prompts,
in one run; plus KV memory waste against a static max-length allocation.

    .venv/bin/python benchmarks/offline.py                       # 64 prompts of 32-512 tokens, 128 out
    .venv/bin/python benchmarks/offline.py --num-prompts 16 --min-len 32 --max-len 32   # vLLM anchor shape

Prints output tokens/s for both and the ratio; --rounds N alternates the two N times and compares
each side's best round (for shared, noisy machines); --json writes the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from engine import LLM, SamplingParams


def make_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(100, vocab, (n,), generator=g).tolist() for n in lens]


def bench_pdserve(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", None, p, params)
    bs = engine.config.cache_config.block_size
    allocated = used = 0
    steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for r in engine.scheduler.running:           # KV slots held vs tokens actually stored
            allocated += len(engine.kv_cache_manager.block_ids(r.request_id)) * bs
            used += r.num_computed_tokens
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": len(prompts) * max_tokens, "steps": steps,
            "tok_per_s": len(prompts) * max_tokens / elapsed,
            "kv_waste_paged": 1 - used / max(allocated, 1)}


def bench_hf(model, prompts: list[list[int]], max_tokens: int, batch_size: int, pad_id: int) -> dict:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])      # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tok_per_s": len(prompts) * max_tokens / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="alternate pdserve and HF this many times")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=2048)
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab, args.seed)
    bench_pdserve(llm, make_prompts(4, 16, 32, vocab, 1), 4)                      # warm-up
    static_slots = len(prompts) * (max(len(p) for p in prompts) + args.max_tokens)
    needed = sum(len(p) + args.max_tokens for p in prompts)
    result: dict = {"workload": vars(args), "torch_threads": torch.get_num_threads(),
                    "kv_waste_static": 1 - needed / static_slots, "rounds": []}
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        mc = llm.llm_engine.config.model_config
        hf = AutoModelForCausalLM.from_pretrained(mc.model, gguf_file=mc.gguf_file, dtype=mc.torch_dtype).eval()
        hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, pad_token_id=0)            # warm-up
    # Rounds alternate the two, so a slow spell of a shared machine falls on both; the summary takes
    # each side's best round.
    for r in range(args.rounds):
        llm.llm_engine.reset_prefix_cache()              # every round prefills from scratch
        ours = bench_pdserve(llm, prompts, args.max_tokens)
        line = (f"round {r + 1}: pdserve {ours['tok_per_s']:.1f} tok/s ({ours['seconds']:.1f} s, "
                f"{ours['steps']} steps, KV waste {ours['kv_waste_paged']:.1%})")
        entry = {"pdserve": ours}
        if hf is not None:
            theirs = bench_hf(hf, prompts, args.max_tokens, args.hf_batch_size, pad_id=0)
            entry.update(hf=theirs, ratio=ours["tok_per_s"] / theirs["tok_per_s"])
            line += f"; HF generate {theirs['tok_per_s']:.1f} tok/s ({theirs['seconds']:.1f} s); {entry['ratio']:.2f}x"
        result["rounds"].append(entry)
        print(line, flush=True)
    best = max((e["pdserve"] for e in result["rounds"]), key=lambda o: o["tok_per_s"])
    result["pdserve"] = best
    print(f"pdserve: {best['tok_per_s']:.1f} output tok/s (best of {args.rounds}); KV waste "
          f"{best['kv_waste_paged']:.1%} vs static max-length {result['kv_waste_static']:.1%}")
    if hf is not None:
        theirs = max((e["hf"] for e in result["rounds"]), key=lambda o: o["tok_per_s"])
        result["hf"] = theirs
        result["ratio"] = best["tok_per_s"] / theirs["tok_per_s"]
        ratios = sorted(e["ratio"] for e in result["rounds"])
        print(f"HF generate (batch {args.hf_batch_size}, padded): {theirs['tok_per_s']:.1f} output tok/s "
              f"(best of {args.rounds})")
        print(f"ratio pdserve / HF: {result['ratio']:.2f}x (best against best; per round "
              f"{', '.join(f'{x:.2f}' for x in ratios)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
