"""A load ramp (low -> high -> low) against a decode pool autoscaled from an ITL target and against a
fixed pool of its minimum size, one after the other in one run on a local Ray: does the planner
meet the target at the high plateau where the fixed pool misses it, and give the replicas back
after?

    .venv/bin/python benchmarks/autoscale_ramp.py                       # ~5 minutes
    .venv/bin/python benchmarks/autoscale_ramp.py --phases 10,30,20     # shorter
    python3 benchmarks/autoscale_ramp.py --max-replicas 4 --num-cpus 2 --high 32   # a 16-core machine

Each variant: a fresh deployment (colocated, decode replicas of 1 CPU, one torch thread each; the
autoscaled one 1..--max-replicas with `itl_slo_ms` and short delays), then --low concurrent
streaming clients for the first phase, --high for the second, --low again for the third (greedy,
--max-tokens each). Reported per phase: the client-side inter-token latency p50/p90 (time between
streamed chunks) and TTFT p90, requests completed and failed; and the pool's target replicas over
time with the planner's decisions. Latencies are this machine's: compare the two variants of one
run, not runs of different days.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TQDM_DISABLE", "1")

PROMPTS = [f"Write a short story, number {i}, about a lighthouse and the sea:" for i in range(32)]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def client(base: str, model: str, prompts: list[str], max_tokens: int, until: float,
                 phase: str, samples: dict) -> None:
    import openai

    c = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    i = 0
    while time.monotonic() < until:
        prompt = prompts[i % len(prompts)]
        i += 1
        start = last = time.monotonic()
        first = True
        try:
            stream = await c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                temperature=0.0, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if not chunk.choices or not chunk.choices[0].text:
                    continue
                now = time.monotonic()
                if first:
                    samples[phase]["ttft"].append(now - start)
                    first = False
                else:
                    samples[phase]["itl"].append(now - last)
                last = now
            samples[phase]["completed"] += 1
        except Exception as e:  # noqa: BLE001 - counted and reported
            samples[phase]["failed"].append(f"{type(e).__name__}: {e}"[:200])


async def ramp(base: str, phases: list[tuple[str, int, float]], max_tokens: int) -> dict:
    import openai

    model = (await openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none").models.list()).data[0].id
    samples = {name: {"ttft": [], "itl": [], "completed": 0, "failed": []} for name, _, _ in phases}
    for name, concurrency, seconds in phases:
        until = time.monotonic() + seconds
        await asyncio.gather(*[client(base, model, PROMPTS[k::concurrency] or PROMPTS, max_tokens, until,
                                      name, samples) for k in range(concurrency)])
    return samples


def run_variant(label: str, model: str | None, pool: dict, phases, max_tokens: int, port: int,
                engine: dict) -> dict:
    import ray

    from cluster.config import ClusterConfig
    from cluster.launch import serve_cluster, shutdown
    from cluster.manager import MANAGER_NAME

    config = ClusterConfig(model=model, engine=engine, mode="colocated",
                           pools={"decode": pool}, serving={"port": port, "wait_for_pools": False},
                           name=f"ramp-{label}")
    serve_cluster(config, blocking=False)
    manager = ray.get_actor(MANAGER_NAME, namespace=config.name)
    timeline: list[tuple[float, int, int]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def watch() -> None:
        while not stop.is_set():
            st = ray.get(manager.pool_status.remote())["decode"]
            timeline.append((round(time.monotonic() - t0, 1), st["target"], len(st["replicas"])))
            stop.wait(1.0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        samples = asyncio.run(ramp(f"http://127.0.0.1:{port}", phases, max_tokens))
        status = ray.get(manager.pool_status.remote())["decode"]
    finally:
        stop.set()
        watcher.join()
        shutdown(config)
    changes = [timeline[0]] + [t for a, t in zip(timeline, timeline[1:]) if (a[1], a[2]) != (t[1], t[2])]
    summary = {name: {"itl_p50_ms": _ms(pct(s["itl"], 0.5)), "itl_p90_ms": _ms(pct(s["itl"], 0.9)),
                      "ttft_p90_ms": _ms(pct(s["ttft"], 0.9)), "completed": s["completed"],
                      "failed": len(s["failed"]), "errors": s["failed"][:3]}
               for name, s in samples.items()}
    return {"label": label, "pool": pool, "phases": summary, "pool_changes": changes,
            "planner": status.get("planner")}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--low", type=int, default=2)
    ap.add_argument("--high", type=int, default=24)
    ap.add_argument("--phases", default="20,60,40", help="seconds of low, high, low")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-replicas", type=int, default=2)
    ap.add_argument("--itl-slo-ms", type=float, default=None, help="the planner's ITL target (p90; default 60)")
    ap.add_argument("--ttft-slo-ms", type=float, default=None, help="the planner's TTFT target (p90)")
    ap.add_argument("--num-cpus", type=float, default=1.0, help="CPUs (torch threads) per replica")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="KV blocks per replica (a small pool makes KV memory, not the cores, the limit)")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--result", default=None, help="write the report as JSON here")
    args = ap.parse_args()

    from cluster.launch import init_ray

    low, high, low2 = (float(x) for x in args.phases.split(","))
    phases = [("low", args.low, low), ("high", args.high, high), ("low_again", args.low, low2)]
    init_ray(num_cpus=int(args.max_replicas * args.num_cpus) + 1)
    if args.itl_slo_ms is None and args.ttft_slo_ms is None:
        args.itl_slo_ms = 60.0
    autoscaling = {"min_replicas": 1, "max_replicas": args.max_replicas, "itl_slo_ms": args.itl_slo_ms,
                   "ttft_slo_ms": args.ttft_slo_ms, "window_s": 10, "upscale_delay_s": 4, "downscale_delay_s": 10,
                   "cooldown_s": 6}
    engine = {"max_model_len": 512 if args.num_kv_blocks else 1024, "max_num_seqs": 64,
              "num_kv_blocks": args.num_kv_blocks}
    pool = {"replicas": 1, "num_cpus": args.num_cpus}
    report = {"args": vars(args), "variants": [
        run_variant("fixed", args.model, pool, phases, args.max_tokens, args.port, engine),
        run_variant("autoscaled", args.model, {**pool, "autoscaling": autoscaling}, phases, args.max_tokens,
                    args.port, engine)]}
    for v in report["variants"]:
        print(f"== {v['label']}: pool changes (t s, target, serving) {v['pool_changes']}")
        for name, p in v["phases"].items():
            print(f"   {name:<10} ITL p50 {p['itl_p50_ms']} ms p90 {p['itl_p90_ms']} ms, TTFT p90 "
                  f"{p['ttft_p90_ms']} ms; {p['completed']} completed, {p['failed']} failed")
    for key, target in (("itl", args.itl_slo_ms), ("ttft", args.ttft_slo_ms)):
        fixed, auto = (v["phases"]["high"][f"{key}_p90_ms"] for v in report["variants"])
        print(f"high plateau {key.upper()} p90: fixed {fixed} ms, autoscaled {auto} ms (target {target} ms)")
    if args.result:
        with open(args.result, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
