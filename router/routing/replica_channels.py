"""ReplicaChannels: one router's output channels to its pool's replicas, and the KV events they
carry into its prefix index.

A router (router/routing/pool_router.py) has one `ReplicaChannel` (router/routing/channel.py) per
replica: its requests' deltas come back on it, and once the router follows the replicas
(`follow`), so do the replica's KV events, applied to the router's `PrefixIndex` in the log's order
(the events of a step on the message that step's deltas travel on, so they arrive within a step,
cost no call of their own, and idle replicas send nothing). The batches travel as protobuf
`KVEventBatch`; a replica of another schema version has its events refused, with an error logged.
A channel that ends while its replica is a member and alive is opened again from the cursor it
reached; one whose replica is gone reports it (`on_gone`). A router that does not follow reads the
events when told (`sync_events`).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from pdserve_proto.kv_events import decode_kv_events
from records.errors import EngineDeadError, SchemaVersionMismatch
from router.routing.channel import ReplicaChannel
from router.routing.metrics import ServingMetrics
from router.routing.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)


class ReplicaChannels:
    def __init__(self, pool: str, replicas: dict[str, Any], index: PrefixIndex, metrics: ServingMetrics,
                 on_gone: Callable[[str, BaseException], None], transport: str = "tcp") -> None:
        """replicas: the router's members (replica id -> actor handle; the router's own dict, which
        `added` and `removed` follow); on_gone(replica id, error): its channel ended because the
        replica is gone (a dead actor, a closed engine)."""
        self.pool = pool
        self.replicas = replicas
        self.index = index
        self.metrics = metrics
        self.on_gone = on_gone
        self.transport = transport
        self.ingress_id = f"{pool}-{uuid.uuid4().hex[:12]}"      # unique per router
        self.by_replica: dict[str, ReplicaChannel] = {}
        self.cursors: dict[str, int] = {}          # each replica's KV events applied so far
        self.following = False
        self._leaving: dict[str, ReplicaChannel] = {}    # of replicas that left, until their streams end

    def get(self, replica_id: str) -> ReplicaChannel:
        """The member's channel (made on first use; when following, it carries its KV events)."""
        channel = self.by_replica.get(replica_id)
        if channel is None:
            channel = self.by_replica[replica_id] = ReplicaChannel(
                self.replicas[replica_id], self.ingress_id,
                (lambda batch: self._apply(replica_id, batch)) if self.following else None,
                lambda error: self._ended(replica_id, error), lambda: self.cursors.get(replica_id, 0),
                self.transport)
        return channel

    def follow(self) -> None:
        """Follow every member's KV events from now on (each channel opened at once)."""
        self.following = True
        for r in self.replicas:
            self.get(r).open()

    def added(self, replica_id: str) -> None:
        """A member joined (already in `replicas`)."""
        self.cursors[replica_id] = 0
        if self.following:
            self.get(replica_id).open()

    def removed(self, replica_id: str, busy: bool) -> None:
        """A member left; `busy`: streams still run on it (a replica draining), whose channel stays
        open, its events no longer applied, until `released`."""
        self.cursors.pop(replica_id, None)
        channel = self.by_replica.pop(replica_id, None)
        if channel is not None and busy:
            channel.on_events = None
            self._leaving[replica_id] = channel
        elif channel is not None:
            channel.close()

    def released(self, replica_id: str) -> None:
        """The last stream on a replica ended: a channel kept open for it after it left closes."""
        channel = self._leaving.pop(replica_id, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        for channel in [*self.by_replica.values(), *self._leaving.values()]:
            channel.close()
        self.by_replica, self._leaving, self.following = {}, {}, False

    async def sync_events(self) -> None:
        """Apply every member's new KV events to the index now (a router that does not follow)."""
        ids = list(self.replicas)
        results = await asyncio.gather(
            *[self.replicas[r].kv_events_since.remote(self.cursors[r]) for r in ids], return_exceptions=True)
        for r, res in zip(ids, results):
            if isinstance(res, BaseException):
                continue
            self.cursors[r], events = decode_kv_events(res)
            self.index.apply(r, events)

    def _apply(self, replica_id: str, batch: bytes) -> bool:
        """Apply a replica's KV event batch to the index (its cursor moves to the batch's end);
        False when refused."""
        try:
            cursor, events = decode_kv_events(batch)
        except SchemaVersionMismatch as e:  # another pdserve version: its events are not applied
            logger.error("refusing KV events of %s replica %s: %s", self.pool, replica_id, e)
            self.metrics.requests.errors.inc(code="kv_events_schema_mismatch")
            return False
        if replica_id in self.replicas:
            self.index.apply(replica_id, events)
            self.cursors[replica_id] = cursor
        return True

    def _ended(self, replica_id: str, error: BaseException) -> bool:
        """A replica's channel ended with `error`: whether the replica is gone for good (a dead
        actor, a closed engine, or no longer a member), else its channel is opened again."""
        member = replica_id in self.replicas
        gone = not member or isinstance(error, EngineDeadError) or (
            isinstance(error, RayActorError) and not isinstance(error, ActorUnavailableError))
        if gone and member:
            self.on_gone(replica_id, error)
        return gone
