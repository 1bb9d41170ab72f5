"""Multi-LoRA decode throughput on the embedded model: one batch of `--batch` requests under 1, 4 or
16 distinct adapters (round-robin over the batch), against the same batch on the base model, side
by side in one run.

    .venv/bin/python benchmarks/lora.py [--batch 32] [--adapters 1,4,16] [--rank 16] \\
        [--targets all|attention|qv] [--tokens 64] [--rounds 3] [--json out.json]

The adapters are random PEFT directories of rank `--rank` on `--targets` (written here with the
model's shapes: no base checkpoint is needed). Two engines live in this process: the base model
without LoRA enabled (the baseline), and one with `enable_lora`, `max_loras` = the most adapters
asked for; that engine's base-only batch is reported too (what enabling LoRA costs requests that
use none). Every request has a 16-token prompt of its own and decodes `--tokens` greedy tokens
(`ignore_eos`); tok/s is the batch's output tokens over its wall time. Each round runs every case
once, in turn; each figure is its best round. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGETS = {"all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "attention": ["q_proj", "k_proj", "v_proj", "o_proj"], "qv": ["q_proj", "v_proj"]}


def write_adapter(path: str, hf_config, rank: int, targets: list[str], seed: int) -> str:
    """A random PEFT LoRA adapter directory for a model of `hf_config`."""
    import torch
    from safetensors.torch import save_file

    from records.lora import module_shapes

    shapes = module_shapes(hf_config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module in targets:
            block = "self_attn" if module in TARGETS["attention"] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
                   "bias": "none"}, f)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", default="1,4,16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=sorted(TARGETS), default="all")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from engine import LLM, SamplingParams
    from records.lora import LoRARequest

    torch.set_num_threads(args.threads)
    counts = [int(n) for n in args.adapters.split(",")]
    common = dict(dtype=args.dtype, max_model_len=512, max_num_seqs=args.batch)
    base = LLM(None, **common)
    lora = LLM(None, **common, enable_lora=True, max_loras=max(counts), max_lora_rank=args.rank)
    hf_config = lora.llm_engine.config.model_config.hf_config
    tmp = tempfile.mkdtemp(prefix="pdserve-lora-bench-")
    paths = [write_adapter(os.path.join(tmp, f"a{i}"), hf_config, args.rank, TARGETS[args.targets], seed=i)
             for i in range(max(counts))]
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    prompts = [{"prompt_token_ids": [1 + (i * 37 + j * 11) % 40000 for j in range(16)]} for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    cases = {"base model": (base, None), "LoRA enabled, no adapter": (lora, None)}
    for n in counts:
        cases[f"{n} adapter{'s' if n > 1 else ''}"] = (lora, [requests[i % n] for i in range(args.batch)])
    for llm, loras in cases.values():          # warm-up: kernels built, adapters read into host memory
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, lora_request=loras)
    best = {name: 0.0 for name in cases}
    for _ in range(args.rounds):
        for name, (llm, loras) in cases.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            elapsed = time.perf_counter() - start
            best[name] = max(best[name], sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    print(f"batch {args.batch}, rank {args.rank} on {args.targets} ({', '.join(TARGETS[args.targets])}), "
          f"{args.tokens} tokens each, dtype {lora.llm_engine.config.model_config.dtype}, "
          f"quantization {lora.llm_engine.config.model_config.quantization}, best of {args.rounds}")
    print(f"{'case':28s} {'tok/s':>8s} {'x base':>7s}")
    for name, tok_s in best.items():
        print(f"{name:28s} {tok_s:8.1f} {tok_s / best['base model']:7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tok_s": best}, f, indent=1)


if __name__ == "__main__":
    main()
