"""A model scaled to zero when idle and brought back by its next request (autoscaling's
`min_replicas: 0` on every pool of a model; cluster/config.py says the fields).

The manager watches its model's activity at every health check (`IdleWatch`: a request running or
waiting on any replica, or a replica's token counters moving, is activity) and, after
`idle_timeout_s` without any, scales every pool to zero: each replica drains and stops. (A request
held in an ingress's queue is activity it cannot see: if the model goes to zero under it, that
request brings it back as any other does.)

Back from zero: an ingress with no replica for a request calls `ClusterManager.activate`, which
starts one replica per pool (`ScaleToZero.activate`: callers share one start) and returns once each pool
serves; the ingress holds the request meanwhile, up to `cold_start_timeout_s`, and answers 503 with
Retry-After if the model cannot come up in time.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from records.engine_stats import EngineStats
from records.errors import StartupError
from records.single_flight import SingleFlight

if TYPE_CHECKING:
    from cluster.config import PoolSpec
    from cluster.pool import EnginePool

logger = logging.getLogger(__name__)


class IdleWatch:
    """When a model last showed activity, from its replicas' stats."""

    def __init__(self, idle_timeout_s: float, now: float | None = None) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.last_active = time.monotonic() if now is None else now
        self._counters: dict[str, float] = {}

    def observe(self, stats: dict[str, EngineStats | None], now: float) -> bool:
        """Record one health check's stats (replica id -> its stats, None if it did not answer);
        True once the model has been idle for `idle_timeout_s`."""
        counters = {}
        for replica, s in stats.items():
            if s is None:
                continue
            counters[replica] = s.prompt_tokens + s.generation_tokens     # (cumulative: moving is activity)
            if s.num_requests_running or s.num_requests_waiting:
                self.last_active = now
        if any(self._counters.get(r) != c for r, c in counters.items() if r in self._counters):
            self.last_active = now
        self._counters = counters
        return now - self.last_active >= self.idle_timeout_s

    def touch(self, now: float) -> None:
        """Activity the stats do not show (the model was just brought back)."""
        self.last_active = now


class ScaleToZero:
    """A model's way to zero and back: its idle watch and the one start from zero under way."""

    def __init__(self, idle_timeout_s: float, cold_start_timeout_s: float) -> None:
        self.idle = IdleWatch(idle_timeout_s)
        self.cold_start_timeout_s = cold_start_timeout_s
        self._starting: SingleFlight[None] = SingleFlight()
        self.last_cold_start_s: float | None = None

    @classmethod
    def of(cls, pools: dict[str, PoolSpec]) -> ScaleToZero | None:
        """For a model whose pools scale to zero (every one: the spec checks), else None."""
        specs = [spec.autoscaling for spec in pools.values() if spec.scales_to_zero]
        if not specs:
            return None
        return cls(min(a.idle_timeout_s for a in specs), max(a.cold_start_timeout_s for a in specs))

    async def check(self, pools: dict[str, EnginePool], now: float, drain_timeout_s: float) -> bool:
        """One health check's look: scale every pool to zero (their replicas drain) once the model
        has been idle long enough; True when it did."""
        if self._starting.running:
            return False
        stats = {r: s for pool in pools.values() for r, s in pool.engine_stats().items()}
        if not self.idle.observe(stats, now) or not any(pool.target for pool in pools.values()):
            return False
        logger.warning("idle for %.0f s: scaling every pool to zero", now - self.idle.last_active)
        for pool in pools.values():
            await pool.scale(0, drain_timeout_s)
        return True

    async def activate(self, pools: dict[str, EnginePool], resized: Callable[[], None], drain_timeout_s: float) -> None:
        """Start one replica in every pool at zero and return once every pool serves (callers
        share one start); StartupError after `cold_start_timeout_s`."""
        if all(pool.replicas for pool in pools.values()):
            return
        await self._starting.run(lambda: self._activate(pools, resized, drain_timeout_s))

    async def _activate(self, pools: dict[str, EnginePool], resized: Callable[[], None], drain_timeout_s: float
                        ) -> None:
        began = time.monotonic()
        for pool in pools.values():
            if pool.target == 0:
                await pool.scale(1, drain_timeout_s)
        resized()
        while not all(pool.replicas for pool in pools.values()):
            if time.monotonic() - began > self.cold_start_timeout_s:
                raise StartupError(f"no replica came up within {self.cold_start_timeout_s:g} s "
                                   f"(autoscaling.cold_start_timeout_s)")
            await asyncio.sleep(0.1)
        self.last_cold_start_s = time.monotonic() - began
        self.idle.touch(time.monotonic())
        logger.warning("started from zero in %.1f s", self.last_cold_start_s)
