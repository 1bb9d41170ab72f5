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

The spec it serves is the last one applied (`apply`, which every ingress replica and the launcher
call with theirs: a stale manager is never silently reused); a changed spec is reconciled in place
(cluster/reconcile.py). The spec and the pools' sizes are kept in Ray's internal KV (the GCS), so a
restarted manager serves what was last applied and scaled. In a spec of several models each model
has a manager of its own (namespace `<name>-<model>`), which starts its pools only once they all
fit what the nodes have free (cluster/placement.py: `wait_for_room`); the model's sleep
(cluster/sleep.py) and its scaling to zero when idle (cluster/scale_to_zero.py) are its manager's.
Pools with `autoscaling` are sized by their planners at each health check, and every change of a
pool's size asks Ray's autoscaler for room (cluster/autoscaling.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from cluster.autoscaling import Autoscaling, request_room
from cluster.config import ClusterConfig
from cluster.placement import check_placement, wait_for_room
from cluster.pool import EnginePool
from cluster.reconcile import reconcile_pools
from cluster.scale_to_zero import ScaleToZero
from cluster.sleep import ModelSleep
from cluster.weights import ModelWeights
from engine.executor.ray_cluster import HEAD_NODE_RESOURCE
from records.config import EngineConfig
from records.errors import StartupError

MANAGER_NAME = "pdserve-manager"
# Beyond the placement timeout, the time a placed replica's worker process may take to start (a
# loaded machine starts a Python worker in seconds, not minutes).
ACTOR_START_GRACE_S = 30.0
# Where the manager keeps the spec last applied and the pools' sizes (Ray's internal KV, namespace =
# the spec's name).
STATE_KEY = b"pdserve-manager-state"
logger = logging.getLogger(__name__)


def fingerprint(config: ClusterConfig) -> str:
    """A short digest of a whole spec: equal specs, equal fingerprints (whatever order their
    mappings were written in: a spec read back from YAML has its keys sorted)."""
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]


