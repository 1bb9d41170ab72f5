"""KV events: what an engine's block pool and offload tier tell routers (engine -> router), in
order: a full block got its hash, blocks left, everything was dropped. Their wire form is
pdserve_proto/kv_events.py."""
from __future__ import annotations

from dataclasses import dataclass

from records.hashing import BlockHash

# Where a cached block lives: the engine's block pool, or a copy in its offload tier (host memory,
# local disk: engine/core/kv_tier.py). A router scores a tier hit below a pool hit (a load, not a
# lookup) and above a miss (a load, not a computation).
MEDIA = ("pool", "host", "disk")


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    medium: str = "pool"


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str = "pool"


@dataclass(slots=True)
class AllCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllCleared
