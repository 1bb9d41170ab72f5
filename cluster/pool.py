"""EnginePool: the engine replica actors of one pool (prefill or decode): created, health-checked,
replaced when they die, resized (`scale`: new replicas join when loaded, removed ones drain),
replaced rolling when the spec changes what they are made of (`bring_up_new`, `swap_in`), drained
on shutdown.

Ray is applied here: each replica is `ray.remote(EngineReplica)` with the pool's CPUs/GPUs (and
custom resources that pin it to its nodes) and the spec's `process_env` (OpenMP's idle threads
asleep, its niceness), and torch in it gets as many threads as CPUs it was given. With TP x PP > 1
the replica actor only schedules (a tenth of a CPU); its engine starts one worker actor per rank
with the pool's CPUs/GPUs each, in a placement group (cluster/placement.py) that lives and dies
with the replica.

Health: `check_health()` asks every replica for its stats. A replica whose actor died, whose engine
reports itself dead, or that misses `max_missed` checks in a row is killed and dropped at once (the
routers stop sending it requests; the streams it was running migrate to other replicas at the
ingress, router/routing/pool_router.py), and
a replacement with a fresh id (`decode-2`, ...) is started; it joins the pool when its model has
loaded. A replacement that fails to start is retried at the next check. Every change of membership
bumps `generation`, which is what the ingress follows (`ClusterManager.membership`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from cluster.config import PoolSpec
from cluster.placement import REPLICA_ACTOR_CPUS, fmt_resources, replica_bundles
from cluster.replica_host import HostedReplica, ReplicaHosts, kill_actor
from records.config import EngineConfig
from records.engine_stats import EngineStats, ReplicaStats
from records.errors import PlacementError
from records.histogram import LATENCY_BUCKETS_S, VLLM_REQUEST_LATENCY_BUCKETS, quantile

logger = logging.getLogger(__name__)


class EnginePool:
    def __init__(self, name: str, spec: PoolSpec, engine_config: EngineConfig, namespace: str,
                 check_timeout_s: float = 10.0, max_missed: int = 3,
                 on_change: Callable[[], None] | None = None) -> None:
        self.name = name
        self.spec = spec
        self.engine_config = engine_config
        self.namespace = namespace
        self.check_timeout_s = check_timeout_s
        self.max_missed = max_missed
        self.on_change = on_change or (lambda: None)
        self.replicas: dict[str, Any] = {}       # replica id -> actor handle, serving
        self.starting: dict[str, Any] = {}       # replacements still loading their model
        # What a replica gets once loaded, before it serves (the model's weight updates since the
        # start: cluster/weights.py), set by the manager.
        self.after_load: Callable[[Any], Awaitable[None]] | None = None
        self.draining: dict[str, Any] = {}       # taken out of routing, finishing what they run
        self.incoming: dict[str, Any] = {}       # a rolling replace's new replicas, loading
        self.target = spec.replicas              # the replica count kept (`scale` changes it)
        # What the replicas of this pool and spec carry (`EngineReplica.info()["tag"]`): a manager
        # adopts only replicas with its own tag.
        self.tag = pool_tag(name, spec, engine_config)
        self.stats: dict[str, ReplicaStats] = {}       # replica id -> its last stats (health checks)
        self.nodes: dict[str, str] = {}          # replica id -> the node its actor runs on
        self.missed: dict[str, int] = {}
        self.replaced = 0                        # replicas dropped for failing health checks
        self.drained = {"empty": 0, "timeout": 0}   # replicas drained out: emptied in time, or not
        self._next_index = 0
        self._tasks: set[asyncio.Task] = set()
        # Simulated replicas live several to a host actor (cluster/replica_host.py).
        self.hosts = ReplicaHosts(name, namespace)

    def _spawn(self, spec: PoolSpec | None = None, engine_config: EngineConfig | None = None) -> tuple[str, Any]:
        """A new replica actor (of this pool's spec, or of `spec` and `engine_config`: a rolling
        replace's); it loads its model when asked to (`load`). A simulated replica goes on a host
        with room (`_spawn_hosted`)."""
        spec, engine_config = spec or self.spec, engine_config or self.engine_config
        replica_id = f"{self.name}-{self._next_index}"
        self._next_index += 1
        tag = pool_tag(self.name, spec, engine_config)
        if engine_config.simulation is not None:
            return replica_id, self.hosts.spawn(replica_id, spec, engine_config, tag)
        single = spec.world_size == 1
        threads = max(1, int(spec.num_cpus)) if single else 1
        # Detached: a replica outlives the manager that made it (a restarted manager adopts it),
        # and the pool kills it itself (drop, shutdown).
        # The engine (torch) only where a replica of a real engine starts: the manager itself never runs one.
        from cluster.replica import EngineReplica  # noqa: PLC0415

        handle = ray.remote(EngineReplica).options(
            name=self._actor_name(replica_id), namespace=self.namespace, lifetime="detached",
            max_concurrency=1000,
            num_cpus=spec.num_cpus if single else REPLICA_ACTOR_CPUS,
            num_gpus=spec.num_gpus if single else 0,
            resources=dict(spec.resources) if single else {},
            runtime_env={"env_vars": spec.process_env()},
        ).remote(engine_config, replica_id, threads, load=False, tag=tag)
        return replica_id, handle

    def _actor_name(self, replica_id: str) -> str:
        return f"{self.namespace}-{replica_id}"

    async def adopt(self) -> list[str]:
        """Take over this pool's live replicas from a manager that is gone (found by their names;
        those of another spec, with another tag, are killed): loaded ones serve at once, loading
        ones join when loaded. Returns the ids adopted."""
        prefix = self._actor_name(f"{self.name}-")
        named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == self.namespace]
        names = [n for n in named if n.startswith(prefix) and n[len(prefix):].isdigit()]
        found: list[tuple[str, Any]] = []
        for name in sorted(names, key=lambda n: int(n[len(prefix):])):
            try:
                found.append((name[len(self.namespace) + 1:], ray.get_actor(name, namespace=self.namespace)))
            except ValueError:
                continue            # gone meanwhile
        found += await self.hosts.adopt(named, self.check_timeout_s)
        adopted = []
        for replica_id, handle in found:
            self._next_index = max(self._next_index, int(replica_id.rpartition("-")[2]) + 1)
            try:
                info = await asyncio.wait_for(handle.info.remote(), self.check_timeout_s)
            except Exception as e:  # noqa: BLE001 - dead or unreachable: the health check replaces it
                logger.warning("pool %s: not adopting %s: %s", self.name, replica_id, type(e).__name__)
                continue
            if info.get("tag") != self.tag:
                logger.warning("pool %s: killing %s, a replica of another spec", self.name, replica_id)
                self._kill(handle)
                continue
            self.nodes[replica_id] = info.get("node_id", "")
            if info["loaded"]:
                self.replicas[replica_id] = handle
            else:
                self._bring_up_later(replica_id, handle)
            adopted.append(replica_id)
        if adopted:
            logger.warning("pool %s: adopted replicas %s", self.name, adopted)
            self.on_change()
        return adopted

    @property
    def placed(self) -> bool:
        """Every replica of the pool's start has a node (its actor's constructor ran)."""
        return all(r in self.nodes for r in self.replicas)

    def start(self) -> None:
        for _ in range(self.target):
            replica_id, handle = self._spawn()
            self.replicas[replica_id] = handle

    async def wait_ready(self, place_timeout_s: float | None = None) -> list[dict]:
        """Wait until every replica is placed and has loaded its model; returns their info.

        A replica that Ray has not placed within `place_timeout_s` (the cluster lacks what it needs,
        e.g. another workload holds the CPUs) raises PlacementError naming the pool, what a
        replica needs and what the cluster has free; loading itself may take as long as it takes."""
        return await asyncio.gather(*[self._wait_one(r, h, place_timeout_s) for r, h in self.replicas.items()])

    async def _wait_one(self, replica_id: str, handle: Any, place_timeout_s: float | None) -> dict:
        try:
            await asyncio.wait_for(self.hosts.added(replica_id), place_timeout_s)
            info = await asyncio.wait_for(handle.info.remote(), place_timeout_s)    # its constructor ran
            self.nodes[replica_id] = info.get("node_id", "")
        except asyncio.TimeoutError:
            bundles = replica_bundles(self.spec, replica_id in self.hosts.hosted)
            needs = ", ".join(fmt_resources(b) for b in bundles)
            free = {k: v for k, v in ray.available_resources().items()
                    if not k.startswith(("node:", "memory", "object_store_memory"))}
            raise PlacementError(f"pools.{self.name}: replica {replica_id} was not placed within "
                                 f"{place_timeout_s:g} s: one replica needs {needs}; the cluster has "
                                 f"{fmt_resources(free)} free") from None
        info = await handle.load.remote()
        if self.after_load is not None:
            await self.after_load(handle)
        return info

    # --- health ------------------------------------------------------------------------------------
    async def check_health(self) -> list[str]:
        """Check every replica once, drop the failed ones and start replacements. Returns the ids
        dropped."""
        ids = list(self.replicas)
        results = await asyncio.gather(
            *[asyncio.wait_for(self.replicas[r].stats.remote(), self.check_timeout_s) for r in ids],
            return_exceptions=True)
        dropped = []
        for replica_id, res in zip(ids, results):
            reason = None
            if isinstance(res, RayActorError) and not isinstance(res, ActorUnavailableError):
                reason = f"its actor died ({type(res).__name__})"
                self.hosts.host_died(replica_id)
            elif isinstance(res, BaseException):         # timeout, or unreachable for now
                self.missed[replica_id] = self.missed.get(replica_id, 0) + 1
                if self.missed[replica_id] >= self.max_missed:
                    reason = f"it missed {self.missed[replica_id]} health checks ({type(res).__name__})"
            elif not res.healthy:
                reason = "its engine stopped (engine dead)"
            else:
                self.missed.pop(replica_id, None)
                self.stats[replica_id] = res
            if reason is not None and replica_id in self.replicas:
                self.drop(replica_id, reason)
                dropped.append(replica_id)
        for _ in range(self.target - len(self.replicas) - len(self.starting)):
            self._start_replacement()
        return dropped

    def drop(self, replica_id: str, reason: str) -> None:
        """Take a replica out of the pool now and kill its actor (and with it, its workers)."""
        handle = self.replicas.pop(replica_id, None)
        if handle is None:
            return
        logger.warning("pool %s: replacing replica %s: %s", self.name, replica_id, reason)
        self._forget(replica_id)
        self.replaced += 1
        self._kill(handle)
        self.on_change()

    def _start_replacement(self) -> None:
        self._bring_up_later(*self._spawn())

    def _bring_up_later(self, replica_id: str, handle: Any) -> None:
        self.starting[replica_id] = handle
        self._spawn_task(self._bring_up(replica_id, handle))

    async def _bring_up(self, replica_id: str, handle: Any) -> None:
        try:
            await self.hosts.added(replica_id)
            info = await handle.info.remote()            # placed (Ray may keep it pending for a node)
            self.nodes[replica_id] = info.get("node_id", "")
            await handle.load.remote()
            if self.after_load is not None:
                await self.after_load(handle)
        except Exception:
            logger.exception("pool %s: replacement %s failed to start", self.name, replica_id)
            self.starting.pop(replica_id, None)
            self._kill(handle)
            return
        if self.starting.pop(replica_id, None) is not None:
            self.replicas[replica_id] = handle
            logger.warning("pool %s: replacement %s is serving", self.name, replica_id)
            self.on_change()

    # --- size --------------------------------------------------------------------------------------
    async def scale(self, replicas: int, drain_timeout_s: float) -> dict[str, Any]:
        """Keep `replicas` replicas from now on (at least one, or none for a pool that scales to
        zero). Growing starts replicas (they join when loaded); shrinking cancels replicas still
        loading first, then drains the serving ones running the fewest requests (`drain_replica`).
        Returns what it did."""
        if replicas < self.spec.bounds()[0] or replicas < 0:
            raise ValueError(f"replicas must be >= {self.spec.bounds()[0]}; got {replicas}")
        self.target = replicas
        started, cancelled, draining = [], [], []
        for _ in range(replicas - len(self.replicas) - len(self.starting)):
            self._start_replacement()
            started.append(next(reversed(self.starting)))
        while len(self.replicas) + len(self.starting) > replicas and self.starting:
            replica_id, handle = self.starting.popitem()
            self._forget(replica_id)
            self._kill(handle)
            cancelled.append(replica_id)
        excess = len(self.replicas) - replicas
        if excess > 0:
            ids = list(self.replicas)
            stats = await asyncio.gather(*[self.replicas[r].stats.remote() for r in ids], return_exceptions=True)
            busy = {r: s.load if isinstance(s, ReplicaStats) else -1
                    for r, s in zip(ids, stats)}   # a failing one goes first
            for replica_id in sorted(ids, key=lambda r: busy[r])[:excess]:
                self._spawn_task(self.drain_replica(replica_id, drain_timeout_s))
                draining.append(replica_id)
        logger.warning("pool %s: scaled to %d replicas (started %s, cancelled %s, draining %s)", self.name,
                       replicas, started, cancelled, draining)
        return {"target": replicas, "started": started, "cancelled": cancelled, "draining": draining}

    async def drain_replica(self, replica_id: str, timeout_s: float) -> bool:
        """Take a replica out of routing at once (the ingresses stop sending it requests; the
        streams it runs go on), wait up to `timeout_s` for its requests and leases to end, then kill
        it; streams still running then migrate to other replicas at the ingress. True if it
        emptied in time."""
        handle = self.replicas.pop(replica_id, None) or self.draining.get(replica_id)
        if handle is None:
            return False
        self.draining[replica_id] = handle
        self.missed.pop(replica_id, None)
        self.on_change()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        emptied = False
        while loop.time() < deadline:
            try:
                s = await asyncio.wait_for(handle.stats.remote(), self.check_timeout_s)
            except Exception:  # noqa: BLE001 - it died meanwhile: nothing left to wait for
                break
            transfer = s.engine.kv_transfer
            if s.load + (transfer.leases_active if transfer is not None else 0) == 0:
                emptied = True
                break
            await asyncio.sleep(0.2)
        self.draining.pop(replica_id, None)
        self._forget(replica_id)
        self._kill(handle)
        self.drained["empty" if emptied else "timeout"] += 1
        logger.warning("pool %s: drained replica %s (%s)", self.name, replica_id,
                       "empty" if emptied else f"after {timeout_s:g} s: its streams migrate")
        return emptied

    def _kill(self, handle: Any) -> None:
        """End a replica: its actor, or its place on its host (the host goes with its last replica)."""
        if isinstance(handle, HostedReplica):
            self.hosts.remove(handle)
        else:
            kill_actor(handle)

    def _forget(self, replica_id: str) -> None:
        for table in (self.missed, self.stats, self.nodes):
            table.pop(replica_id, None)

    # --- rolling replace -----------------------------------------------------------------------------
    async def bring_up_new(self, spec: PoolSpec, engine_config: EngineConfig, place_timeout_s: float) -> None:
        """The first half of a rolling replace (a changed spec): start `target` replicas of the new
        spec beside the serving ones and wait until every one has loaded. They do not serve until
        `swap_in`; if one cannot start, all of them go and this raises (the old ones serve on)."""
        for _ in range(self.target):
            replica_id, handle = self._spawn(spec, engine_config)
            self.incoming[replica_id] = handle
        try:
            await asyncio.gather(*[self._wait_one(r, h, place_timeout_s) for r, h in self.incoming.items()])
        except BaseException:
            for replica_id, handle in self.incoming.items():
                self._forget(replica_id)
                self._kill(handle)
            self.incoming.clear()
            raise

    def swap_in(self, spec: PoolSpec, engine_config: EngineConfig, drain_timeout_s: float) -> list[str]:
        """The second half: the new replicas serve and the old ones drain (out of routing at once;
        killed once empty, or after `drain_timeout_s`, when their streams migrate). Returns the ids
        draining."""
        old = dict(self.replicas)
        for replica_id, handle in self.starting.items():     # replacements of the old spec
            self._forget(replica_id)
            self._kill(handle)
        self.starting.clear()
        self.spec, self.engine_config = spec, engine_config
        self.tag = pool_tag(self.name, spec, engine_config)
        self.replicas = dict(self.incoming)
        self.incoming.clear()
        self.draining.update(old)
        for replica_id in old:
            self._spawn_task(self.drain_replica(replica_id, drain_timeout_s))
        self.on_change()
        return sorted(old)

    def engine_stats(self) -> dict[str, EngineStats | None]:
        """The serving replicas' engines at the last health check (None before a replica's first)."""
        return {r: s.engine if (s := self.stats.get(r)) is not None else None for r in self.replicas}

    def replica_status(self) -> list[dict[str, Any]]:
        """Every replica with its state (pending: not placed yet; starting: loading; serving;
        draining), node, layout and last stats, for `pdserve status`."""
        layout = f"TP{self.spec.tensor_parallel_size}xPP{self.spec.pipeline_parallel_size}"
        rows = []
        for state, table in (("serving", self.replicas), ("starting", self.starting),
                             ("starting", self.incoming), ("draining", self.draining)):
            for replica_id in table:
                st = self.stats.get(replica_id)
                e = st.engine if st is not None else None      # (None before its first health check)
                placed = replica_id in self.nodes
                rows.append({"id": replica_id, "state": state if placed or state != "starting" else "pending",
                             "node": self.nodes.get(replica_id), "layout": layout,
                             "kv_usage": e.kv_cache_usage_perc if e else None,
                             "running": e.num_requests_running if e else None,
                             "waiting": e.num_requests_waiting if e else None,
                             "latency": replica_latency(e) if e else None, "kv_tier": replica_tier(e) if e else None})
        return rows

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- shutdown ----------------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the replicas to finish what they run; True if they did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            stats = await asyncio.gather(*[h.stats.remote() for h in self.replicas.values()],
                                         return_exceptions=True)
            busy = [s for s in stats if isinstance(s, ReplicaStats) and s.load > 0]
            if not busy:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.2)

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for table in (self.replicas, self.starting, self.draining, self.incoming):
            for handle in table.values():
                self._kill(handle)
            table.clear()


def pool_tag(name: str, spec: PoolSpec, engine_config: EngineConfig) -> str:
    """What a pool's replicas are made of, as a short digest (`PoolSpec.identity()` and the engine
    config): replicas with equal tags are interchangeable."""
    kvt = engine_config.kv_transfer_config
    if kvt is not None:     # (drawn afresh each time a config is resolved; every worker makes its own of it)
        engine_config = dataclasses.replace(engine_config, kv_transfer_config=dataclasses.replace(kvt, engine_id=""))
    digest = hashlib.sha256(f"{spec.identity()}{engine_config!r}".encode()).hexdigest()
    return f"{name}:{digest[:16]}"


PERCENTILES = (0.5, 0.9, 0.99)


def replica_latency(stats: EngineStats) -> dict[str, dict[str, float | None]] | None:
    """A replica's time to first token, inter-token latency and queue time since it started, at
    the 50th, 90th and 99th percentiles (seconds, read off its histograms: records/histogram.py),
    and how many it counted; None before its first stats."""
    if not stats.ttft:              # (asleep)
        return None
    queue = stats.histograms.get("request_queue_time_seconds")
    series = {"ttft_s": (stats.ttft, LATENCY_BUCKETS_S), "itl_s": (stats.itl, LATENCY_BUCKETS_S)}
    if queue is not None:
        series["queue_s"] = (queue[0], VLLM_REQUEST_LATENCY_BUCKETS)
    out: dict[str, dict[str, float | None]] = {}
    for name, (counts, buckets) in series.items():
        out[name] = {f"p{round(q * 100)}": _round(quantile(counts, q, buckets)) for q in PERCENTILES}
        out[name]["count"] = sum(counts)
    return out


def replica_tier(stats: EngineStats) -> dict[str, list[int]] | None:
    """The offload tier's blocks held and slots per medium ({"host": [held, slots], ...}), None
    without a tier."""
    tier = stats.kv_tier
    if tier is None:
        return None
    return {medium: [held, slots] for medium, held, slots in (("host", tier.host_blocks, tier.host_slots),
                                                              ("disk", tier.disk_blocks, tier.disk_slots)) if slots}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
