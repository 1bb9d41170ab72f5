"""The `pdserve` command line.

    pdserve serve [--config spec.yaml] [--model PATH] [--port 8000] [--replicas N]   # OpenAI API on Ray
    pdserve generate "prompt" [--model PATH] [--max-tokens N] [--temperature T]      # offline, in-process
    pdserve scale POOL N [--drain-timeout S] [--address ADDR] [--name NAME]         # resize a running pool
    pdserve status [--json] [--address ADDR] [--name NAME]                          # pools and replicas
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
    scale = sub.add_parser("scale", help="resize a pool of a running deployment (replicas removed are drained)")
    scale.add_argument("pool", help="prefill or decode")
    scale.add_argument("replicas", type=int)
    scale.add_argument("--drain-timeout", type=float, default=60.0,
                       help="seconds a removed replica may finish its requests before its streams migrate")
    status = sub.add_parser("status", help="the pools of a running deployment")
    status.add_argument("--json", action="store_true")
    for p in (scale, status):
        p.add_argument("--address", default="auto", help="the Ray cluster (default: the local one)")
        p.add_argument("--name", default="pdserve", help="the deployment's spec name (default: pdserve)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command in ("scale", "status"):
        return control(args)

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


def control(args: argparse.Namespace) -> int:
    """`pdserve scale` and `pdserve status`: ask the deployment's manager actor."""
    import json  # noqa: PLC0415

    import ray  # noqa: PLC0415

    from cluster.manager import MANAGER_NAME  # noqa: PLC0415
    from engine.executor.ray_cluster import connect_ray  # noqa: PLC0415

    try:
        connect_ray(args.address)
    except ConnectionError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    try:
        manager = ray.get_actor(MANAGER_NAME, namespace=args.name)
    except ValueError:
        print(f"pdserve: error: no deployment named {args.name!r} on this Ray cluster (--name)", file=sys.stderr)
        return 2
    try:
        if args.command == "scale":
            out = ray.get(manager.scale.remote(args.pool, args.replicas, args.drain_timeout), timeout=120)
        else:
            out = ray.get(manager.pool_status.remote(), timeout=60)
    except (ValueError, ray.exceptions.RayTaskError) as e:
        cause = getattr(e, "cause", None) or e
        print(f"pdserve: error: {cause}", file=sys.stderr)
        return 2
    if args.command == "status" and not args.json:
        for pool, st in out.items():
            print(f"{pool}: {len(st['replicas'])}/{st['target']} serving {' '.join(st['replicas'])}"
                  + (f"; starting {' '.join(st['starting'])}" if st["starting"] else "")
                  + (f"; draining {' '.join(st['draining'])}" if st["draining"] else "")
                  + f"; replaced {st['replaced']}")
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