class ClusterManager:
    def __init__(self, config: ClusterConfig, health_check_period_s: float = 2.0,
                 check_placement_timeout_s: float | None = None,
                 engine_configs: dict[str, EngineConfig] | None = None) -> None:
        """`check_placement_timeout_s`: how long the start waits for the cluster to hold the pools
        (by default the spec's placement_timeout_s; 0 on a local Ray, which never grows).
        `engine_configs`: `config`'s pools' engine configs, where the creator resolved them already
        (`get_or_create_manager`)."""
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
        self._spawned = False                # the pools' replicas were started (or adopted)
        self._changed: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._monitor: asyncio.Task | None = None
        self._apply_lock: asyncio.Lock | None = None
        self.updating: str | None = None         # what an `apply` under way does, in words
        self.pools: dict[str, EnginePool] = {}
        self.autoscaling = Autoscaling()
        self.sleeping = ModelSleep()
        self.weights_state = ModelWeights()       # a trainer's updates, pause and resume (cluster/weights.py)
        self.to_zero: ScaleToZero | None = None   # set when the model scales to zero (`_configure`)
        # A manager Ray restarted serves the spec last applied, at the sizes last set.
        stored = _load_state(config.name)
        try:
            spec = ClusterConfig.model_validate_json(stored["spec"]) if stored else config
            self._configure(spec, engine_configs if fingerprint(spec) == fingerprint(config) else None)
        except ValueError as e:     # a spec of another pdserve version: start from the one given
            logger.warning("not using the stored spec: %s", e)
            stored = None
            self._configure(config, engine_configs)
        for name, target in (stored or {}).get("targets", {}).items():
            if name in self.pools:
                self.pools[name].target = target

    def _configure(self, config: ClusterConfig, engine_configs: dict[str, EngineConfig] | None = None) -> None:
        """Take `config` as the spec, with pools not started yet (`engine_configs`: its pools' engine
        configs, resolved already; else resolved here)."""
        self.config = config
        self.fingerprint = fingerprint(config)
        resolved = engine_configs or {}
        self.pools = {name: EnginePool(name, spec, resolved.get(name) or config.engine_config(name), config.name,
                                       on_change=self._bump)
                      for name, spec in config.pools.items()}
        for pool in self.pools.values():
            pool.after_load = self.weights_state.on_join
        self.autoscaling.configure(config.pools)
        self.to_zero = ScaleToZero.of(config.pools)

    async def ready(self, spec_json: str | None = None) -> dict[str, list[dict]]:
        """Start the pools if not yet started and wait until every replica has loaded; pool ->
        replica infos. Raises StartupError when they cannot start. `spec_json`: the spec the caller
        serves, applied first (`apply`)."""
        if spec_json is not None:
            await self.apply(spec_json)
        await asyncio.shield(self._start())
        if self.phase == "failed":
            raise StartupError(self.reason)
        return {name: [await h.info.remote() for h in pool.replicas.values()] for name, pool in self.pools.items()}

    async def status(self) -> dict[str, Any]:
        """Where the start stands without waiting: {"phase": waiting (for room) | starting | ready |
        failed, "reason", "placed" (every replica has a node), "pools"}."""
        self._start()
        # (not before the replicas were started: the launcher's next model would take their room)
        placed = self._spawned and all(pool.placed for pool in self.pools.values())
        return {"phase": self.phase, "reason": self.reason, "placed": placed, "pools": self.pool_status()}

    async def start(self) -> str:
        """Start the pools if they have not started, without waiting for them; the phase. The
        launcher calls it as soon as the spec is applied, so that the replicas load while Serve and
        the ingress come up (an ingress would start them only once it runs)."""
        self._start()
        return self.phase

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
                self.phase, self._spawned = "ready", True
                self._changed, self._wake = asyncio.Event(), asyncio.Event()
                self._wake.set()                                 # check (and refill) the pools now
                self._monitor = asyncio.get_running_loop().create_task(self._check_forever())
                return
            await asyncio.to_thread(check_placement, self.config, self.placement_timeout_s)
            if self.config.app is not None:         # one model of several: all its pools, or wait
                await wait_for_room(self.config, self._waiting)
                self.phase, self.reason = "starting", None
            # Its room, in the autoscaler's floor for the cluster (with every other model's).
            request_room(self.config.name, self.pools, self.config.engine.simulate is not None)
            for pool in self.pools.values():
                pool.start()
            self._spawned = True
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
        if self.to_zero is not None:            # (idle from now on, not from the spec's arrival)
            self.to_zero.idle.touch(time.monotonic())
        self._changed, self._wake = asyncio.Event(), asyncio.Event()
        self._monitor = asyncio.get_running_loop().create_task(self._check_forever())

    def _waiting(self, why: str) -> None:
        if self.phase != "waiting":     # (a node for it, where the cluster can grow)
            request_room(self.config.name, self.pools, self.config.engine.simulate is not None)
        self.phase, self.reason = "waiting", why

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
            for pool in list(self.pools.values()):
                try:
                    await pool.check_health()
                except Exception:
                    logger.exception("health check of pool %s failed", pool.name)
            try:
                if self.updating is None and await self.autoscaling.plan(self.pools, time.monotonic(),
                                                                         self.config.drain_timeout_s):
                    self._resized()
                if self.to_zero is not None and self.updating is None:
                    if await self.to_zero.check(self.pools, time.monotonic(), self.config.drain_timeout_s):
                        self._resized()
            except Exception:
                logger.exception("planning failed")

    def _resized(self) -> None:
        """After a pool's size changed: remember it, and ask the autoscaler for room."""
        _save_state(self.config.name, self.config, {n: p.target for n, p in self.pools.items()})
        request_room(self.config.name, self.pools, self.config.engine.simulate is not None)

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
        """Pool -> its replicas by state, target, bounds, replicas replaced, every replica's detail
        (`EnginePool.replica_status`) and, when autoscaled, the planner's last decision and counts."""
        out = {}
        for name, pool in self.pools.items():
            st = {"replicas": sorted(pool.replicas), "starting": sorted([*pool.starting, *pool.incoming]),
                  "draining": sorted(pool.draining), "replaced": pool.replaced, "drained": dict(pool.drained),
                  "target": pool.target,
                  "bounds": list(pool.spec.bounds()), "detail": pool.replica_status()}
            planner = self.autoscaling.status(name)
            if planner is not None:
                st["planner"] = planner
            out[name] = st
        return out

    def describe(self) -> dict[str, Any]:
        """`pdserve status`: the spec's name and fingerprint, the phase, an update under way, the pools."""
        serving = self.config.serving
        return {"name": self.config.name, "app": self.config.app or self.config.name,
                "models": self.config.serving.served_model_names, "fingerprint": self.fingerprint, "phase": self.phase,
                "reason": self.reason, "updating": self.updating, "mode": self.config.mode,
                "sleep_level": self.sleeping.level, **self.weights_state.state(),
                "tracing": {"otlp_traces_endpoint": serving.otlp_traces_endpoint, "log_requests": serving.log_requests},
                "pools": self.pool_status()}

    # --- scale to zero (cluster/scale_to_zero.py) --------------------------------------------------
    async def activate(self) -> dict[str, dict[str, Any]]:
        """Bring a model scaled to zero back (one replica per pool; callers share one start);
        the pools' membership once every pool serves, as `membership` gives it."""
        await self._serving_replicas()
        if self.to_zero is not None:
            await self.to_zero.activate(self.pools, self._resized, self.config.drain_timeout_s)
        return (await self.membership())[1]

    # --- sleep and wake (cluster/sleep.py) ---------------------------------------------------------
    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Put every replica of every pool to sleep (ValueError when one is busy: none sleeps)."""
        return await self.sleeping.sleep(await self._serving_replicas(), level)

    async def wake(self) -> dict[str, Any]:
        """Wake every replica (a no-op for those awake); how long it took. Their weights are the
        checkpoint's, or the last update from disk (cluster/weights.py: `woken`)."""
        replicas = await self._serving_replicas()
        asleep = self.sleeping.level > 0
        out = await self.sleeping.wake(replicas)
        if asleep:
            await self.weights_state.woken(replicas)
        return out

    def is_sleeping(self) -> dict[str, Any]:
        return {"is_sleeping": self.sleeping.level > 0, "level": self.sleeping.level}

    # --- weights (RL: cluster/weights.py) ---------------------------------------------------------
    async def weights(self, op: str, *args: Any) -> Any:
        """ModelWeights' `op` over every replica of every pool (ValueError naming a refusal)."""
        return await self.weights_state.call(await self._serving_replicas() if op != "state" else {}, op, *args)

    async def _serving_replicas(self) -> dict[str, Any]:
        await asyncio.shield(self._start())
        if self.phase != "ready":
            raise StartupError(f"the pools are not serving ({self.phase}: {self.reason})")
        return {r: h for pool in self.pools.values() for r, h in pool.replicas.items()}

    async def scale(self, pool: str, replicas: int, drain_timeout_s: float = 60.0) -> dict[str, Any]:
        """Resize a pool by hand (`pdserve scale`): replicas join when loaded; those removed are
        drained (out of routing at once, killed once their requests and leases end or after
        `drain_timeout_s`, when their streams migrate). Returns what it did."""
        if pool not in self.pools:
            raise ValueError(f"pool must be one of {sorted(self.pools)}; got {pool!r}")
        if drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0; got {drain_timeout_s}")
        lo, hi = self.pools[pool].spec.bounds()
        if not lo <= replicas <= hi:
            raise ValueError(f"replicas must be within {lo}..{hi} for pool {pool!r} (its spec's bounds: "
                             f"autoscaling min_replicas..max_replicas, else 1..64); got {replicas}")
        await asyncio.shield(self._start())
        if self.phase != "ready":
            raise StartupError(f"the pools are not serving ({self.phase}: {self.reason})")
        out = await self.pools[pool].scale(replicas, drain_timeout_s)
        self.autoscaling.changed(pool, time.monotonic())
        self._resized()
        return out

    # --- spec updates -------------------------------------------------------------------------------
    async def apply(self, spec_json: str) -> dict[str, Any]:
        """Serve this spec from now on (what an ingress replica or the launcher calls with its own).
        The same spec does nothing; before the pools start it replaces the spec; once they serve,
        it reconciles them in place (the module's docstring). Returns what it did."""
        new = ClusterConfig.model_validate_json(spec_json)
        if new.name != self.config.name:
            raise ValueError(f"name must be {self.config.name!r} (this manager's); got {new.name!r}")
        if self._apply_lock is None:
            self._apply_lock = asyncio.Lock()
        new_fp = fingerprint(new)
        async with self._apply_lock:
            old_fp = self.fingerprint
            if new_fp == old_fp:
                return {"changed": False, "fingerprint": old_fp}
            logger.warning("spec %s replaces spec %s", new_fp, old_fp)
            self.weights_state.disk = {}        # replicas it starts load its checkpoint (cluster/weights.py)
            if self._startup is None or self.phase == "failed":      # no pools serve yet
                self._configure(new)
                self._startup, self.phase, self.reason, self._spawned = None, "starting", None, False
                _save_state(new.name, new, {n: p.target for n, p in self.pools.items()})
                return {"changed": True, "from": old_fp, "fingerprint": self.fingerprint, "pools": {}}
            await asyncio.shield(self._startup)
            self.updating = f"applying spec {new_fp}"
            try:
                done = await self._reconcile(new)
            finally:
                self.updating = None
            self._resized()
            return {"changed": True, "from": old_fp, "fingerprint": self.fingerprint, "pools": done}

    async def _reconcile(self, new: ClusterConfig) -> dict[str, str]:
        done = await reconcile_pools(self.pools, self.config, new, self.placement_timeout_s + ACTOR_START_GRACE_S,
                                     self._bump)
        self.config, self.fingerprint = new, fingerprint(new)
        self.autoscaling.configure(new.pools)
        self.to_zero = ScaleToZero.of(new.pools)
        logger.warning("spec %s applied: %s", self.fingerprint, done or "nothing to change in the pools")
        return done

    async def shutdown(self, drain_s: float = 0.0) -> None:
        """Stop checking, let running requests finish for up to `drain_s`, then kill every replica."""
        if self._startup is not None and not self._startup.done():
            self._startup.cancel()
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
        # Pools that never served run no request, and a replica still loading would answer the
        # drain's stats only once loaded (a Ctrl-C during startup waited ~4 s for that).
        if drain_s > 0 and self.phase == "ready":
            await asyncio.gather(*[pool.drain(drain_s) for pool in self.pools.values()])
        for pool in self.pools.values():
            pool.shutdown()
        _save_state(self.config.name, None, {})
        request_room(self.config.name, {}, False)      # (its share of the autoscaler's request)


