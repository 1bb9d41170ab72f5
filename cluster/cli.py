"""The `pdserve` command line.

    pdserve serve [--config spec.yaml] [--model PATH] [--port 8000] [--replicas N]   # OpenAI API on Ray
    pdserve generate "prompt" [--model PATH] [--max-tokens N] [--temperature T]      # offline, in-process
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline with one engine in this process")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None,
                     help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    srv = sub.add_parser("serve", help="serve the model behind an OpenAI-compatible API on Ray Serve")
    from cluster.launch import add_serve_args, run_serve  # noqa: PLC0415

    add_serve_args(srv)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return run_serve(args)

    from engine.llm import LLM  # noqa: PLC0415 (slow import after argument errors)
    from records.sampling_params import SamplingParams  # noqa: PLC0415

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    print(out[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
