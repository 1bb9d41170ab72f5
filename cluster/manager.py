"""ClusterManager: the named actor that owns the pools, so every ingress replica and the launcher
find the same engines (`get_or_create_manager`).

It checks that the Ray cluster can hold the pools before creating them (cluster/placement.py), then
health-checks the pools every `health_check_period_s` (or at once when an ingress reports a replica
that failed it) and replaces dead replicas. Ingress replicas follow the membership with a long poll
(`membership(version, wait_s)`), so a dropped replica stops getting requests and a replacement
starts getting them without a restart of the ingress.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import ray

from cluster.config import ClusterConfig
from cluster.placement import check_placement
from cluster.pool import EnginePool, engine_config_for

MANAGER_NAME = "pdserve-manager"
logger = logging.getLogger(__name__)


class ClusterManager:
    def __init__(self, config: ClusterConfig, health_check_period_s: float = 2.0,
                 check_placement_timeout_s: float | None = None) -> None:
        """Raises PlacementError when the cluster cannot hold the pools (after waiting
        `check_placement_timeout_s`, by default the spec's placement_timeout_s)."""
        check_placement(config, check_placement_timeout_s)
        self.config = config
        self.health_check_period_s = health_check_period_s
        self.version = 0
        self._changed: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._monitor: asyncio.Task | None = None
        self.pools = {name: EnginePool(name, spec, engine_config_for(config, name), config.name,
                                       on_change=self._bump)
                      for name, spec in config.pools.items()}
        for pool in self.pools.values():
            pool.start()

    def _bump(self) -> None:
        self.version += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def ready(self) -> dict[str, list[dict]]:
        """Wait until every replica has loaded; starts the health checks."""
        out = {name: await pool.wait_ready() for name, pool in self.pools.items()}
        if self._monitor is None:
            self._changed, self._wake = asyncio.Event(), asyncio.Event()
            self._monitor = asyncio.get_running_loop().create_task(self._check_forever())
        return out

    async def _check_forever(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.health_check_period_s)
            self._wake.clear()
            for pool in self.pools.values():
                try:
                    await pool.check_health()
                except Exception:  # noqa: BLE001 - keep checking
                    logger.exception("health check of pool %s failed", pool.name)

    async def check_health(self) -> dict[str, list[str]]:
        """Run one health check of every pool now; pool -> replica ids dropped."""
        return {name: await pool.check_health() for name, pool in self.pools.items()}

    def report_failure(self, replica_id: str) -> None:
        """An ingress saw this replica fail a call: check the pools now rather than at the next period."""
        logger.warning("replica %s reported failing", replica_id)
        if self._wake is not None:
            self._wake.set()

    def replicas(self, pool: str) -> dict[str, Any]:
        """Replica id -> actor handle of one pool (the ones serving)."""
        if pool not in self.pools:
            raise ValueError(f"pool must be one of {sorted(self.pools)}; got {pool!r}")
        return dict(self.pools[pool].replicas)

    async def membership(self, version: int = -1, wait_s: float = 0.0) -> tuple[int, dict[str, dict[str, Any]]]:
        """(version, pool -> replica id -> handle). A long poll: when `version` is current, wait up to
        `wait_s` for a change first."""
        if version == self.version and wait_s > 0 and self._changed is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait_s)
        return self.version, {name: dict(pool.replicas) for name, pool in self.pools.items()}

    def pool_status(self) -> dict[str, dict[str, Any]]:
        return {name: {"replicas": sorted(pool.replicas), "starting": sorted(pool.starting),
                       "replaced": pool.replaced, "target": pool.spec.replicas}
                for name, pool in self.pools.items()}

    async def shutdown(self, drain_s: float = 0.0) -> None:
        """Stop checking, let running requests finish for up to `drain_s`, then kill every replica."""
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
        if drain_s > 0:
            await asyncio.gather(*[pool.drain(drain_s) for pool in self.pools.values()])
        for pool in self.pools.values():
            pool.shutdown()


def get_or_create_manager(config: ClusterConfig) -> Any:
    """The cluster's manager actor, created on first call (namespace = config.name)."""
    return ray.remote(ClusterManager).options(
        name=MANAGER_NAME, namespace=config.name, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_concurrency=1000).remote(config)
