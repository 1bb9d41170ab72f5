"""The capacity planner (`pdserve plan`): the cheapest spec that serves a trace within an SLO, found
by replaying the trace (cluster/sim/replay.py) against candidate specs in virtual time.

Candidates are the base spec (`--config`) in each shape asked for: colocated, or disaggregated at
each prefill:decode ratio, at each tensor-parallel size and routing policy. For each shape the
smallest replica count that meets the SLO is searched: doubling from the smallest, then bisecting
between the last count that missed and the first that met (more replicas never serve a trace
worse, so this finds the boundary in about 2 log2(max) replays). A spec meets the SLO when at least
`attainment` of its requests met both targets (time to first token, and mean gap between tokens)
and none failed. Its cost is its GPU-seconds: replica-seconds times ranks per replica. The winner is
written as a spec `pdserve serve --config` takes: the base spec with the pools, mode, TP and routing
chosen, without `engine.simulate`, headed by comments with what the replay measured.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from cluster.config import ClusterConfig

Replayer = Callable[[ClusterConfig], dict[str, Any]]


@dataclass(frozen=True)
class Shape:
    """A family of specs that differ only in size."""
    mode: str                       # colocated | disaggregated
    ratio: tuple[int, int] = (0, 1)  # prefill : decode replicas (disaggregated)
    tp: int = 1
    policy: str = "prefix_aware"

    def pools(self, total: int) -> dict[str, int]:
        """Replicas per pool at `total` replicas (disaggregated: split by the ratio, each at least 1)."""
        if self.mode == "colocated":
            return {"decode": total}
        p, d = self.ratio
        prefill = min(total - 1, max(1, round(total * p / (p + d))))
        return {"prefill": prefill, "decode": total - prefill}

    @property
    def min_total(self) -> int:
        return 1 if self.mode == "colocated" else 2

    def label(self) -> str:
        mode = "colocated" if self.mode == "colocated" else f"P:D {self.ratio[0]}:{self.ratio[1]}"
        return f"{mode}, TP={self.tp}, {self.policy}"


@dataclass
class Trial:
    shape: Shape
    pools: dict[str, int]
    summary: dict[str, Any]
    attainment: float
    gpu_seconds: float
    meets: bool


@dataclass
class Plan:
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None


class CapacityPlanner:
    def __init__(self, base: dict[str, Any], replay: Replayer, attainment: float = 0.9,
                 max_replicas: int = 64) -> None:
        """base: the spec to size (a dict, as loaded from YAML, with engine.simulate set); replay: runs
        one spec over the trace and returns its summary (cluster/sim/report.py)."""
        if not 0 < attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1]; got {attainment}")
        self.base, self.replay, self.attainment, self.max_replicas = base, replay, attainment, max_replicas
        self.cache: dict[tuple[Shape, int], Trial] = {}

    def spec(self, shape: Shape, total: int) -> ClusterConfig:
        data = {k: v for k, v in self.base.items()}
        base_pools = data.get("pools") or {}
        pools = {}
        for name, replicas in shape.pools(total).items():
            pool = {k: v for k, v in (base_pools.get(name) or base_pools.get("decode") or {}).items()
                    if k != "autoscaling"}
            pools[name] = {**pool, "replicas": replicas, "tensor_parallel_size": shape.tp}
        data.update(mode=shape.mode, pools=pools, routing={**(data.get("routing") or {}), "name": shape.policy})
        return ClusterConfig.model_validate(data)

    def trial(self, shape: Shape, total: int) -> Trial:
        key = (shape, total)
        if key not in self.cache:
            summary = self.replay(self.spec(shape, total))
            met = summary["slo"]["met"] / max(1, summary["requests"])
            gpu_s = summary["replica_seconds"] * shape.tp
            meets = met >= self.attainment and summary["failed"] == 0 and summary["completed"] == summary["requests"]
            self.cache[key] = Trial(shape, shape.pools(total), summary, met, gpu_s, meets)
        return self.cache[key]

    def smallest(self, shape: Shape, on_trial: Callable[[Trial], None] | None = None) -> Trial | None:
        """The smallest size of `shape` that meets the SLO within max_replicas (None if none does)."""
        def run(total: int) -> Trial:
            t = self.trial(shape, total)
            if on_trial is not None:
                on_trial(t)
            return t

        low, total = None, shape.min_total
        while True:
            t = run(total)
            if t.meets:
                break
            low = total
            if total >= self.max_replicas:
                return None
            total = min(self.max_replicas, total * 2)
        high, best = total, t
        while low is not None and high - low > 1:
            mid = (low + high) // 2
            t = run(mid)
            if t.meets:
                high, best = mid, t
            else:
                low = mid
        return best

    def plan(self, shapes: list[Shape], on_trial: Callable[[Trial], None] | None = None) -> Plan:
        plan = Plan()
        for shape in shapes:
            found = self.smallest(shape, on_trial)
            if found is not None and (plan.best is None or found.gpu_seconds < plan.best.gpu_seconds):
                plan.best = found
        plan.trials = list(self.cache.values())
        return plan

    def spec_yaml(self, trial: Trial, slo: dict[str, Any]) -> str:
        """The winner as a spec file for `pdserve serve --config` (no engine.simulate), with comments."""
        data = self.spec(trial.shape, sum(trial.pools.values())).model_dump(mode="json", exclude_defaults=True)
        engine = data.get("engine", {})
        engine.pop("simulate", None)
        engine.pop("simulate_time_scale", None)
        s = trial.summary
        header = [
            "# pdserve plan: the cheapest spec found that serves the trace within the SLO",
            f"# SLO: TTFT <= {slo['ttft_ms']} ms and TPOT <= {slo['itl_ms']} ms for >= {self.attainment:.0%} "
            "of requests",
            f"# replayed on profile {s['profile']}: {trial.attainment:.1%} met; goodput {s['goodput_req_s']} req/s; "
            f"TTFT p90 {s['ttft_ms']['p90']} ms; ITL p90 {s['itl_ms']['p90']} ms; {trial.gpu_seconds:,.0f} GPU-seconds",
            f"# shape: {trial.shape.label()}; replicas {trial.pools}"]
        return "\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False)


def parse_ratios(text: str) -> list[tuple[int, int]]:
    """"1:1,1:2" -> [(1, 1), (1, 2)]; ValueError naming the flag."""
    out = []
    for part in text.split(","):
        p, sep, d = part.strip().partition(":")
        try:
            ratio = (int(p), int(d))
        except ValueError:
            ratio = (0, 0)
        if not sep or min(ratio) < 1:
            raise ValueError(f"--pd-ratios takes prefill:decode pairs of positive integers (e.g. 1:2,1:3); "
                             f"got {part!r}")
        out.append(ratio)
    return out
