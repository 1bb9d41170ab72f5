"""Wire form of the engines' KV events (records/kv_events.py) between an engine replica and the routers:
one `KVEventBatch` message per `EngineReplica.kv_events_since` answer, versioned like every
control-plane message (a router refuses a batch of another schema version with SchemaVersionMismatch).
"""
from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.message import DecodeError

from pdserve_proto import CONTROL_SCHEMA_VERSION, check_version, pb2
from records.kv_events import MEDIA, AllCleared, BlockRemoved, BlockStored, KVEvent


def encode_kv_events(cursor: int, events: Sequence[KVEvent], replica_id: str = "") -> bytes:
    """`events` (in the engine's order) and the cursor to pass next time, as KVEventBatch bytes."""
    batch = pb2.KVEventBatch(schema_version=CONTROL_SCHEMA_VERSION, replica_id=replica_id, cursor=cursor)
    for event in events:
        if isinstance(event, (BlockStored, BlockRemoved)):
            hashes = (batch.events.add().stored if isinstance(event, BlockStored) else batch.events.add().removed)
            hashes.hashes.extend(event.block_hashes)
            if event.medium != "pool":
                hashes.medium = event.medium
        elif isinstance(event, AllCleared):
            batch.events.add().all_cleared.SetInParent()
        else:
            raise TypeError(f"unknown KV event {event!r}")
    return batch.SerializeToString()


def decode_kv_events(data: bytes) -> tuple[int, list[KVEvent]]:
    """(cursor, events) from `encode_kv_events`; SchemaVersionMismatch for another schema version,
    ValueError for bytes that are not a KVEventBatch."""
    batch = pb2.KVEventBatch()
    try:
        batch.ParseFromString(bytes(data))
    except DecodeError as e:
        raise ValueError(f"KV events: not a KVEventBatch message: {e}") from None
    check_version(f"KV events from replica {batch.replica_id or '?'}", batch.schema_version)
    events: list[KVEvent] = []
    for e in batch.events:
        kind = e.WhichOneof("kind")
        if kind == "stored":
            events.append(BlockStored(list(e.stored.hashes), _medium(e.stored.medium, batch.replica_id)))
        elif kind == "removed":
            events.append(BlockRemoved(list(e.removed.hashes), _medium(e.removed.medium, batch.replica_id)))
        elif kind == "all_cleared":
            events.append(AllCleared())
        else:
            raise ValueError(f"KV events from replica {batch.replica_id or '?'}: an event of unknown kind")
    return batch.cursor, events


def _medium(name: str, replica_id: str) -> str:
    medium = name or "pool"
    if medium not in MEDIA:
        raise ValueError(f"KV events from replica {replica_id or '?'}: medium {name!r} is not one of {MEDIA}")
    return medium
