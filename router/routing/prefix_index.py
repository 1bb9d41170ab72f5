"""PrefixIndex: which block hashes each replica holds, kept exactly from its engine's KV events.

Engines report `BlockStored` when a full block gets its hash (prefix-cacheable), `BlockRemoved` when
an evicted block loses it, and `AllCleared` when the cache is reset. Applying them in order gives the
set of hashes each replica can serve from cache; `match()` is the longest run of a prompt's leading
block hashes that a replica holds (a hit is only usable as a prefix: the hash chain makes block i's
hash depend on every block before it).

A replica with an offload tier (engine/core/kv_tier.py) also reports the blocks its tier holds
(events whose medium is "host" or "disk"); `match_tiers` counts those after the pool's run, which
the replica loads instead of recomputing.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from records.hashing import BlockHash
from records.outputs import AllCleared, BlockRemoved, BlockStored, KVEvent


class PrefixIndex:
    def __init__(self) -> None:
        self._held: dict[str, set[BlockHash]] = {}
        self._tier: dict[str, dict[str, set[BlockHash]]] = {}     # replica -> medium -> hashes

    @property
    def replica_ids(self) -> list[str]:
        return list(self._held)

    def add_replica(self, replica_id: str) -> None:
        self._held.setdefault(replica_id, set())
        self._tier.setdefault(replica_id, {})

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica (dead or drained): nothing routes to its cache any more."""
        self._held.pop(replica_id, None)
        self._tier.pop(replica_id, None)

    def apply(self, replica_id: str, events: Iterable[KVEvent]) -> None:
        """Apply one replica's events in the order the engine emitted them."""
        held = self._held.setdefault(replica_id, set())
        tier = self._tier.setdefault(replica_id, {})
        for event in events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                where = held if event.medium == "pool" else tier.setdefault(event.medium, set())
                if isinstance(event, BlockStored):
                    where.update(event.block_hashes)
                else:
                    where.difference_update(event.block_hashes)
            elif isinstance(event, AllCleared):
                held.clear()
                tier.clear()
            else:
                raise TypeError(f"unknown KV event {event!r}")

    def num_blocks(self, replica_id: str) -> int:
        return len(self._held.get(replica_id, ()))

    def num_tier_blocks(self, replica_id: str) -> int:
        return sum(len(h) for h in self._tier.get(replica_id, {}).values())

    def holds(self, replica_id: str, block_hash: BlockHash) -> bool:
        return block_hash in self._held.get(replica_id, ())

    def match_tiers(self, block_hashes: Sequence[BlockHash], pool_matched: dict[str, int]) -> dict[str, int]:
        """Replica id -> blocks its offload tier holds right after its pool's leading run
        (`pool_matched`, from `match`): what it would load rather than compute."""
        out = {}
        for replica_id, media in self._tier.items():
            n = start = pool_matched.get(replica_id, 0)
            if media:
                while n < len(block_hashes) and any(block_hashes[n] in held for held in media.values()):
                    n += 1
            out[replica_id] = n - start
        return out

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Replica id -> number of leading `block_hashes` it holds (0 if none)."""
        out = {}
        for replica_id, held in self._held.items():
            n = 0
            for h in block_hashes:
                if h not in held:
                    break
                n += 1
            out[replica_id] = n
        return out
