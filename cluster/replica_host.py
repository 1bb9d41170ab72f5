"""Simulated replicas several to a process: `ReplicaHost` (the body of a host actor) holds up to
a pool's `replicas_per_process` `EngineReplica`s on simulated engines, and `HostedReplica` is a
handle to one of them with an actor handle's surface (`handle.method.remote(...)`, and
`.options(num_returns="streaming")` for the output channel), so the routers and the ingress use it
as they use a replica's own actor. A simulated replica needs no device and little memory, but a
process of its own costs about 450 MB here (torch comes with the tokenizer); sharing one is what lets
`pdserve serve --simulate` run 64 replicas on a 2-core machine.

The pool (cluster/pool.py) places replicas on hosts and removes them; a host that dies takes its
replicas with it (their calls fail as a dead actor's do), and a replica removed from its host
fails every later call with EngineDeadError and ends its open channels, which the routers read as
a lost replica (router/routing/pool_router.py: `replica_lost`).
"""
from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

from cluster.replica import EngineReplica
from records.config import EngineConfig
from records.errors import EngineDeadError


class ReplicaHost:
    def __init__(self, host_id: str) -> None:
        self.host_id = host_id
        self.replicas: dict[str, EngineReplica] = {}

    def add(self, replica_id: str, config: EngineConfig, tag: str = "") -> None:
        """Make a replica here (its engine starts at `load`, as an actor's does)."""
        if config.simulation is None:
            raise ValueError("a replica host holds simulated replicas only (engine.simulate)")
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

    def __init__(self, host: Any, replica_id: str, name: str, streaming: bool = False) -> None:
        self.host, self.replica_id, self.name, self.streaming = host, replica_id, name, streaming

    def options(self, **options: Any) -> _HostedMethod:
        return _HostedMethod(self.host, self.replica_id, self.name, options.get("num_returns") == "streaming")

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self.streaming:
            return self.host.stream.options(num_returns="streaming").remote(self.replica_id, self.name, *args,
                                                                            **kwargs)
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
