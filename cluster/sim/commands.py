"""`pdserve simulate`, `pdserve plan` and `pdserve profile`: their flags and what they run.

    pdserve simulate --trace FILE [--config SPEC] [--profile P] [--replicas N] [--prefill-replicas N]
                     [--policy prefix_aware|round_robin|least_load] [--rate-scale X]
                     [--ttft-slo MS] [--itl-slo MS] [--json] [--plot FILE]
    pdserve plan --trace FILE --ttft-slo MS --itl-slo MS [--config SPEC] [--profile P] [--output SPEC]
    pdserve profile [--model M] [--output FILE]      # calibrate a profile of the real engine here

Everything is checked before anything runs: a malformed trace line is an error naming its line and
field, an unknown profile one listing the built-ins.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import yaml

from cluster.config import ClusterConfig
from records.serving import POLICIES


def add_replay_args(ap: argparse.ArgumentParser) -> None:
    """What `simulate` and `plan` share: the trace, the spec and the profile, the SLO."""
    ap.add_argument("--trace", required=True,
                    help="the requests: Mooncake's JSONL (timestamp, input_length, output_length, hash_ids) or "
                         "pdserve's (timestamp, prompt or prompt_token_ids, output_length)")
    ap.add_argument("--config", default=None, help="the cluster spec (YAML) to replay; default: one colocated pool")
    ap.add_argument("--profile", default=None,
                    help="the simulation profile (a file, or a built-in such as h200-llama3-8b); overrides the "
                         "spec's engine.simulate")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="arrivals this many times faster (a load sweep)")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--start", type=float, default=0.0, help="start this many seconds into the trace")
    ap.add_argument("--duration", type=float, default=None, help="replay this many seconds of the trace")
    ap.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id of a Mooncake trace")
    ap.add_argument("--prompt-scale", type=float, default=1.0,
                    help="prompts this many times as long (a Mooncake trace's hash ids then stand for "
                         "block-tokens x this many tokens): a trace sized to a smaller machine")
    ap.add_argument("--output-scale", type=float, default=1.0, help="outputs this many times as long")
    ap.add_argument("--ttft-slo", type=float, default=None, help="time to first token SLO, ms (goodput)")
    ap.add_argument("--itl-slo", type=float, default=None, help="mean inter-token latency (TPOT) SLO, ms (goodput)")
    ap.add_argument("--seed", type=int, default=0, help="of the made-up tokens behind a Mooncake trace's hash ids")


def add_simulate_args(ap: argparse.ArgumentParser) -> None:
    add_replay_args(ap)
    ap.add_argument("--replicas", type=int, default=None, help="the decode (or colocated) pool's replicas")
    ap.add_argument("--prefill-replicas", type=int, default=None,
                    help="the prefill pool's replicas (> 0: disaggregated; 0: colocated)")
    ap.add_argument("--policy", choices=POLICIES, default=None, help="the routing policy (the spec's routing.name)")
    ap.add_argument("--json", action="store_true", help="one JSON object of the figures on the last line")
    ap.add_argument("--plot", default=None, metavar="PNG", help="draw the pools' replicas over time here")


def replay_spec(args: argparse.Namespace, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """The spec to replay: --config (or one colocated pool) with the command line's changes."""
    data: dict[str, Any] = {}
    if args.config:
        with open(args.config) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{args.config}: a spec is a YAML mapping")
    engine = dict(data.get("engine") or {})
    if args.profile is not None:
        engine["simulate"] = args.profile
    if not engine.get("simulate"):
        raise ValueError("a simulation profile is needed: --profile (a file, or a built-in such as "
                         "h200-llama3-8b) or the spec's engine.simulate")
    data["engine"] = engine
    pools = {name: dict(spec or {}) for name, spec in (data.get("pools") or {"decode": {}}).items()}
    if getattr(args, "replicas", None) is not None:
        pools.setdefault("decode", {})["replicas"] = args.replicas
    prefill = getattr(args, "prefill_replicas", None)
    if prefill == 0:
        pools.pop("prefill", None)
        data["mode"] = "colocated"
    elif prefill is not None:
        pools["prefill"] = {**pools.get("prefill", {}), "replicas": prefill}
        data["mode"] = "disaggregated"
    for spec in pools.values():        # autoscaled pools start within their bounds
        auto = spec.get("autoscaling")
        if auto and "replicas" in spec:
            lo, hi = auto.get("min_replicas", 1), auto.get("max_replicas", 1)
            spec["replicas"] = min(max(spec["replicas"], lo), hi)
    data["pools"] = pools
    if getattr(args, "policy", None) is not None:
        data["routing"] = {**(data.get("routing") or {}), "name": args.policy}
    data.update(overrides or {})
    return ClusterConfig.model_validate(data)


