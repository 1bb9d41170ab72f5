"""Sleep and wake against a cold start, for one replica of the embedded model on a local Ray (issue
69; cluster/replica.py: `EngineReplica.sleep`).

Cold start: a new replica actor from `.remote()` to loaded (Ray's worker process, the imports, the
engine, the weights), what a pool scaled from zero pays. Wake: `wake()` of a replica put to sleep at
level 1 (checkpoint pages left in the page cache) and level 2 (dropped from it). The replica's
resident memory (RSS, read from its process) awake after a request, asleep, and after waking; the
first request's tokens after a wake must equal those before it.

    .venv/bin/python benchmarks/sleep_wake.py [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import psutil
    import ray

    from cluster.replica import EngineReplica
    from engine.executor.ray_cluster import init_ray
    from records.config_resolution import engine_config
    from records.sampling_params import SamplingParams

    init_ray(num_cpus=2)
    config = engine_config(args.model, max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    from engine.text.tokenizer import load_tokenizer
    prompt = load_tokenizer(config.model_config.model, config.model_config.gguf_file).encode(
        "The history of the lighthouse begins with")
    Replica = ray.remote(EngineReplica).options(num_cpus=1, max_concurrency=100)

    def tokens(actor) -> list[int]:
        out = ray.get(actor.generate.options(num_returns="streaming").remote("r", prompt, params))
        return [t for ref in out for c in ray.get(ref).choices for t in c.token_ids]

    def rss(actor) -> int:
        return psutil.Process(ray.get(actor.info.remote())["pid"]).memory_info().rss

    rows: dict[str, list[float]] = {k: [] for k in ("cold_s", "wake1_s", "wake2_s", "rss_awake", "rss_asleep1",
                                                    "rss_woken1", "rss_asleep2", "rss_woken2")}
    for _ in range(args.rounds):
        began = time.monotonic()
        actor = Replica.remote(config, "decode-0", num_threads=1)
        ray.get(actor.info.remote())
        rows["cold_s"].append(time.monotonic() - began)
        want = tokens(actor)
        rows["rss_awake"].append(rss(actor))
        for level in (1, 2):
            ray.get(actor.sleep.remote(level))
            rows[f"rss_asleep{level}"].append(rss(actor))
            woke = ray.get(actor.wake.remote())
            rows[f"wake{level}_s"].append(woke["wake_s"])
            assert tokens(actor) == want, "the woken replica answered differently"
            rows[f"rss_woken{level}"].append(rss(actor))
        ray.kill(actor)
        time.sleep(1.0)
    med = {k: statistics.median(v) for k, v in rows.items()}
    summary = {"model": config.model_config.model, "rounds": args.rounds, "median": med, "runs": rows,
               "cold_over_wake1": med["cold_s"] / med["wake1_s"], "cold_over_wake2": med["cold_s"] / med["wake2_s"]}
    print(f"cold start {med['cold_s']:.2f} s; wake from level 1 {med['wake1_s']:.2f} s "
          f"({summary['cold_over_wake1']:.1f}x faster), from level 2 {med['wake2_s']:.2f} s "
          f"({summary['cold_over_wake2']:.1f}x)")
    print(f"RSS awake {med['rss_awake'] / MB:.0f} MB; asleep level 1 {med['rss_asleep1'] / MB:.0f} MB, "
          f"level 2 {med['rss_asleep2'] / MB:.0f} MB; woken {med['rss_woken1'] / MB:.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
