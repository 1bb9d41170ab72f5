"""Prefill attention per layer, pdserve's C++ kernel against vLLM's CPU attention op, on the same
prompts: causal, one whole prompt per call, bf16 (or fp32 with --dtype float32, what both serve on a
CPU without AVX512-BF16), each side reading its own paged cache. The two cannot be imported into one
process, so each round spawns one worker per side (alternating), and the parent prints both times,
their ratio, each side's GFLOP/s and its share of a measured roofline.

    .venv/bin/python benchmarks/prefill_attention_vs_vllm.py [--vllm-python /work/vllm-venv/bin/python] \\
        [--lens 1024,4096,16384] [--shapes smollm2-135m,llama3-8b] [--rounds 2] [--threads 2] [--json out.json] \\
        [--dtype bfloat16|float32]

Shapes: SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64) and Llama-3-8B (32/8/128), scale
head_dim**-0.5. Both workers build the same q/k/v (fp32 from a seeded torch.Generator, cast to bf16)
and lay K/V out as their engine does, blocks in a random order (a free queue hands them out so).
A whole prompt is one call, as asked of a prefill here (both engines would split a prompt longer than
their token budget per step into chunks; this times the attention of the whole prompt at once):

- pdserve: `kernels.cpu_ops.prefill_attention` over a [2, blocks, 16, kv_heads, head_dim] cache (the
  engine's 16-token blocks), with the block tables packed once (the engine packs them once per step,
  for every layer). On a CPU with AMX that function sends segments of 128+ rows to SDPA, else to the
  C++ flash kernel; either way it is what the engine runs.
- vLLM: exactly the per-layer call of vllm/v1/attention/backends/cpu_attn.py's
  `CPUAttentionBackendImpl.forward`, `torch.ops._C.cpu_attention_with_kv_cache` (through
  `vllm._custom_ops`), on the cache that backend allocates ([blocks, kv_heads, 128, 2 * head_dim],
  128 being vLLM's CPU default block size (--vllm-block-size), viewed as separate K and V halves), filled by its own
  `cpu_attn_reshape_and_cache` (the layout depends on the ISA, `_get_attn_isa`: amx / vec / ...),
  with the metadata `CPUAttentionMetadataBuilder.build` makes for one prefill sequence (int32
  query_start_loc [0, L], seq_lens [L], block table [1, blocks]) and its scheduler metadata
  (`get_scheduler_metadata`, `VLLM_CPU_ATTN_SPLIT_KV` as vLLM reads it). The builder runs once per
  step and its result is shared by every layer, so that build is not in the per-layer time; it is
  reported once per size (`vllm_metadata_ms`, per step).
Not timed on either side: the K/V write into the cache (`write_kv` / `cpu_attn_reshape_and_cache`,
a separate per-layer op on both) and the QKV/output projections.

Each worker sets torch.set_num_threads(--threads) and OMP_NUM_THREADS; vLLM's gets the settings its
engine gives a CPU worker with `VLLM_CPU_OMP_THREADS_BIND=0-{threads-1}` (the tcmalloc / Intel
OpenMP preloads where found, and with Intel OpenMP its KMP_AFFINITY / KMP_BLOCKTIME / KMP_TPAUSE).
Per size: a warm-up call (and a second one that sizes N, unless the first took --seconds already),
then the mean of N calls, N chosen so a measurement takes about --seconds (at least one call); each
side keeps its best mean over --rounds rounds.

GFLOP/s counts causal attention's multiply-adds, two per (query, key) pair per head per head_dim
element (the score and the weighted value): 4 * heads * head_dim * L*L/2 FLOPs. The roofline is
practical, not a datasheet figure: the rate oneDNN's bf16 GEMM reaches on this CPU, measured in each
worker's own process (same threads, same preloads) as a bf16 `torch.nn.functional.linear` of
--roofline-size^3 (default 4096^3) multiply-adds; "% roof" is a side's GFLOP/s over its own
process's roofline.

Before any timing is printed, the parent checks that both sides computed the same attention: a small
fixed case (L=300 per shape: crosses block boundaries on both sides and ends in a partial block) in
full, and 16 rows spread over every timed output, must agree between the sides within bf16
tolerance (relative Frobenius error < 1e-2); the small case is also held against an fp32 SDPA
reference. A failure exits non-zero and prints no table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from offline_vs_vllm import run_worker, vllm_op_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
PDSERVE_BLOCK = 16          # records/engine_args.py's default block_size
VLLM_BLOCK = 128            # vllm/platforms/cpu.py's default block_size for the CPU backend
CHECK_LEN = 300
SAMPLE_ROWS = 16
TOLERANCE = 1e-2
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DTYPE = torch.bfloat16      # main() sets it from --dtype, in the parent and in each worker


def make_qkv(length: int, heads: int, kv_heads: int, head_dim: int,
             seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompt's query [L, H, d] and key/value [L, kvh, d]: drawn in fp32 and cast, so both venvs
    get bit-identical inputs from the same seed."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, heads, head_dim, generator=g)
    k = torch.randn(length, kv_heads, head_dim, generator=g)
    v = torch.randn(length, kv_heads, head_dim, generator=g)
    return q.to(DTYPE), k.to(DTYPE), v.to(DTYPE)


def block_order(num_blocks: int, seed: int) -> torch.Tensor:
    """The prompt's blocks in a random order of the pool, as a free queue hands them out once requests
    come and go."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 1))


