"""Simulated replicas several to a process: `ReplicaHost` (the body of a host actor) holds up to
a pool's `replicas_per_process` `EngineReplica`s on simulated engines, and `HostedReplica` is a
handle to one of them with an actor handle's surface (`handle.method.remote(...)`, and
`.options(num_returns="streaming")` for the output channel), so the routers and the ingress use it
as they use a replica's own actor. A simulated replica needs no device and little memory, but a
process of its own costs about 450 MB here (torch comes with the tokenizer); sharing one is what lets
`pdserve serve --simulate` run 64 replicas on a 2-core machine.

A pool (cluster/pool.py) keeps its hosts in `ReplicaHosts`: it places a new replica on a host with
room (or starts a host: a detached, named actor with the pool's custom resources, which is what
pins it to its nodes), removes replicas (a host goes with its last one) and adopts a gone manager's
hosts by their names. A host that dies takes its replicas with it (their calls fail as a dead
actor's do), and a replica removed from its host fails every later call with EngineDeadError and
ends its open channels, which the routers read as a lost replica (router/routing/pool_router.py:
`replica_lost`).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import ray

from cluster.placement import SIMULATED_REPLICA_CPUS
from records.config import EngineConfig
from records.errors import EngineDeadError

if TYPE_CHECKING:
    from cluster.config import PoolSpec
    from cluster.replica import EngineReplica

logger = logging.getLogger(__name__)


class ReplicaHost:
    def __init__(self, host_id: str) -> None:
        self.host_id = host_id
        self.replicas: dict[str, EngineReplica] = {}

    def add(self, replica_id: str, config: EngineConfig, tag: str = "") -> None:
        """Make a replica here (its engine starts at `load`, as an actor's does)."""
        if config.simulation is None:
            raise ValueError("a replica host holds simulated replicas only (engine.simulate)")
        # The engine (and torch) here, in the host's process: the manager, which imports this module
        # for the handles and the bookkeeping, runs no engine.
        from cluster.replica import EngineReplica  # noqa: PLC0415

        self.replicas[replica_id] = EngineReplica(config, replica_id, load=False, tag=tag)

    async def remove(self, replica_id: str) -> int:
        """Drop a replica (its requests end, its channels close with EngineDeadError); returns how
        many replicas are left here."""
        replica = self.replicas.pop(replica_id, None)
        if replica is not None:
            await replica.close()
        return len(self.replicas)

    def replica_tags(self) -> dict[str, str]:
        """The replicas here and their pools' tags (what a restarted manager adopts)."""
        return {rid: r.tag for rid, r in self.replicas.items()}

    def _replica(self, replica_id: str) -> EngineReplica:
        replica = self.replicas.get(replica_id)
        if replica is None:
            raise EngineDeadError(f"simulated replica {replica_id} is no longer on host {self.host_id}")
        return replica

    async def call(self, replica_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """`method` of one replica (awaited when it is a coroutine)."""
        result = getattr(self._replica(replica_id), method)(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    async def stream(self, replica_id: str, method: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """An async-generator `method` of one replica, streamed (a Ray streaming generator)."""
        async for item in getattr(self._replica(replica_id), method)(*args, **kwargs):
            yield item


class _HostedMethod:
    """`handle.<method>` of a HostedReplica: `.remote(...)` as an actor method's."""

    def __init__(self, host: Any, replica_id: str, name: str, options: dict[str, Any] | None = None) -> None:
        self.host, self.replica_id, self.name, self._options = host, replica_id, name, options

    def options(self, **options: Any) -> _HostedMethod:
        return _HostedMethod(self.host, self.replica_id, self.name, options)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self._options and self._options.get("num_returns") == "streaming":
            return self.host.stream.options(**self._options).remote(self.replica_id, self.name, *args, **kwargs)
        return self.host.call.remote(self.replica_id, self.name, *args, **kwargs)


class HostedReplica:
    """A handle to a replica on a ReplicaHost actor (picklable: it travels to the ingresses)."""

    def __init__(self, host: Any, replica_id: str) -> None:
        self.host, self.replica_id = host, replica_id

    def __getattr__(self, name: str) -> _HostedMethod:
        if name.startswith("__"):
            raise AttributeError(name)
        return _HostedMethod(self.host, self.replica_id, name)

    def __repr__(self) -> str:
        return f"HostedReplica({self.replica_id})"


class ReplicaHosts:
    """The host actors of one pool's simulated replicas, and which replica lives where."""

    def __init__(self, pool: str, namespace: str) -> None:
        self.pool, self.namespace = pool, namespace
        self.members: dict[str, set[str]] = {}      # host actor name -> its replicas' ids
        self.handles: dict[str, Any] = {}
        self.hosted: dict[str, str] = {}            # replica id -> its host's name
        self.dead: set[str] = set()                 # hosts whose actor died: none get new replicas
        self._adding: dict[str, Any] = {}           # replica id -> its host's `add` call, until awaited
        self._next = 0

    def _prefix(self) -> str:
        return f"{self.namespace}-{self.pool}-host-"

    def spawn(self, replica_id: str, spec: PoolSpec, engine_config: EngineConfig, tag: str) -> HostedReplica:
        """A replica on the first live host with room for `spec.replicas_per_process`, or on a new one."""
        name = next((n for n, members in self.members.items()
                     if len(members) < spec.replicas_per_process and n not in self.dead), None)
        if name is None:
            name = f"{self._prefix()}{self._next}"
            self._next += 1
            self.handles[name] = ray.remote(ReplicaHost).options(
                name=name, namespace=self.namespace, lifetime="detached", max_concurrency=1000,
                num_cpus=SIMULATED_REPLICA_CPUS * spec.replicas_per_process, resources=dict(spec.resources),
            ).remote(name)
            self.members[name] = set()
        host = self.handles[name]
        # A host runs its calls concurrently: the pool's first call to the replica awaits this (`added`).
        self._adding[replica_id] = host.add.remote(replica_id, engine_config, tag)
        self.members[name].add(replica_id)
        self.hosted[replica_id] = name
        return HostedReplica(host, replica_id)

    async def added(self, replica_id: str) -> None:
        """Return once a new replica is on its host (nothing for a replica of its own actor)."""
        pending = self._adding.pop(replica_id, None)
        if pending is not None:
            await pending

    def host_died(self, replica_id: str) -> None:
        """A replica's actor was found dead: so is its host, which gets no new replica."""
        if replica_id in self.hosted:
            self.dead.add(self.hosted[replica_id])

    def remove(self, handle: HostedReplica) -> None:
        """Take a replica off its host; the host's actor goes with its last replica."""
        self._adding.pop(handle.replica_id, None)
        name = self.hosted.pop(handle.replica_id, None)
        if name is None:
            return
        members = self.members.get(name, set())
        members.discard(handle.replica_id)
        if not members:
            self.members.pop(name, None)
            self.dead.discard(name)
            kill_actor(self.handles.pop(name))
        elif name not in self.dead:
            handle.host.remove.remote(handle.replica_id)

    async def adopt(self, named: list[str], timeout_s: float) -> list[tuple[str, HostedReplica]]:
        """The replicas on this pool's hosts among `named` (the namespace's live actor names), a gone
        manager's: (replica id, handle), to be checked by the pool as its own actors are."""
        prefix, found = self._prefix(), []
        for name in [n for n in named if n.startswith(prefix) and n[len(prefix):].isdigit()]:
            self._next = max(self._next, int(name[len(prefix):]) + 1)
            try:
                host = ray.get_actor(name, namespace=self.namespace)
                tags = await asyncio.wait_for(host.replica_tags.remote(), timeout_s)
            except Exception as e:  # noqa: BLE001 - dead or unreachable: its replicas are not adopted
                logger.warning("pool %s: not adopting host %s: %s", self.pool, name, type(e).__name__)
                continue
            self.handles[name], self.members[name] = host, set(tags)
            for replica_id in sorted(tags, key=lambda r: int(r.rpartition("-")[2])):
                self.hosted[replica_id] = name
                found.append((replica_id, HostedReplica(host, replica_id)))
        return found


def kill_actor(handle: Any) -> None:
    """Kill an actor for good (nothing if it is gone already)."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
