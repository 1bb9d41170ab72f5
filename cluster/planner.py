"""The planner: how many replicas a pool should have, from what its engines report.

Pure: `Planner` takes `PoolSample`s (what the manager read of a pool's replicas at one health check,
cluster/manager.py) and the time, and decides; it reads no clock and calls nothing, so a decision is
reproduced from recorded samples (tests/unit/test_planner.py).

Each plan computes a wish per target of the pool's `AutoscalingSpec` (cluster/config.py):
- load targets (requests running or waiting, queued prompt tokens, KV usage): the load over the
  window's last sample divided by the per-replica target, rounded up;
- latency targets (TTFT or ITL p90 over `window_s`, from the engines' histograms): one replica
  more while the p90 misses the target, one fewer once it is under `downscale_ratio` of it (or
  nothing was measured: no traffic), else as many as now.
The wish is the largest of them (any target short of replicas wins), within the bounds. Then the
stabilization of Kubernetes' HPA: the pool grows when every wish of the last `upscale_delay_s`
was larger than its target (to the smallest of them), shrinks when every wish of the last
`downscale_delay_s` was smaller (to the largest), never within `cooldown_s` of its last change, and
never while a replica it asked for is still starting (it would count that load twice).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from cluster.config import AutoscalingSpec
from records.engine_stats import EngineStats
from records.histogram import delta, merge, quantile


@dataclass(frozen=True)
class PoolSample:
    """One reading of a pool: sums over its serving replicas, and the latency histograms' counts
    observed since the reading before (records/histogram.py)."""
    t: float                            # seconds, monotonic
    serving: int                        # replicas serving
    starting: int                       # replicas asked for and not serving yet (pending or loading)
    running: int = 0                    # requests running
    waiting: int = 0                    # requests waiting
    queued_prompt_tokens: int = 0
    kv_usage: float = 0.0               # mean over the serving replicas, 0..1
    ttft: tuple[int, ...] = ()          # histogram counts of this interval
    itl: tuple[int, ...] = ()


def sample_pool(now: float, stats: dict[str, EngineStats | None], starting: int,
                seen: dict[tuple[str, str], list[int]]) -> PoolSample:
    """One sample of a pool from its serving replicas' last stats (replica id -> the engine's stats,
    None before its first), counting the latency histograms since the last sample (`seen` keeps
    each replica's counts so far, and is updated)."""
    known = [s for s in stats.values() if s is not None]
    hist = {}
    for field in ("ttft", "itl"):
        parts = []
        for r, st in stats.items():
            counts = getattr(st, field) if st is not None else ()
            if counts:
                parts.append(delta(counts, seen.get((r, field))))
                seen[(r, field)] = counts
        hist[field] = tuple(map(sum, zip(*parts))) if parts else ()
    return PoolSample(
        t=now, serving=len(stats), starting=starting,
        running=sum(s.num_requests_running for s in known),
        waiting=sum(s.num_requests_waiting for s in known),
        queued_prompt_tokens=sum(s.num_prompt_tokens_queued for s in known),
        kv_usage=sum(s.kv_cache_usage_perc for s in known) / max(1, len(known)),
        ttft=hist["ttft"], itl=hist["itl"])


@dataclass(frozen=True)
class Decision:
    replicas: int                       # the pool's target after this plan
    action: str                         # "up", "down" or "hold"
    reason: str                         # in words, for the log and `pdserve status`
    wish: int                           # what the targets asked for at this plan


class Planner:
    """The planner of one pool. `observe` each sample, then `plan(target, now)`."""

    def __init__(self, spec: AutoscalingSpec) -> None:
        self.spec = spec
        self.samples: deque[PoolSample] = deque()
        self.wishes: deque[tuple[float, int]] = deque()    # (t, wish) of the plans of the streak
        self.streak = 0                  # which way the plans of the streak wanted: 1 up, -1 down, 0 neither
        self.streak_start = 0.0          # when that began
        self.last_change: float | None = None

    def observe(self, sample: PoolSample) -> None:
        self.samples.append(sample)
        keep = max(self.spec.window_s, self.spec.upscale_delay_s, self.spec.downscale_delay_s)
        while self.samples and self.samples[0].t < sample.t - keep:
            self.samples.popleft()

    def changed(self, now: float) -> None:
        """The pool's size was changed by hand (`pdserve scale`): a new start for the cooldown."""
        self.last_change = now
        self.wishes.clear()

    def wish(self, target: int, now: float) -> tuple[int, str]:
        """(replicas the targets ask for, why) from the samples of the window."""
        s = self.spec
        window = [x for x in self.samples if x.t > now - s.window_s]
        if not window:
            return target, "no samples"
        last = window[-1]
        wishes: list[tuple[int, str]] = []
        if s.target_running_requests is not None:
            load = last.running + last.waiting
            wishes.append((math.ceil(load / s.target_running_requests),
                           f"{load} requests running or waiting / {s.target_running_requests:g} per replica"))
        if s.target_queued_prompt_tokens is not None:
            load = last.queued_prompt_tokens
            wishes.append((math.ceil(load / s.target_queued_prompt_tokens),
                           f"{load} queued prompt tokens / {s.target_queued_prompt_tokens} per replica"))
        if s.target_kv_usage is not None:
            used = last.kv_usage * last.serving
            wishes.append((math.ceil(used / s.target_kv_usage - 1e-9),
                           f"KV usage {last.kv_usage:.0%} on {last.serving} / {s.target_kv_usage:.0%} per replica"))
        for name, slo_ms, field in (("TTFT", s.ttft_slo_ms, "ttft"), ("ITL", s.itl_slo_ms, "itl")):
            if slo_ms is None:
                continue
            p90 = quantile(merge(getattr(x, field) for x in window if getattr(x, field)), 0.9)
            if p90 is None:
                wishes.append((target - 1, f"{name}: nothing measured in {s.window_s:g} s"))
            elif p90 * 1e3 > slo_ms:
                wishes.append((target + 1, f"{name} p90 {p90 * 1e3:.0f} ms > {slo_ms:g} ms"))
            elif p90 * 1e3 < s.downscale_ratio * slo_ms:
                wishes.append((target - 1, f"{name} p90 {p90 * 1e3:.0f} ms < {s.downscale_ratio:g} x {slo_ms:g} ms"))
            else:
                wishes.append((target, f"{name} p90 {p90 * 1e3:.0f} ms within {slo_ms:g} ms"))
        if not wishes:                  # (a pool that only scales to zero and back)
            return target, "no targets"
        n, why = max(wishes, key=lambda w: w[0])
        # (never below one: a pool that scales to zero goes there when idle, cluster/scale_to_zero.py)
        return min(max(n, s.min_replicas, 1), s.max_replicas), why

    def plan(self, target: int, now: float) -> Decision:
        """The decision at `now` for a pool whose target is `target` replicas."""
        s = self.spec
        wish, why = self.wish(target, now)
        direction = (wish > target) - (wish < target)
        if direction != self.streak or not self.wishes:      # a new run of plans wanting the same way
            self.streak, self.streak_start = direction, now
            self.wishes.clear()
        self.wishes.append((now, wish))
        last = self.samples[-1] if self.samples else None
        if target < s.min_replicas or target > s.max_replicas:       # bounds changed under it
            return self._change(min(max(target, s.min_replicas), s.max_replicas), target, now, wish,
                                f"outside min_replicas..max_replicas ({s.min_replicas}..{s.max_replicas})")
        if direction == 0:
            return Decision(target, "hold", why, wish)
        if self.last_change is not None and now - self.last_change < s.cooldown_s:
            return Decision(target, "hold", f"cooling down ({why})", wish)
        if last is not None and last.starting > 0:
            return Decision(target, "hold", f"{last.starting} replica(s) starting ({why})", wish)
        delay = s.upscale_delay_s if direction > 0 else s.downscale_delay_s
        if now - self.streak_start < delay - 1e-9:
            return Decision(target, "hold", f"stabilizing ({why})", wish)
        recent = [w for t, w in self.wishes if t >= now - delay - 1e-9]
        return self._change(min(recent) if direction > 0 else max(recent), target, now, wish, why)

    def _change(self, replicas: int, target: int, now: float, wish: int, why: str) -> Decision:
        self.last_change = now
        self.wishes.clear()         # wishes about the old size: the next change waits a full delay
        return Decision(replicas, "up" if replicas > target else "down", why, wish)