def causal_flops(length: int, heads: int, head_dim: int) -> float:
    return 4 * heads * head_dim * length * length / 2


def sample_rows(length: int) -> torch.Tensor:
    return torch.linspace(0, length - 1, SAMPLE_ROWS).round().long().unique()


def pdserve_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: int,
                    block_size: int) -> tuple[Callable[[], torch.Tensor], None]:
    """A call of pdserve's prefill attention over the prompt's K/V in its paged cache."""
    from kernels import cpu_ops

    length, kv_heads, head_dim = k.shape
    num_blocks = -(-length // block_size)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=DTYPE)
    table = block_order(num_blocks, seed)
    pos = torch.arange(length)
    cache[0, table[pos // block_size], pos % block_size] = k
    cache[1, table[pos // block_size], pos % block_size] = v
    packed = cpu_ops.PackedPrefill([table], [length], [length])
    scale = head_dim ** -0.5
    return lambda: cpu_ops.prefill_attention(q, cache, [table], [length], [length], scale, packed), None


def vllm_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: int,
                 block_size: int) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """A call of vLLM's CPU attention op as CPUAttentionBackendImpl.forward makes it for one prefill
    sequence, and (second) the per-step metadata build CPUAttentionMetadataBuilder.build makes."""
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    length, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    isa = _get_attn_isa(DTYPE, block_size, head_dim, "auto")
    num_blocks = -(-length // block_size)
    # The backend's cache and its K / V views (forward and do_kv_cache_update split it the same way).
    kv_cache = torch.zeros(num_blocks, kv_heads, block_size, 2 * head_dim, dtype=DTYPE)
    key_cache, value_cache = kv_cache.view(num_blocks, kv_heads, block_size * 2, head_dim).chunk(2, dim=2)
    table = block_order(num_blocks, seed)
    pos = torch.arange(length)
    slot_mapping = table[pos // block_size] * block_size + pos % block_size       # int64, as the runner's
    # The ISA's kernel decides the layout inside a block, so the cache is filled by vLLM's own writer.
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, isa)
    query_start_loc = torch.tensor([0, length], dtype=torch.int32)
    seq_lens = torch.tensor([length], dtype=torch.int32)
    block_table = table.to(torch.int32)[None]

    def metadata() -> torch.Tensor:
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, seq_lens=seq_lens,
            dtype=DTYPE, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype="auto")

    scheduler_metadata = metadata()
    output = torch.empty_like(q)
    scale = head_dim ** -0.5

    def attend() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=output,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=block_table, softcap=0.0, scheduler_metadata=scheduler_metadata,
            s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        return output
    return attend, metadata


def time_ms(fn: Callable[[], object], seconds: float) -> tuple[float, int, object]:
    """The mean ms per call of `fn` over N calls taking about `seconds`, after a warm-up call (the
    first call pays one-time costs: scratch buffers, thread start-up); with N and the last call's
    result (for the check, so a 16k prompt is not run once more just for it)."""
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    if once < seconds:        # a second, warm call sizes N better; a long call is warm enough already
        start = time.perf_counter()
        fn()
        once = time.perf_counter() - start
    calls = max(1, round(seconds / once))
    out = None
    start = time.perf_counter()
    for _ in range(calls):
        out = fn()
    return (time.perf_counter() - start) / calls * 1e3, calls, out


def roofline_gflops(size: int, seconds: float) -> float:
    """GFLOP/s of a size^3 linear in DTYPE: oneDNN's GEMM rate (bf16: the best this CPU's bf16 dot
    products practically reach; fp32: its fused multiply-adds)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(DTYPE)
    w = torch.randn(size, size, generator=g).to(DTYPE)
    ms, _, _ = time_ms(lambda: torch.nn.functional.linear(a, w), seconds)
    return 2 * size ** 3 / ms / 1e6


def worker(args: argparse.Namespace) -> None:
    """One side, one process: the roofline, then every size's time; JSON on stdout, outputs for the
    parent's check in --check-file."""
    # This script's folder holds a kernels.py that would shadow the package named `kernels`.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    torch.set_num_threads(args.threads)
    if args.side == "pdserve":
        sys.path.insert(0, str(ROOT))
        from kernels import cpu_ops
        build, block_size, info = pdserve_prefill, args.pdserve_block_size, f"cpu_ops {cpu_ops.load()}"
    else:
        import vllm
        build, block_size, info = vllm_prefill, args.vllm_block_size, f"vllm {vllm.__version__}"
    result: dict = {"side": args.side, "info": info, "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "preload": os.environ.get("LD_PRELOAD", ""), "block_size": block_size,
                    "roofline_gflop_per_s": roofline_gflops(args.roofline_size, args.seconds), "rows": []}
    check: dict[str, torch.Tensor] = {}
    for model in args.shapes.split(","):
        heads, kv_heads, head_dim = SHAPES[model]
        call, _ = build(*make_qkv(CHECK_LEN, heads, kv_heads, head_dim, args.seed), args.seed, block_size)
        check[f"{model}/check"] = call().clone()
        for length in (int(n) for n in args.lens.split(",")):
            call, metadata = build(*make_qkv(length, heads, kv_heads, head_dim, args.seed), args.seed, block_size)
            ms, calls, out = time_ms(call, args.seconds)
            check[f"{model}/{length}"] = out[sample_rows(length)].clone()
            row = {"model": model, "len": length, "ms": ms, "calls": calls,
                   "gflop_per_s": causal_flops(length, heads, head_dim) / ms / 1e6}
            if metadata is not None:
                row["metadata_ms"] = time_ms(metadata, 0.1)[0]
            result["rows"].append(row)
    torch.save(check, args.check_file)
    print("RESULT " + json.dumps(result), flush=True)


def run_side(side: str, python: str, args: argparse.Namespace, check_file: str) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--side", side, "--lens", args.lens, "--shapes", args.shapes,
           "--threads", str(args.threads), "--dtype", args.dtype, "--seconds", str(args.seconds),
           "--seed", str(args.seed),
           "--roofline-size", str(args.roofline_size), "--pdserve-block-size", str(args.pdserve_block_size),
           "--vllm-block-size", str(args.vllm_block_size), "--check-file", check_file]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if side == "vllm":
        env.update(vllm_op_env(python, args.threads))
    return run_worker(cmd, env, side, cwd=ROOT)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def reference(model: str, seed: int) -> torch.Tensor:
    """The check case's attention in fp32 SDPA from the same inputs."""
    heads, kv_heads, head_dim = SHAPES[model]
    q, k, v = (t.float().transpose(0, 1)[None] for t in make_qkv(CHECK_LEN, heads, kv_heads, head_dim, seed))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=head_dim ** -0.5,
                                                           enable_gqa=True)
    return out[0].transpose(0, 1)


def check_agreement(checks: dict[str, dict[str, torch.Tensor]], seed: int) -> list[str]:
    """Each output both sides returned, compared; raises SystemExit on a disagreement."""
    lines, bad = [], []
    for key in checks["pdserve"]:
        ours, theirs = checks["pdserve"][key], checks["vllm"][key]
        err = rel_error(ours, theirs)
        line = f"{key:20s} pdserve vs vLLM {err:.2e}"
        if key.endswith("/check"):
            ref = reference(key.split("/")[0], seed)
            ref_errs = (rel_error(ours, ref), rel_error(theirs, ref))
            line += f"; vs fp32 reference: pdserve {ref_errs[0]:.2e}, vLLM {ref_errs[1]:.2e}"
            err = max(err, *ref_errs)
        lines.append(line)
        if not err < TOLERANCE:
            bad.append(line)
    if bad:
        raise SystemExit("outputs disagree (relative Frobenius error >= %g):\n" % TOLERANCE + "\n".join(bad))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=["pdserve", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--check-file", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="the python of vLLM's venv")
    ap.add_argument("--lens", default="1024,4096,16384", help="prompt lengths, comma-separated")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.5, help="about how long each measurement runs")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="q, k, v and both caches")
    ap.add_argument("--roofline-size", type=int, default=4096, help="the roofline GEMM's M = N = K")
    ap.add_argument("--pdserve-block-size", type=int, default=PDSERVE_BLOCK)
    ap.add_argument("--vllm-block-size", type=int, default=VLLM_BLOCK)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    global DTYPE
    DTYPE = DTYPES[args.dtype]
    if unknown := set(args.shapes.split(",")) - set(SHAPES):
        ap.error(f"unknown shapes {sorted(unknown)}; known: {', '.join(SHAPES)}")
    if args.side:
        worker(args)
        return
    runs: dict[str, list[dict]] = {"pdserve": [], "vllm": []}
    checks: dict[str, dict[str, torch.Tensor]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-prefill-vs-vllm-") as tmp:
        for r in range(args.rounds):
            for side, python in (("pdserve", sys.executable), ("vllm", args.vllm_python)):
                start = time.perf_counter()
                check_file = os.path.join(tmp, f"{side}.pt")
                runs[side].append(run_side(side, python, args, check_file))
                checks.setdefault(side, torch.load(check_file))
                print(f"round {r + 1} {side:8s} done in {time.perf_counter() - start:5.1f} s "
                      f"({runs[side][-1]['info']}; roofline {runs[side][-1]['roofline_gflop_per_s']:.0f} GFLOP/s"
                      + (f"; LD_PRELOAD={runs[side][-1]['preload']}" if runs[side][-1]["preload"] else "") + ")",
                      file=sys.stderr, flush=True)
    print("\n".join(check_agreement(checks, args.seed)))
    roof = {side: max(run["roofline_gflop_per_s"] for run in side_runs) for side, side_runs in runs.items()}
    print(f"{args.threads} threads, {args.dtype}, best of {args.rounds}; roofline ({args.dtype} {args.roofline_size}^3 "
          "linear): "
          f"pdserve process {roof['pdserve']:.0f}, vLLM process {roof['vllm']:.0f} GFLOP/s; block size pdserve "
          f"{args.pdserve_block_size}, vLLM {args.vllm_block_size}")
    print(f"{'shape':13s} {'len':>6s} {'pdserve ms':>11s} {'vLLM ms':>11s} {'vLLM/pds':>8s} "
          f"{'pds GFLOP/s':>11s} {'% roof':>6s} {'vLLM GFLOP/s':>12s} {'% roof':>6s} {'vLLM meta ms':>12s}")
    table = []
    for i, row in enumerate(runs["pdserve"][0]["rows"]):
        best = {side: min(side_runs, key=lambda run: run["rows"][i]["ms"])["rows"][i]
                for side, side_runs in runs.items()}
        p, v = best["pdserve"], best["vllm"]
        out = {"model": row["model"], "len": row["len"], "pdserve_ms": p["ms"], "vllm_ms": v["ms"],
               "vllm_over_pdserve": v["ms"] / p["ms"], "pdserve_gflop_per_s": p["gflop_per_s"],
               "vllm_gflop_per_s": v["gflop_per_s"],
               "pdserve_roofline_frac": p["gflop_per_s"] / roof["pdserve"],
               "vllm_roofline_frac": v["gflop_per_s"] / roof["vllm"], "vllm_metadata_ms": v["metadata_ms"],
               "pdserve_ms_per_round": [run["rows"][i]["ms"] for run in runs["pdserve"]],
               "vllm_ms_per_round": [run["rows"][i]["ms"] for run in runs["vllm"]]}
        table.append(out)
        print(f"{out['model']:13s} {out['len']:6d} {p['ms']:11.3f} {v['ms']:11.3f} {out['vllm_over_pdserve']:8.2f} "
              f"{p['gflop_per_s']:11.1f} {100 * out['pdserve_roofline_frac']:5.1f}% {v['gflop_per_s']:12.1f} "
              f"{100 * out['vllm_roofline_frac']:5.1f}% {v['metadata_ms']:12.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "dtype": args.dtype, "rounds": args.rounds,
                       "roofline_gflop_per_s": roof,
                       "roofline_size": args.roofline_size, "block_size": {"pdserve": args.pdserve_block_size,
                                                                           "vllm": args.vllm_block_size},
                       "workers": {side: [{k: run[k] for k in ("info", "torch", "threads", "preload")}
                                          for run in side_runs] for side, side_runs in runs.items()},
                       "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
