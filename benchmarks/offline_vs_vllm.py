"""Offline throughput, pdserve's engine against vLLM's CPU build, on the same model and prompts:
each run in its own process (the two cannot share one), alternating, best of N each.

    .venv/bin/python benchmarks/offline_vs_vllm.py --vllm-python /path/vllm-venv/bin/python \\
        --model tiny --num-prompts 256 --input-len 16 --output-len 64 --runs 3

`--model tiny` builds benchmarks/step_overhead.py's overhead-bound model (2 layers, hidden 256, the
embedded model's 49k vocabulary); both engines load it in `--dtype`. vLLM runs with its CPU
settings (`VLLM_CPU_KVCACHE_SPACE`, `VLLM_CPU_OMP_THREADS_BIND`, and the tcmalloc / Intel OpenMP
preloads its docs ask for, where found: docs/perf/journal.md §1). Model load and warm-up are not
timed; every request decodes `--output-len` greedy tokens (`ignore_eos`), all submitted at once.
`--pdserve-env KEY=VALUE[,KEY=VALUE]` (repeatable) adds a pdserve run under those environment
variables to each round, so that an A/B of a switch shares the rounds (and vLLM) with the default:

    ... --pdserve-env PDSERVE_CPU_OWN_GEMM=0
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRELOADS = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "{venv}/lib/libiomp5.so"]


def prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(num)]


def max_len(args: argparse.Namespace) -> int:
    """Both engines' max_model_len: room for the prompt and its output (at least 512)."""
    return max(512, args.input_len + args.output_len)


def worker(args: argparse.Namespace) -> None:
    """One engine, one process: load, warm up, time one generate over every prompt."""
    # This script's folder holds a kernels.py that would shadow the packages named `kernels`.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    batch = prompts(args.num_prompts, args.input_len, vocab, args.seed)
    warm = prompts(4, args.input_len, vocab, args.seed + 1)
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.num_prompts, max_model_len=max_len(args),
                  max_num_batched_tokens=args.max_num_batched_tokens, seed=0)
    else:
        sys.path.insert(0, str(HERE.parent))
        from engine import LLM, SamplingParams
        llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.num_prompts, max_model_len=max_len(args),
                  max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"engine": args.engine, "tok_s": tokens / wall, "wall_s": wall,
                                  "first": list(outs[0].outputs[0].token_ids[:8]),
                                  "preload": os.environ.get("LD_PRELOAD", "")}), flush=True)


def run_one(engine: str, python: str, args: argparse.Namespace, model: str, extra_env: dict[str, str]) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--engine", engine, "--model", model, "--dtype", args.dtype,
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--seed", str(args.seed),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    env = dict(os.environ, **extra_env)
    if engine == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
                   LD_PRELOAD=":".join(vllm_preloads(python)))
    return run_worker(cmd, env, engine)


def vllm_preloads(python: str) -> list[str]:
    """The libraries vLLM's CPU docs ask to preload (tcmalloc, Intel OpenMP) that exist, for the vLLM
    venv whose python this is."""
    venv = str(Path(python).parent.parent)     # not resolved: a venv's python links outside it
    return [p.format(venv=venv) for p in PRELOADS if Path(p.format(venv=venv)).exists()]


def vllm_op_env(python: str, threads: int) -> dict[str, str]:
    """The environment vLLM's engine gives a CPU worker bound to cores 0..threads-1, for a process
    that calls vLLM's ops without its engine: the preloads, and with Intel OpenMP what
    vllm/utils/ompmultiprocessing.py's configure_omp_envs sets for that binding."""
    preload = vllm_preloads(python)
    env = {"LD_PRELOAD": ":".join(preload), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    if any("libiomp" in p for p in preload):
        cpus = ",".join(str(i) for i in range(threads))
        env.update(KMP_AFFINITY=f"granularity=fine,explicit,proclist=[{cpus}]", KMP_BLOCKTIME="5", KMP_TPAUSE="0")
    return env


def run_worker(cmd: list[str], env: dict[str, str], label: str, cwd: Path | None = None) -> dict:
    """Run one worker process to its end: the JSON of its `RESULT ` line, or exit with its output."""
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=cwd)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{label} run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["pdserve", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--vllm-python", default=None, help="the python of vLLM's venv")
    ap.add_argument("--model", default="tiny", help="'tiny' or a model directory both engines load")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="both engines' token budget per step (vLLM's LLM defaults to 4,096 on CPU, its server "
                         "and pdserve to 2,048)")
    ap.add_argument("--pdserve-env", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="also run pdserve under these environment variables, each round (repeatable)")
    args = ap.parse_args()
    if args.engine:
        worker(args)
        return
    if not args.vllm_python:
        ap.error("--vllm-python is required")
    model = args.model
    if model == "tiny":
        sys.path.insert(0, str(HERE.parent))
        sys.path.append(str(HERE))
        from step_overhead import make_tiny_model
        model = make_tiny_model(tempfile.mkdtemp(prefix="pdserve-tiny256-"))
    runs = [("pdserve", "pdserve", sys.executable, {})]
    for spec in args.pdserve_env:
        pairs = [kv.split("=", 1) for kv in spec.split(",")]
        if any(len(kv) != 2 or not kv[0] for kv in pairs):
            ap.error(f"--pdserve-env takes KEY=VALUE[,KEY=VALUE]; got {spec!r}")
        runs.append((f"pdserve[{spec}]", "pdserve", sys.executable, dict(pairs)))
    runs.append(("vllm", "vllm", args.vllm_python, {}))
    results: dict[str, list[float]] = {label: [] for label, *_ in runs}
    for r in range(args.runs):
        for label, engine, python, extra_env in runs:
            res = run_one(engine, python, args, model, extra_env)
            results[label].append(res["tok_s"])
            print(f"run {r + 1} {label:8s} {res['tok_s']:9.1f} tok/s ({res['wall_s']:.2f} s) "
                  f"first tokens {res['first']}"
                  + (f" LD_PRELOAD={res['preload']}" if res["preload"] else ""), flush=True)
    best = {label: max(v) for label, v in results.items()}
    for label, *_ in runs[:-1]:
        print(f"best of {args.runs}: {label} {best[label]:.1f}, vLLM {best['vllm']:.1f} tok/s; "
              f"{label} / vLLM {best[label] / best['vllm']:.2f}; per run "
              + ", ".join(f"{a / b:.2f}" for a, b in zip(results[label], results["vllm"])))

if __name__ == "__main__":
    main()