def _load_state(namespace: str) -> dict | None:
    """The spec last applied and the pools' sizes, as a manager of this namespace left them."""
    from ray.experimental.internal_kv import _internal_kv_get  # noqa: PLC0415 - Ray's KV, in the actor only

    try:
        raw = _internal_kv_get(STATE_KEY, namespace=namespace)
        return json.loads(raw) if raw else None
    except Exception as e:  # noqa: BLE001 - unreadable: start from the spec given
        logger.warning("the stored manager state is unreadable: %s", e)
        return None


def _save_state(namespace: str, config: ClusterConfig | None, targets: dict[str, int]) -> None:
    """Keep (or with `config` None, forget) the spec and the pools' sizes in Ray's internal KV."""
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put  # noqa: PLC0415

    try:
        if config is None:
            _internal_kv_del(STATE_KEY, namespace=namespace)
        else:
            _internal_kv_put(STATE_KEY, json.dumps({"spec": config.model_dump_json(), "targets": targets}),
                             overwrite=True, namespace=namespace)
    except Exception as e:  # noqa: BLE001 - Ray is going away
        logger.warning("keeping the manager state failed: %s", e)


def get_or_create_manager(config: ClusterConfig, engine_configs: dict[str, EngineConfig] | None = None) -> Any:
    """The cluster's manager actor, created on first call (namespace = config.name).

    It runs on the head node (whose loss is the Ray cluster's: the GCS lives there), and Ray
    restarts it whenever its process dies; the restarted actor adopts the pools' replicas
    (`ClusterManager._start_up`). Calls made while it restarts wait for it. `engine_configs`: the
    pools' engine configs where the caller resolved them (the launcher does, to check the spec):
    a manager that resolves them itself imports transformers and torch first, ~3 s of CPU before
    any replica starts."""
    return ray.remote(ClusterManager).options(
        name=MANAGER_NAME, namespace=config.name, get_if_exists=True, lifetime="detached",
        num_cpus=0, resources={HEAD_NODE_RESOURCE: 0.001}, max_restarts=-1, max_task_retries=-1,
        max_concurrency=1000).remote(config, engine_configs=engine_configs)


@dataclass(frozen=True)
class ManagerLink:
    """How an ingress replica reaches the cluster's manager: `link()` is its handle, the actor
    created on first use (namespace = the spec's name). The launcher hands it to the ingress
    (cluster/app.py), so that router/ never imports cluster/; it travels as the spec's JSON."""
    config_json: str

    def __call__(self) -> Any:
        return get_or_create_manager(ClusterConfig.model_validate_json(self.config_json))
