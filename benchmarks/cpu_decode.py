"""CPU decode through the model's modules against the flat decode plan (engine/worker/cpu_decode.py), in one
process, alternating, on the embedded model (or `--model`).

    .venv/bin/python benchmarks/cpu_decode.py [--quantization gguf] [--dtype float32] \\
        [--batch 1,4,16] [--tokens 64] [--rounds 2] [--threads 2] [--quantize-activations]

Every request decodes `--tokens` greedy tokens (`ignore_eos`) after a 5-token prompt, all of a batch
submitted at once; tok/s is the batch's output tokens over its wall time. Each round runs every
batch size once with the modules (the runner's plan set aside) and once with the plan; each figure
is its best round, and the greedy tokens of the two must agree. Nothing else is asserted.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = [1, 504, 3458, 282, 4055]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model directory or GGUF file (default: the embedded model)")
    parser.add_argument("--quantization", default="gguf", help="as LLM(quantization=...); 'auto': its default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", default="1,4,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantize-activations", action="store_true",
                        help="GGUF blocks times int8 activations (LLM(quantize_activations=True))")
    args = parser.parse_args()

    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(args.model, dtype=args.dtype, quantization=None if args.quantization == "auto" else args.quantization,
              max_model_len=1024, max_num_seqs=max(batches), quantize_activations=args.quantize_activations)
    runner = llm.llm_engine.executor.worker.runner
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def run(batch: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * batch, params, use_tqdm=False)
        return batch * args.tokens / (time.perf_counter() - start), [o.outputs[0].token_ids for o in outs]

    run(1)                                     # builds the plan (at the first decode step) and warms up
    plan = runner.decode_plan
    if not plan:
        sys.exit("no decode plan for this model and machine (engine/worker/cpu_decode.py: CpuDecodePlan.build)")
    print(f"quantization={llm.llm_engine.config.model_config.quantization} dtype={args.dtype} "
          f"quantize_activations={args.quantize_activations} "
          f"threads={args.threads} tokens={args.tokens}")
    print(f"{'batch':>5} {'modules tok/s':>14} {'plan tok/s':>11} {'plan / modules':>15}")
    for batch in batches:
        best = {False: 0.0, True: 0.0}
        tokens = {}
        for _ in range(args.rounds):
            for use_plan in (False, True):
                runner.decode_plan = plan if use_plan else None
                tok_s, tokens[use_plan] = run(batch)
                best[use_plan] = max(best[use_plan], tok_s)
        if tokens[False] != tokens[True]:
            sys.exit(f"batch {batch}: the plan's greedy tokens differ from the modules'")
        print(f"{batch:>5} {best[False]:>14.1f} {best[True]:>11.1f} {best[True] / best[False]:>15.2f}")
    runner.decode_plan = plan


if __name__ == "__main__":
    main()