def block_tokens(args: argparse.Namespace) -> int:
    """Tokens per hash id of the replayed trace (a scaled prompt scales its blocks)."""
    return max(1, round(args.block_tokens * args.prompt_scale))


def load_requests(args: argparse.Namespace) -> list:
    from cluster.sim.trace import read_trace, scale_trace  # noqa: PLC0415 - numpy, only where a trace is read

    for flag in ("rate_scale", "prompt_scale", "output_scale"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0; got {getattr(args, flag)}")
    requests = read_trace(args.trace, args.block_tokens, args.limit, args.start, args.duration)
    return scale_trace(requests, args.rate_scale, args.prompt_scale, args.output_scale)


def replay(spec: ClusterConfig, requests: list, args: argparse.Namespace) -> dict[str, Any]:
    """Run one replay; its summary (cluster/sim/report.py)."""
    from cluster.sim.replay import Replay  # noqa: PLC0415 - the engine, only when a replay runs
    from cluster.sim.report import summarize  # noqa: PLC0415

    began = time.monotonic()
    done = Replay(spec, requests, args.seed, block_tokens(args)).run()
    return summarize(done, args.ttft_slo, args.itl_slo, time.monotonic() - began)


def run_simulate(args: argparse.Namespace) -> int:
    from cluster.sim.report import format_summary, plot_replicas  # noqa: PLC0415

    try:
        spec = replay_spec(args)
        for pool in spec.pools:
            spec.engine_config(pool)            # the engine section against the model and profile
        requests = load_requests(args)
    except (OSError, ValueError, yaml.YAMLError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    summary = replay(spec, requests, args)
    if args.plot:
        try:
            plot_replicas(summary, args.plot)
        except ValueError as e:
            print(f"pdserve: error: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary))
    return 0


def add_profile_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="the model to measure (default: the embedded one)")
    ap.add_argument("--output", required=True, help="where to write the profile (JSON)")
    ap.add_argument("--name", default=None, help="the profile's name (default: the output file's stem)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads, as a replica of that many CPUs runs (--cpus-per-rank)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the grid of batches")
    ap.add_argument("--copies", type=int, default=1,
                    help="engines measuring at once, each in its own process: the replicas that will share "
                         "this machine (they slow each other's steps)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None)


def run_profile(args: argparse.Namespace) -> int:
    import os  # noqa: PLC0415

    from cluster.sim.calibrate import calibrate  # noqa: PLC0415 - the model and torch, only here
    from records.sim_profile import save_profile  # noqa: PLC0415

    name = args.name or os.path.splitext(os.path.basename(args.output))[0]
    engine_args = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}
    try:
        if args.copies < 1 or args.threads < 1:
            raise ValueError(f"--copies and --threads must be >= 1; got {args.copies}, {args.threads}")
        profile = calibrate(args.model, args.threads, engine_args, name, args.rounds, args.copies)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    save_profile(profile, args.output)
    fit = profile.fit
    print(f"pdserve: wrote {args.output}: {fit['steps']} steps fitted; relative error p50 "
          f"{fit['relative_error_p50']:.1%}, p90 {fit['relative_error_p90']:.1%}, on their total "
          f"{fit['total_error']:.1%}")
    return 0


def add_plan_args(ap: argparse.ArgumentParser) -> None:
    add_replay_args(ap)
    ap.add_argument("--modes", default="colocated,disaggregated", help="shapes to try: colocated, disaggregated")
    ap.add_argument("--pd-ratios", default="1:1,1:2,1:3", help="prefill:decode replica ratios to try (disaggregated)")
    ap.add_argument("--tp", default="1", help="tensor-parallel sizes to try (e.g. 1,2,4)")
    ap.add_argument("--policies", default="prefix_aware", help=f"routing policies to try, among {', '.join(POLICIES)}")
    ap.add_argument("--attainment", type=float, default=0.9,
                    help="the share of requests that must meet both SLOs (default 0.9)")
    ap.add_argument("--max-replicas", type=int, default=64, help="the most replicas a candidate may have, in all")
    ap.add_argument("--output", default=None, help="write the cheapest spec here (YAML for pdserve serve --config)")
    ap.add_argument("--json", action="store_true", help="one JSON object of the plan on the last line")


def run_plan(args: argparse.Namespace) -> int:
    from cluster.sim.capacity import CapacityPlanner, Shape, parse_ratios  # noqa: PLC0415

    try:
        if args.ttft_slo is None or args.itl_slo is None:
            raise ValueError("pdserve plan sizes for an SLO: give --ttft-slo and --itl-slo (ms)")
        modes = [m.strip() for m in args.modes.split(",")]
        if not modes or any(m not in ("colocated", "disaggregated") for m in modes):
            raise ValueError(f"--modes takes colocated and/or disaggregated; got {args.modes!r}")
        policies = [p.strip() for p in args.policies.split(",")]
        if any(p not in POLICIES for p in policies):
            raise ValueError(f"--policies takes {', '.join(POLICIES)}; got {args.policies!r}")
        try:
            tps = [int(t) for t in args.tp.split(",")]
        except ValueError:
            tps = []
        if not tps or min(tps) < 1:
            raise ValueError(f"--tp takes positive integers (e.g. 1,2,4); got {args.tp!r}")
        ratios = parse_ratios(args.pd_ratios) if "disaggregated" in modes else []
        base = replay_spec(args).model_dump(mode="json", exclude_defaults=True)
        shapes = [Shape(mode, ratio, tp, policy) for mode in modes for ratio in (ratios if mode == "disaggregated"
                                                                                   else [(0, 1)])
                  for tp in tps for policy in policies]
        planner = CapacityPlanner(base, lambda spec: replay(spec, requests, args), args.attainment, args.max_replicas)
        for shape in shapes:
            planner.spec(shape, shape.min_total).engine_config("decode")     # TP against the model, now
        requests = load_requests(args)
    except (OSError, ValueError, yaml.YAMLError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2

    def report(t: Any) -> None:
        if not args.json:
            s = t.summary
            print(f"  {t.shape.label():<40} {str(t.pools):<32} met {t.attainment:6.1%}  TTFT p90 "
                  f"{s['ttft_ms']['p90']:>9} ms  TPOT p90 {s['tpot_ms']['p90']:>7} ms  {t.gpu_seconds:>11,.0f} GPU-s"
                  f"{'  meets' if t.meets else ''}", flush=True)

    if not args.json:
        print(f"pdserve plan: {len(requests)} requests, SLO TTFT <= {args.ttft_slo} ms and TPOT <= {args.itl_slo} ms "
              f"for {args.attainment:.0%}; {len(shapes)} shapes", flush=True)
    result = planner.plan(shapes, report)
    best = result.best
    if best is None:
        print(f"pdserve: no candidate up to {args.max_replicas} replicas meets the SLO (raise --max-replicas, or "
              f"loosen the SLO)", file=sys.stderr)
        return 1
    text = planner.spec_yaml(best, {"ttft_ms": args.ttft_slo, "itl_ms": args.itl_slo})
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    if args.json:
        print(json.dumps({"best": {"shape": best.shape.label(), "pools": best.pools, "gpu_seconds": best.gpu_seconds,
                                   "attainment": best.attainment, "summary": best.summary},
                          "trials": [{"shape": t.shape.label(), "pools": t.pools, "attainment": t.attainment,
                                      "gpu_seconds": t.gpu_seconds, "meets": t.meets} for t in result.trials]}))
    else:
        print(f"cheapest: {best.shape.label()}, replicas {best.pools}: {best.attainment:.1%} met, "
              f"{best.gpu_seconds:,.0f} GPU-seconds" + (f"; spec written to {args.output}" if args.output else ""))
        if not args.output:
            print(text)
    return 0
