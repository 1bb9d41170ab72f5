"""What a replay measured (cluster/sim/replay.py), as `pdserve simulate` reports it: latency
percentiles, throughput, goodput at an SLO, the prefix cache's work, P/D decisions, preemptions,
replica-seconds, and the planner's replica counts over time (and their plot)."""
from __future__ import annotations

from typing import Any

from cluster.sim.replay import Replay, percentiles


def summarize(replay: Replay, ttft_slo_ms: float | None = None, itl_slo_ms: float | None = None,
              wall_s: float | None = None) -> dict[str, Any]:
    """The replay's figures (times in ms). Goodput counts the requests per second that met every SLO
    given: their time to first token within `ttft_slo_ms`, their mean gap between tokens (TPOT)
    within `itl_slo_ms`."""
    done = list(replay.finished())
    ttft = [(f.first - f.arrival) * 1e3 for f in done if f.first is not None]
    e2e = [(f.done - f.arrival) * 1e3 for f in done]
    tpot = {f.index: (f.done - f.first) * 1e3 / (f.tokens - 1) for f in done if f.first is not None and f.tokens > 1}
    start = min((f.arrival for f in replay.flights), default=0.0)
    span = max(replay.end - start, 1e-9)
    good = [f for f in done if f.error is None
            and (ttft_slo_ms is None or (f.first is not None and (f.first - f.arrival) * 1e3 <= ttft_slo_ms))
            and (itl_slo_ms is None or tpot.get(f.index, 0.0) <= itl_slo_ms)]
    prompt_tokens = sum(f.prompt_len for f in replay.flights)
    cached = sum(f.cached for f in done)
    totals = replay.engine_totals()
    seconds = replay.replica_seconds()
    return {
        "requests": len(replay.flights), "completed": len(done),
        "failed": sum(1 for f in done if f.error is not None),
        "duration_s": round(span, 3),
        "ttft_ms": _ms(percentiles(ttft)), "itl_ms": _ms(percentiles([x * 1e3 for x in replay.itl])),
        "tpot_ms": _ms(percentiles(list(tpot.values()))), "e2e_ms": _ms(percentiles(e2e)),
        "throughput_tok_s": round(sum(f.tokens for f in done) / span, 2),
        "request_throughput_req_s": round(len(done) / span, 4),
        "goodput_req_s": round(len(good) / span, 4),
        "slo": {"ttft_ms": ttft_slo_ms, "itl_ms": itl_slo_ms, "met": len(good)},
        "prefix_hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
        "prompt_tokens": prompt_tokens, "prompt_tokens_computed": totals["prompt_tokens_computed"],
        "prompt_tokens_reused": max(0, prompt_tokens - totals["prompt_tokens_computed"]),
        "pd_decisions": dict(sorted(replay.decisions.items())),
        "kv_blocks_pulled": totals["kv_blocks_pulled"], "kv_load_failures": totals["kv_load_failures"],
        "preemptions": totals["num_preemptions"],
        "replica_seconds": round(sum(seconds.values()), 1),
        "replica_seconds_by_pool": {k: round(v, 1) for k, v in seconds.items()},
        "replicas": {pool: replay.spec.pools[pool].replicas for pool in replay.spec.pools},
        "planner": {"decisions": replay.planner_log,
                    "replicas_over_time": [[round(t, 3), pool, target, serving]
                                           for t, pool, target, serving in replay.scaling]},
        "policy": replay.spec.routing.name, "mode": replay.spec.mode, "profile": replay.profile.name,
        **({"wall_s": round(wall_s, 2)} if wall_s is not None else {}),
    }


def _ms(values: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else round(v, 2) for k, v in values.items()}


def format_summary(s: dict[str, Any]) -> str:
    def row(name: str, v: dict[str, Any]) -> str:
        return f"  {name:<5} p50 {_fmt(v['p50'])}  p90 {_fmt(v['p90'])}  p99 {_fmt(v['p99'])} ms"
    lines = [f"{s['completed']}/{s['requests']} requests in {s['duration_s']:.1f} s simulated "
             f"({s['mode']}, {s['policy']}, replicas {s['replicas']}, profile {s['profile']})"
             + (f"; {s['wall_s']:.1f} s wall" if "wall_s" in s else ""),
             row("TTFT", s["ttft_ms"]), row("ITL", s["itl_ms"]), row("TPOT", s["tpot_ms"]), row("E2E", s["e2e_ms"]),
             f"  throughput {s['throughput_tok_s']:.1f} tok/s, {s['request_throughput_req_s']:.3f} req/s; goodput "
             f"{s['goodput_req_s']:.3f} req/s ({s['slo']['met']} met TTFT <= {s['slo']['ttft_ms']} ms, "
             f"TPOT <= {s['slo']['itl_ms']} ms)",
             f"  prefix hit rate {s['prefix_hit_rate']:.1%}; prompt tokens computed {s['prompt_tokens_computed']:,} "
             f"of {s['prompt_tokens']:,}; preemptions {s['preemptions']}",
             f"  replica-seconds {s['replica_seconds']:,.0f} {s['replica_seconds_by_pool']}"]
    if s["pd_decisions"]:
        lines.append(f"  P/D decisions {s['pd_decisions']}; KV blocks pulled {s['kv_blocks_pulled']:,}")
    for d in s["planner"]["decisions"]:
        lines.append(f"  planner at {d['t']:.0f} s: {d['pool']} {d['action']} {d['from']} -> {d['to']} ({d['reason']})")
    return "\n".join(lines)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def plot_replicas(summary: dict[str, Any], path: str) -> None:
    """The pools' serving replicas over time (a step plot) to a PNG."""
    try:
        import matplotlib  # noqa: PLC0415 - optional: only --plot draws

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(8, 3.5))
    rows = summary["planner"]["replicas_over_time"]
    end = summary["duration_s"]
    for pool in sorted({r[1] for r in rows}):
        points = [(t, serving) for t, p, _, serving in rows if p == pool]
        xs = [t for t, _ in points] + [end]
        ys = [n for _, n in points] + [points[-1][1]]
        ax.step(xs, ys, where="post", label=f"{pool} (serving)")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("replicas")
    ax.set_title(f"{summary['mode']}, {summary['policy']}: replicas over time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
