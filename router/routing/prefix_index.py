"""PrefixIndex: which block hashes each replica holds, kept exactly from its engine's KV events.

Engines report `BlockStored` when a full block gets its hash (prefix-cacheable), `BlockRemoved` when
an evicted block loses it, and `AllCleared` when the cache is reset. Applying them in order gives the
set of hashes each replica can serve from cache; `match()` is the longest run of a prompt's leading
block hashes that a replica holds (a hit is only usable as a prefix: the hash chain makes block i's
hash depend on every block before it).

Kept for lookups at hundreds of replicas (benchmarks/router_decision.py): each replica has a bit,
and each hash the bits of the replicas holding it (an int). A prompt's runs (`runs`) are found by
galloping along its hashes while the set of replicas holding them all stays the same (a shared
system prompt held by all, then one replica's conversation), a probe per doubling rather than a
lookup per block; the replicas whose run ends at a block are the bits that dropped there, nothing is
done for each replica that holds none of it, and `match_sparse` names only the replicas whose run
differs from most.

A replica with an offload tier (engine/core/kv_tier.py) also reports the blocks its tier holds
(events whose medium is "host" or "disk"); `match_tiers` counts those after the pool's run, which
the replica loads instead of recomputing.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import repeat

import numpy as np

from records.hashing import BlockHash
from records.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent


class PrefixIndex:
    def __init__(self) -> None:
        self._bit: dict[str, int] = {}                    # replica id -> its bit
        self._names: list[str | None] = []                # bit -> replica id (None: free)
        self._holders: dict[BlockHash, int] = {}          # hash -> bits of the replicas whose pool holds it
        self._held: dict[str, set[BlockHash]] = {}
        self._tier: dict[str, dict[str, set[BlockHash]]] = {}     # replica -> medium -> hashes
        self._tier_blocks = 0                             # held by every replica's tier, in all
        self._all = 0                                     # every replica's bit
        # bit -> blocks its pool holds, and a 0 after the last bit (for ids not here): the policy's
        # tie-break counts hundreds of replicas' blocks at once (`num_blocks_of`).
        self._count = np.zeros(1, np.int64)
        self._count_rows: tuple[list[str], np.ndarray] | None = None   # the last ids asked for, their rows

    @property
    def replica_ids(self) -> list[str]:
        return list(self._held)

    def add_replica(self, replica_id: str) -> None:
        if replica_id in self._held:
            return
        self._held[replica_id] = set()
        self._tier[replica_id] = {}
        bit = next((i for i, name in enumerate(self._names) if name is None), len(self._names))
        if bit == len(self._names):
            self._names.append(None)
            self._count = np.zeros(len(self._names) + 1, np.int64)
            self._count[:bit] = [len(self._held.get(r, ())) if r else 0 for r in self._names[:bit]]
        self._names[bit] = replica_id
        self._bit[replica_id] = bit
        self._all |= 1 << bit
        self._count_rows = None

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica (dead or drained): nothing routes to its cache any more."""
        if replica_id not in self._held:
            return
        self._unhold(replica_id, self._held.pop(replica_id))
        self._tier_blocks -= self.num_tier_blocks(replica_id)
        self._tier.pop(replica_id, None)
        bit = self._bit.pop(replica_id)
        self._names[bit] = None
        self._all &= ~(1 << bit)
        self._count[bit] = 0
        self._count_rows = None

    def _unhold(self, replica_id: str, hashes: Iterable[BlockHash]) -> None:
        clear = ~(1 << self._bit[replica_id])
        holders = self._holders
        for h in hashes:
            mask = holders[h] & clear
            if mask:
                holders[h] = mask
            else:
                del holders[h]

    def apply(self, replica_id: str, events: Iterable[KVEvent]) -> None:
        """Apply one replica's events in the order the engine emitted them."""
        self.add_replica(replica_id)
        held, tier, bit = self._held[replica_id], self._tier[replica_id], 1 << self._bit[replica_id]
        holders = self._holders
        for event in events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                if event.medium != "pool":
                    where = tier.setdefault(event.medium, set())
                    before = len(where)
                    if isinstance(event, BlockStored):
                        where.update(event.block_hashes)
                    else:
                        where.difference_update(event.block_hashes)
                    self._tier_blocks += len(where) - before
                elif isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        if h not in held:
                            held.add(h)
                            holders[h] = holders.get(h, 0) | bit
                else:
                    gone = [h for h in event.block_hashes if h in held]
                    held.difference_update(gone)
                    self._unhold(replica_id, gone)
            elif isinstance(event, AllCleared):
                self._unhold(replica_id, held)
                held.clear()
                self._tier_blocks -= sum(len(h) for h in tier.values())
                tier.clear()
            else:
                raise TypeError(f"unknown KV event {event!r}")
        self._count[self._bit[replica_id]] = len(held)

    def num_blocks(self, replica_id: str) -> int:
        return len(self._held.get(replica_id, ()))

    def num_blocks_of(self, replica_ids: Sequence[str]) -> np.ndarray:
        """`num_blocks` of each replica (the policy's tie-break asks it of hundreds at once; the
        rows of the last ids asked for are kept, as a router asks for the same list again)."""
        if self._count_rows is None or self._count_rows[0] != replica_ids:
            absent = len(self._names)
            rows = np.fromiter(map(self._bit.get, replica_ids, repeat(absent)), np.intp, len(replica_ids))
            self._count_rows = (list(replica_ids), rows)
        return self._count[self._count_rows[1]]

    def num_tier_blocks(self, replica_id: str) -> int:
        return sum(len(h) for h in self._tier.get(replica_id, {}).values())

    def holds(self, replica_id: str, block_hash: BlockHash) -> bool:
        return block_hash in self._held.get(replica_id, ())

    def runs(self, block_hashes: Sequence[BlockHash]) -> list[tuple[int, int]]:
        """How long a leading run of `block_hashes` each replica holds, as (blocks, the bits of the
        replicas whose run is that long) for every length some replica holds, shortest first (a
        replica not in any holds none). Each run's end is found by galloping (probes 1, 2, 4, ...
        blocks on, then halving): a few dozen lookups for a 750-block prompt, where a walk did 750,
        each a cache miss in a dict of a million hashes. Exact while each replica's cache is
        prefix-closed (it holds every block before one it holds), which the engine's eviction keeps
        (a request's blocks are freed tail first, so a block is never evicted before its
        descendants); where a cache has a hole (a duplicate block left uncached under a cached
        child, an invalidated load), a run may count blocks past the hole: that replica's hit is
        overestimated, and it computes what it lacks."""
        holders, out, n = self._holders, [], len(block_hashes)
        active, i = self._all, 0
        while active and i < n:
            i = self._run_end(block_hashes, i, active)
            if i == n:
                break
            now = active & holders.get(block_hashes[i], 0)
            out.append((i, active & ~now))          # their runs end before block i
            active, i = now, i + 1
        if active:
            out.append((n, active))
        return out

    def _run_end(self, block_hashes: Sequence[BlockHash], start: int, active: int) -> int:
        """The first block at or after `start` that not every replica in `active` holds (len if none)."""
        n = len(block_hashes)
        if active & (active - 1):
            holders = self._holders

            def short(h: BlockHash) -> bool:
                return holders.get(h, 0) & active != active

            lo, step = start, 1                     # every block before lo is held by all of active
            while lo < n:
                probe = min(lo + step, n) - 1
                if short(block_hashes[probe]):
                    return bisect_left(block_hashes, True, lo, probe, key=short)
                lo, step = probe + 1, step * 2
            return n
        # One replica past what the others hold: the one that served this conversation, whose run
        # reaches its last turn, so the gallop starts from the prompt's end; and it probes that
        # replica's own set, a fraction of the whole map.
        held = self._held[self._names[active.bit_length() - 1]]  # type: ignore[index]

        def short(h: BlockHash) -> bool:
            return h not in held

        hi, step = n, 1                             # every block from hi on is short (none at first)
        while hi > start:
            probe = max(hi - step, start)
            if not short(block_hashes[probe]):
                return bisect_left(block_hashes, True, probe + 1, hi, key=short)
            hi, step = probe, step * 2
        return start

    def match_sparse(self, block_hashes: Sequence[BlockHash]) -> tuple[dict[str, int], int]:
        """`match` as (replica id -> blocks for all but the most common length, that length): a
        router of hundreds of replicas names only the few that differ (`matched.get(r, default)`)."""
        groups = self.runs(block_hashes)
        held_any = 0
        for _, mask in groups:
            held_any |= mask
        groups.append((0, self._all & ~held_any))
        common = max(range(len(groups)), key=lambda i: groups[i][1].bit_count())
        out: dict[str, int] = {}
        for i, (blocks, mask) in enumerate(groups):
            if mask and i != common:
                out.update(dict.fromkeys(self._replicas(mask), blocks))
        return out, groups[common][0]

    def _replicas(self, mask: int) -> list[str]:
        names, out = self._names, []
        while mask:
            low = mask & -mask
            out.append(names[low.bit_length() - 1])
            mask ^= low
        return out

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Replica id -> number of leading `block_hashes` it holds (0 if none)."""
        out = dict.fromkeys(self._held, 0)
        for blocks, mask in self.runs(block_hashes):
            out.update(dict.fromkeys(self._replicas(mask), blocks))
        return out

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

    def has_tiers(self) -> bool:
        """Whether any replica's offload tier holds a block (else `match_tiers` is all zeros)."""
        return self._tier_blocks > 0
