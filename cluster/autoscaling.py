"""A model's pools sized by their planners, and room asked of Ray's autoscaler (what the manager
runs at each health check; cluster/planner.py is one pool's pure, replayable planner).

Pools with `autoscaling` have a planner: at each health check it reads what the replicas reported,
decides, and the pool is resized; its decisions are logged with their reason and counted (the
manager's `pool_status()` shows them). Whenever a pool's size changes, Ray's autoscaler is asked for
room for every pool's replicas (`request_resources`), and so is a model waiting for room: on a
cluster that grows (KubeRay's in-tree autoscaler), a replica that does not fit brings a node up.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from cluster.placement import replica_bundles
from cluster.planner import Planner, PoolSample, sample_pool

if TYPE_CHECKING:
    from cluster.config import PoolSpec
    from cluster.pool import EnginePool

logger = logging.getLogger(__name__)


class Autoscaling:
    """The planners of one model's autoscaled pools, their last decisions and the changes made."""

    def __init__(self) -> None:
        self.planners: dict[str, Planner] = {}
        self.decisions: dict[str, dict] = {}      # pool -> the planner's last decision
        self.decision_counts: Counter = Counter()  # (pool, action) -> changes made
        self._hist_seen: dict[tuple[str, str], list[int]] = {}

    def configure(self, pools: dict[str, PoolSpec]) -> None:
        """A planner per autoscaled pool of this spec (one whose targets did not change keeps its
        samples and streak)."""
        self.planners = {name: (self.planners[name] if name in self.planners
                                and self.planners[name].spec == spec.autoscaling else Planner(spec.autoscaling))
                         for name, spec in pools.items() if spec.autoscaling is not None}

    def changed(self, pool: str, now: float) -> None:
        """The pool was resized by hand (`pdserve scale`): a new start for its planner's cooldown."""
        if pool in self.planners:
            self.planners[pool].changed(now)

    def sample(self, pool: EnginePool, now: float) -> PoolSample:
        """What the pool's serving replicas reported at the last health check, as one sample."""
        return sample_pool(now, pool.engine_stats(),
                           len(pool.starting) + len(pool.incoming), self._hist_seen)

    async def plan(self, pools: dict[str, EnginePool], now: float, drain_timeout_s: float) -> bool:
        """One plan of every autoscaled pool, acted on; whether a pool was resized."""
        resized = False
        for name, planner in self.planners.items():
            if name not in pools:
                continue
            pool = pools[name]
            planner.observe(self.sample(pool, now))
            if pool.target == 0:            # scaled to zero: only a request brings it back (`activate`)
                continue
            decision = planner.plan(pool.target, now)
            self.decisions[name] = {**asdict(decision), "t": time.time()}
            if decision.action == "hold":
                continue
            logger.warning("planner: pool %s %s from %d to %d replicas: %s", name, decision.action,
                           pool.target, decision.replicas, decision.reason)
            self.decision_counts[(name, decision.action)] += 1
            await pool.scale(decision.replicas, drain_timeout_s)
            resized = True
        return resized

    def status(self, pool: str) -> dict[str, Any] | None:
        """The pool's planner's last decision and the changes it made (None: not autoscaled)."""
        if pool not in self.planners:
            return None
        return {"last": self.decisions.get(pool),
                "decisions": {a: self.decision_counts[(pool, a)] for a in ("up", "down")}}


# Ray's KV namespace where each manager keeps the bundles it asks the autoscaler for.
ROOM_NAMESPACE = "pdserve-room"


def request_room(owner: str, pools: dict[str, EnginePool], simulated: bool) -> None:
    """Ask Ray's autoscaler for room for every pool's target replicas (none: `owner` asks for
    nothing more; a Ray without an autoscaler: the pending actors wait, and that is logged).

    Ray keeps one request for the whole cluster, a floor on its size that each call replaces: so
    that the models of one cluster (a manager each) do not take back each other's room, each
    manager keeps its bundles in Ray's KV under its own name (`owner`; from its start, and while
    it waits for room) and asks for everyone's."""
    bundles = [b for pool in pools.values() for _ in range(pool.target) for b in replica_bundles(pool.spec, simulated)]
    try:
        from ray.autoscaler.sdk import request_resources  # noqa: PLC0415 - the autoscaler's SDK, here only
        from ray.experimental.internal_kv import (  # noqa: PLC0415
            _internal_kv_del,
            _internal_kv_get,
            _internal_kv_list,
            _internal_kv_put,
        )

        if bundles:
            _internal_kv_put(owner, json.dumps(bundles), overwrite=True, namespace=ROOM_NAMESPACE)
        else:
            _internal_kv_del(owner, namespace=ROOM_NAMESPACE)
        everyone = [b for key in _internal_kv_list("", namespace=ROOM_NAMESPACE)
                    for b in json.loads(_internal_kv_get(key, namespace=ROOM_NAMESPACE) or "[]")]
        request_resources(bundles=everyone)
    except Exception as e:  # noqa: BLE001 - a Ray without an autoscaler: the pending actors wait
        logger.warning("asking the autoscaler for %d bundles failed: %s", len(bundles), e)
