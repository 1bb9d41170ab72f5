"""P/D between pipelined engines: what each decode stage's pull costs, against recomputing the prompt.

    .venv/bin/python benchmarks/pipelined_transfer.py                          # full run
    .venv/bin/python benchmarks/pipelined_transfer.py --prompt-len 256 --repeats 1 --shapes 1x2-1x2   # smoke

The embedded model (SmolLM2-135M, 30 layers, 3 KV heads: TP must be 1 or 3, so the shapes vary PP
and the layer split) on a local Ray; prefill engine P and decode engine D each run their ranks on
Ray worker actors (one CPU each), the driver steps both. Per shape and connector:
- pull: P prefills a --prompt-len prompt (do_remote_decode), D pulls it (all but the last token);
  each D rank logs its part (PullRecord: start, end, bytes). Reported per stage: seconds, MB and
  GB/s, and the span of the whole pull (first start to last end) over the slowest stage's time:
  1.0 when the stages pull fully in parallel, 2.0 when one waits for the other.
- recompute: the same prompt computed by D itself (prefix cache reset), to its first token.
Medians over --repeats (round 0 is an untimed warm-up). On a 2-core machine the stages share the
cores with each other and with P's ranks: absolute figures are the box's, the ratios are the point.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("TQDM_DISABLE", "1")

from engine.executor.ray_cluster import init_ray
from engine.llm_engine import LLMEngine
from records.config_resolution import engine_config
from records.sampling_params import SamplingParams

SHAPES = ["1x2-1x1", "1x1-1x2", "1x2-1x2", "1x2-1x2s"]     # P tp x pp - D tp x pp ("s": D splits 10+20)
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
DEADLINE_S = 600.0


def parse_shape(text: str) -> tuple[tuple[int, int], tuple[int, int], list[int] | None]:
    p, d = text.split("-")
    split = [10, 20] if d.endswith("s") else None
    (ptp, ppp), (dtp, dpp) = (tuple(int(x) for x in s.rstrip("s").split("x")) for s in (p, d))
    return (ptp, ppp), (dtp, dpp), split


def engine(connector: str, tp: int, pp: int, split: list[int] | None, prompt_len: int) -> LLMEngine:
    return LLMEngine(engine_config(
        None, max_model_len=max(1024, prompt_len + 64), max_num_batched_tokens=max(2048, prompt_len),
        kv_cache_memory_bytes=512 << 20, kv_connector=connector, kv_load_timeout_s=DEADLINE_S,
        tensor_parallel_size=tp, pipeline_parallel_size=pp, pp_layer_partition=split,
        distributed_executor_backend="ray", worker_num_cpus=1.0))


def until_done(engine: LLMEngine, rid: str, others: tuple[LLMEngine, ...] = ()) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        if any(o.request_id == rid and o.finished for o in engine.step()):
            return
        for other in others:
            other.step()
        if not engine.has_unfinished_requests():
            time.sleep(1e-4)
        assert time.monotonic() < deadline, f"{rid} hung"


def settle(*engines: LLMEngine) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while any(e.has_unfinished_requests() for e in engines):
        for e in engines:
            e.step()
        time.sleep(1e-4)
        assert time.monotonic() < deadline, "transfers never settled"


def bench_shape(connector: str, shape: str, prompt_len: int, repeats: int) -> dict:
    (ptp, ppp), (dtp, dpp), split = parse_shape(shape)
    p = engine(connector, ptp, ppp, None, prompt_len)
    d = engine(connector, dtp, dpp, split, prompt_len)
    vocab = p.config.model_config.vocab_size
    stages: list[list[float]] = [[] for _ in range(dpp)]
    stage_bytes = [0] * dpp
    spans, slowest, recompute = [], [], []
    try:
        for rep in range(repeats + 1):
            ids = [(i * 131 + 17 * rep + 5) % (vocab - 10) + 5 for i in range(prompt_len)]
            p.reset_prefix_cache()
            d.reset_prefix_cache()
            p.add_request(f"p{rep}", None, ids, ONE, kv_transfer_params={"do_remote_decode": True})
            outs = []
            while not outs:
                outs = [o for o in p.step() if o.request_id == f"p{rep}" and o.finished]
            d.add_request(f"d{rep}", None, ids, ONE, kv_transfer_params=outs[0].kv_transfer_params)
            until_done(d, f"d{rep}", (p,))
            settle(p, d)
            log = [r for r in d.executor.kv_pull_log() if r.request_id == f"d{rep}"]
            assert len(log) == dtp * dpp and all(r.ok for r in log), log
            d.reset_prefix_cache()
            start = time.perf_counter()
            d.add_request(f"c{rep}", None, ids, ONE)
            until_done(d, f"c{rep}")
            took = time.perf_counter() - start
            if rep == 0:
                continue
            recompute.append(took)
            by_stage = [[r for r in log if r.rank // dtp == s] for s in range(dpp)]
            for s, records in enumerate(by_stage):
                stages[s].append(max(r.end for r in records) - min(r.start for r in records))
                stage_bytes[s] = sum(r.num_bytes for r in records)
            spans.append(max(r.end for r in log) - min(r.start for r in log))
            slowest.append(max(st[-1] for st in stages))
    finally:
        for e in (p, d):
            e.executor.shutdown()
    med = statistics.median
    row = {"connector": connector, "shape": f"P {ptp}x{ppp} -> D {dtp}x{dpp}" + (f" split {split}" if split else ""),
           "prompt_len": prompt_len, "recompute_s": med(recompute), "pull_span_s": med(spans),
           "span_over_slowest": med(s / w for s, w in zip(spans, slowest)),
           "stages": [{"stage": s, "pull_s": med(stages[s]), "mb": stage_bytes[s] / 1e6,
                       "gb_per_s": stage_bytes[s] / med(stages[s]) / 1e9} for s in range(dpp)]}
    row["recompute_over_pull"] = row["recompute_s"] / row["pull_span_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connectors", default="nixl,torch_dist")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    init_ray(num_cpus=8)
    rows = []
    for connector in args.connectors.split(","):
        for shape in args.shapes.split(","):
            row = bench_shape(connector, shape, args.prompt_len, args.repeats)
            rows.append(row)
            stages = "  ".join(f"s{st['stage']} {st['pull_s'] * 1e3:6.1f} ms {st['mb']:6.1f} MB "
                               f"{st['gb_per_s']:5.2f} GB/s" for st in row["stages"])
            print(f"{connector:10s} {row['shape']:34s} pull {row['pull_span_s'] * 1e3:7.1f} ms "
                  f"(span/slowest {row['span_over_slowest']:.2f})  recompute {row['recompute_s'] * 1e3:7.1f} ms "
                  f"({row['recompute_over_pull']:.1f}x)  | {stages}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
