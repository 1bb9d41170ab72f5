"""ClusterManager: the named actor that owns the pools, so every ingress replica and the launcher
find the same engines (`get_or_create_manager`).

Its constructor only records the spec (an actor whose constructor fails tells its callers nothing
useful); the first `ready()` or `status()` starts the pools: it checks that the Ray cluster can hold
them (cluster/placement.py), creates the replicas, waits for Ray to place each one within the
placement timeout (else the start fails naming the resource) and for its model to load. A start that
fails is reported by `status()` and raised by `ready()` as StartupError with the reason. Once up, it
health-checks the pools every `health_check_period_s` (or at once when an ingress reports a replica
that failed it) and replaces dead replicas. Ingress replicas follow the membership with a long poll
(`membership(version, wait_s)`), so a dropped replica stops getting requests and a replacement
starts getting them without a restart of the ingress.

It runs on the head node, and Ray restarts it when its process dies (`get_or_create_manager`). The
replicas are detached actors, so they outlive it: a restarted manager adopts the live replicas of
its spec (`EnginePool.adopt`) instead of starting the pools, and heals on from there.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from cluster.config import ClusterConfig
from cluster.placement import check_placement
from cluster.pool import EnginePool
from records.errors import StartupError

MANAGER_NAME = "pdserve-manager"
# The resource Ray gives the head node alone.
HEAD_NODE_RESOURCE = "node:__internal_head__"
# Beyond the placement timeout, the time a placed replica's worker process may take to start (a
# loaded machine starts a Python worker in seconds, not minutes).
ACTOR_START_GRACE_S = 30.0
logger = logging.getLogger(__name__)



class ClusterManager:
    def __init__(self, config: ClusterConfig, health_check_period_s: float = 2.0,
                 check_placement_timeout_s: float | None = None) -> None:
        """`check_placement_timeout_s`: how long the start waits for the cluster to hold the pools
        (by default the spec's placement_timeout_s; 0 on a local Ray, which never grows)."""
        self.config = config
        self.health_check_period_s = health_check_period_s
        self.placement_timeout_s = (config.placement_timeout_s if check_placement_timeout_s is None
                                    else check_placement_timeout_s)
        # Membership versions grow across restarts of this actor too (an ingress that saw version v
        # of the manager before never mistakes a newer view for the one it has).
        self.version = time.time_ns() // 1000
        self.phase = "starting"              # starting -> ready | failed
        self.reason: str | None = None       # why it failed
        self._startup: asyncio.Task | None = None
        self._changed: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._monitor: asyncio.Task | None = None
        self.pools = {name: EnginePool(name, spec, config.engine_config(name), config.name,
                                       on_change=self._bump)
                      for name, spec in config.pools.items()}

    async def ready(self) -> dict[str, list[dict]]:
        """Start the pools if not yet started and wait until every replica has loaded; pool ->
        replica infos. Raises StartupError when they cannot start."""
        await asyncio.shield(self._start())
        if self.phase == "failed":
            raise StartupError(self.reason)
        return {name: [await h.info.remote() for h in pool.replicas.values()] for name, pool in self.pools.items()}

    async def status(self) -> dict[str, Any]:
        """Where the start stands without waiting: {"phase": starting | ready | failed, "reason"}."""
        self._start()
        return {"phase": self.phase, "reason": self.reason, "pools": self.pool_status()}

    def _start(self) -> asyncio.Task:
        if self._startup is None:
            self._startup = asyncio.get_running_loop().create_task(self._start_up())
        return self._startup

    async def _start_up(self) -> None:
        try:
            # A manager that restarted (its process or node died) or was made again finds the
            # replicas of its spec alive (they are detached) and takes them over; the health checks
            # replace the rest. Only a cluster with none starts its pools.
            adopted = [r for pool in self.pools.values() for r in await pool.adopt()]
            if adopted:
                self.phase = "ready"
                self._changed, self._wake = asyncio.Event(), asyncio.Event()
                self._wake.set()                                 # check (and refill) the pools now
                self._monitor = asyncio.get_running_loop().create_task(self._check_forever())
                return
            await asyncio.to_thread(check_placement, self.config, self.placement_timeout_s)
            for pool in self.pools.values():
                pool.start()
            await asyncio.gather(*[pool.wait_ready(self.placement_timeout_s + ACTOR_START_GRACE_S)
                                   for pool in self.pools.values()])
        except Exception as e:  # noqa: BLE001 - reported by status() and ready()
            cause = getattr(e, "cause", None) or e          # what a replica raised, not Ray's wrapper
            self.phase, self.reason = "failed", f"{type(cause).__name__}: {cause}"
            logger.error("the pools failed to start: %s", self.reason)
            for pool in self.pools.values():
                pool.shutdown()
            return
        self.phase = "ready"
        self._changed, self._wake = asyncio.Event(), asyncio.Event()
        self._monitor = asyncio.get_running_loop().create_task(self._check_forever())

    def _bump(self) -> None:
        self.version += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _check_forever(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.health_check_period_s)
            self._wake.clear()
            for pool in self.pools.values():
                try:
                    await pool.check_health()
                except Exception:
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
        `wait_s` for a change first. A manager that just restarted answers once it has adopted
        its replicas (never with empty pools meanwhile)."""
        await asyncio.shield(self._start())
        if version == self.version and wait_s > 0 and self._changed is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait_s)
        return self.version, {name: dict(pool.replicas) for name, pool in self.pools.items()}

    def pool_status(self) -> dict[str, dict[str, Any]]:
        return {name: {"replicas": sorted(pool.replicas), "starting": sorted(pool.starting),
                       "draining": sorted(pool.draining), "replaced": pool.replaced, "target": pool.target}
                for name, pool in self.pools.items()}

    async def scale(self, pool: str, replicas: int, drain_timeout_s: float = 60.0) -> dict[str, Any]:
        """Resize a pool by hand (`pdserve scale`): replicas join when loaded; those removed are
        drained (out of routing at once, killed once their requests and leases end or after
        `drain_timeout_s`, when their streams migrate). Returns what it did."""
        if pool not in self.pools:
            raise ValueError(f"pool must be one of {sorted(self.pools)}; got {pool!r}")
        if drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0; got {drain_timeout_s}")
        await asyncio.shield(self._start())
        if self.phase != "ready":
            raise StartupError(f"the pools are not serving ({self.phase}: {self.reason})")
        return await self.pools[pool].scale(replicas, drain_timeout_s)

    async def shutdown(self, drain_s: float = 0.0) -> None:
        """Stop checking, let running requests finish for up to `drain_s`, then kill every replica."""
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
        if drain_s > 0:
            await asyncio.gather(*[pool.drain(drain_s) for pool in self.pools.values()])
        for pool in self.pools.values():
            pool.shutdown()


def get_or_create_manager(config: ClusterConfig) -> Any:
    """The cluster's manager actor, created on first call (namespace = config.name).

    It runs on the head node (whose loss is the Ray cluster's: the GCS lives there), and Ray
    restarts it whenever its process dies; the restarted actor adopts the pools' replicas
    (`ClusterManager._start_up`). Calls made while it restarts wait for it."""
    return ray.remote(ClusterManager).options(
        name=MANAGER_NAME, namespace=config.name, get_if_exists=True, lifetime="detached",
        num_cpus=0, resources={HEAD_NODE_RESOURCE: 0.001}, max_restarts=-1, max_task_retries=-1,
        max_concurrency=1000).remote(config)


@dataclass(frozen=True)
class ManagerLink:
    """How an ingress replica reaches the cluster's manager: `link()` is its handle, the actor
    created on first use (namespace = the spec's name). The launcher hands it to the ingress
    (cluster/app.py), so that router/ never imports cluster/; it travels as the spec's JSON."""
    config_json: str

    def __call__(self) -> Any:
        return get_or_create_manager(ClusterConfig.model_validate_json(self.config_json))
