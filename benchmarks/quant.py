"""Decode throughput of the embedded GGUF model: its weights dequantized to bf16 (`quantization="none"`),
kept in their GGUF blocks only (`"gguf"`), in blocks plus a dense copy for large batches
(`"gguf+dense"`), the same with int8 activations (`quantize_activations=True`: llama.cpp's
arithmetic), and dequantized with an fp8 KV cache (`kv_cache_dtype="fp8"`), at several batch
sizes, and llama.cpp's single-stream decode of the same file on the same threads, side by side in
one run. (fp8's quality: benchmarks/quality.py.)

    .venv/bin/python benchmarks/quant.py [--batch 1,16,64] [--tokens 128] [--rounds 3] \\
        [--llama-python /path/with/llama_cpp/bin/python] [--json out.json]

Every request decodes `--tokens` greedy tokens (`ignore_eos`) after a 5-token prompt, all of a
batch submitted at once; tok/s is the batch's output tokens over its wall time, prompt included.
The five pdserve engines live in this process; llama.cpp (llama-cpp-python, which compiles
llama.cpp on install: not a pdserve dependency) runs in a process of its own each round, with
`n_threads` = `--threads`, the same prompt and token count. Each round runs llama.cpp, then every
batch size on every engine; each figure is its best round. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = [1, 504, 3458, 282, 4055]

LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
path, prompt = sys.argv[1], json.loads(sys.argv[5])
tokens, threads, rounds = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
best = 0.0
for _ in range(rounds):
    llm.reset()
    start, n = time.perf_counter(), 0
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        n += 1
        if n == tokens:
            break
    best = max(best, n / (time.perf_counter() - start))
print("RESULT", json.dumps({"tok_s": best}))
"""


def run_all(args: argparse.Namespace) -> tuple[dict[str, dict[int, float]], float | None]:
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    engines = {name: LLM(None, dtype=args.dtype, quantization=q, kv_cache_dtype=kv, max_model_len=1024,
                         max_num_seqs=max(batches), quantize_activations=act)
               for name, q, kv, act in (("dense weights", "none", "auto", False),
                                        ("GGUF blocks", "gguf", "auto", False),
                                        ("blocks+dense", "gguf+dense", "auto", False),
                                        ("blocks, int8 act", "gguf+dense", "auto", True),
                                        ("fp8 KV cache", "none", "fp8", False))}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    best: dict[str, dict[int, float]] = {name: {} for name in engines}
    llama = None
    for llm in engines.values():                     # warm-up
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=4), use_tqdm=False)
    for _ in range(args.rounds):
        one = llama_cpp_run(args)
        llama = None if one is None else max(llama or 0.0, one)
        for batch in batches:
            prompts = [{"prompt_token_ids": PROMPT[:-1] + [PROMPT[-1] + i]} for i in range(batch)]
            for name, llm in engines.items():
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                tok_s = batch * args.tokens / (time.perf_counter() - start)
                best[name][batch] = max(best[name].get(batch, 0.0), tok_s)
    return best, llama


def llama_cpp_run(args: argparse.Namespace) -> float | None:
    """llama.cpp's best of two single-stream runs in a fresh process (None without --llama-python)."""
    if args.llama_python is None:
        return None
    from records.model_source import embedded_model_path

    out = subprocess.run([args.llama_python, "-c", LLAMA_CPP, embedded_model_path(), str(args.tokens),
                          str(args.threads), "2", json.dumps(PROMPT)],
                         capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["tok_s"]
    raise RuntimeError(f"llama.cpp run failed: {out.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--llama-python", default=None, help="a python that imports llama_cpp")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    best, llama = run_all(args)
    print(f"{'engine':<16}" + "".join(f"{'batch ' + str(b):>12}" for b in best["dense weights"]))
    for name, row in best.items():
        print(f"{name:<16}" + "".join(f"{v:>12.1f}" for v in row.values()))
    if llama is not None:
        print(f"{'llama.cpp':<16}{llama:>12.1f}   (single stream, same GGUF file, {args.threads} threads)")
    dense = best["dense weights"]
    for name in ("GGUF blocks", "blocks+dense", "blocks, int8 act", "fp8 KV cache"):
        row = best[name]
        print(f"{name} / dense: " + ", ".join(f"batch {b}: {row[b] / dense[b]:.2f}" for b in row)
              + (f"; batch {min(row)} / llama.cpp: {row[min(row)] / llama:.2f}" if llama else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pdserve": best, "llama_cpp_single_stream": llama, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
