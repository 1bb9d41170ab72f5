"""KVTier: the offload tier's bookkeeping, the scheduler's side of KV beyond the block pool.

A prefix block the pool evicts is not forgotten: its KV is copied to a bounded host-memory store,
and a host copy pushed out of that store moves on to a bounded local-disk store (when one is
configured; else it is dropped). A prefix lookup that misses the pool and hits the tier loads the
blocks back into new pool blocks instead of recomputing them (vLLM's KV offloading, SGLang's
HiCache, Dynamo's KVBM G2/G3).

This class only decides: which slot of which store holds which block hash (each store an LRU), and
the orders for the workers (engine/worker/kv_tier_store.py holds the bytes, on every rank its own
layers and heads). Orders travel with the step's SchedulerOutput and run before its forward pass:

    ("save", block_id, host_slot)             pool block -> host slot (the block is being reused)
    ("demote", host_slot, disk_slot, tag)     host slot -> disk slot (the host slot is being reused)
    ("load", medium, slot, block_id, tag)     host or disk slot -> a new pool block

A disk slot is written with its block's tag (from its hash) and a load checks it: a slot that does
not hold what the tier says (a file truncated or overwritten under it) fails the load, never
passes wrong KV to the model.

Saves and demotions run first, in the order given (a block is read before this step writes it; a
host slot is demoted before a save overwrites it); loads run after the step's swaps and copies. A
slot a lookup of this step found is pinned until the orders are taken, so no save reuses it first.
Each change is a KV event with its medium ("host" or "disk"), so routers know what the tier holds.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from records.engine_stats import KVTierStats
from records.hashing import BlockHash
from records.kv_events import BlockRemoved, BlockStored, KVEvent

TIER_MEDIA = ("host", "disk")


def block_tag(block_hash: BlockHash) -> int:
    """A nonzero 63-bit tag of a block hash: what a disk slot holding that block starts with."""
    return int.from_bytes(block_hash[:8], "little") >> 1 | 1


@dataclass(slots=True)
class TierStats:
    """Counters since the engine started (engine stats: `kv_tier`)."""
    blocks_saved: int = 0          # evicted pool blocks copied to host
    blocks_demoted: int = 0        # host copies moved to disk
    blocks_dropped: int = 0        # copies that left the tier for good (no room further down)
    host_hit_blocks: int = 0       # blocks loaded back from host instead of recomputed
    disk_hit_blocks: int = 0       # ... from disk
    load_failures: int = 0         # failed loads (their requests recomputed)
    save_failures: int = 0


class KVTier:
    def __init__(self, num_host_slots: int, num_disk_slots: int,
                 record: Callable[[KVEvent], None]) -> None:
        """`record`: where the tier's KV events go (the block pool's event log, in order with its own)."""
        if num_host_slots < 1:
            raise ValueError(f"the offload tier needs at least one host slot; got {num_host_slots}")
        self.num_slots = {"host": num_host_slots, "disk": num_disk_slots}
        self.entries: dict[str, OrderedDict[BlockHash, int]] = {m: OrderedDict() for m in TIER_MEDIA}
        self.free: dict[str, list[int]] = {m: list(range(n - 1, -1, -1)) for m, n in self.num_slots.items()}
        self.pinned: set[tuple[str, int]] = set()
        self.saves: list[tuple] = []
        self.loads: list[tuple] = []
        self.stats = TierStats()
        self._record = record

    # --- queries --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(e) for e in self.entries.values())

    def reading(self, workers: dict[str, float]) -> KVTierStats:
        """The tier's stats: what it holds, its counters, and the workers' bytes and seconds (their
        TierStore.stats summed over the ranks: bytes_saved, bytes_loaded, bytes_written_to_disk,
        seconds)."""
        return KVTierStats(host_blocks=len(self.entries["host"]), disk_blocks=len(self.entries["disk"]),
                           host_slots=self.num_slots["host"], disk_slots=self.num_slots["disk"],
                           **dataclasses.asdict(self.stats), **workers)

    def where(self, block_hash: BlockHash) -> tuple[str, int] | None:
        """(medium, slot) of the block's copy, or None."""
        for medium in TIER_MEDIA:
            slot = self.entries[medium].get(block_hash)
            if slot is not None:
                return medium, slot
        return None

    def hits(self, block_hashes: Sequence[BlockHash]) -> list[tuple[str, int]]:
        """(medium, slot) of the leading run of `block_hashes` the tier holds. Those slots are
        pinned until this step's orders are taken: the allocation that follows a lookup evicts pool
        blocks, whose saves must not push these copies out before `load` reads them."""
        out = []
        for block_hash in block_hashes:
            found = self.where(block_hash)
            if found is None:
                break
            out.append(found)
        self.pinned.update(out)
        return out

    def snapshot(self) -> list[KVEvent]:
        """Events that state what the tier holds (after an AllCleared)."""
        return [BlockStored(list(self.entries[m]), m) for m in TIER_MEDIA if self.entries[m]]

    # --- the pool evicts ------------------------------------------------------------------------
    def offload(self, evicted: Sequence[tuple[int, BlockHash]]) -> None:
        """The pool is reusing these cached blocks (block id, hash): keep a copy of each in host
        memory (one already kept is only marked recently used)."""
        stored = []
        for block_id, block_hash in evicted:
            found = self.where(block_hash)
            if found is not None:
                self.entries[found[0]].move_to_end(block_hash)
                continue
            slot = self._take_slot("host")
            if slot is None:
                continue
            self.saves.append(("save", block_id, slot))
            self.entries["host"][block_hash] = slot
            self.stats.blocks_saved += 1
            stored.append(block_hash)
        if stored:
            self._record(BlockStored(stored, "host"))

    def _take_slot(self, medium: str) -> int | None:
        """A free slot of `medium`, freeing its least recently used unpinned entry if need be (a
        host entry moves to disk when there is a disk store); None if every slot is pinned."""
        if self.free[medium]:
            return self.free[medium].pop()
        entries = self.entries[medium]
        victim = next((h for h, s in entries.items() if (medium, s) not in self.pinned), None)
        if victim is None:
            return None
        slot = entries.pop(victim)
        self._record(BlockRemoved([victim], medium))
        if medium == "host" and self.num_slots["disk"]:
            disk_slot = self._take_slot("disk")
            if disk_slot is not None:
                self.saves.append(("demote", slot, disk_slot, block_tag(victim)))
                self.entries["disk"][victim] = disk_slot
                self.stats.blocks_demoted += 1
                self._record(BlockStored([victim], "disk"))
                return slot
        self.stats.blocks_dropped += 1
        return slot

    # --- a lookup hits ----------------------------------------------------------------------------
    def load(self, block_hashes: Sequence[BlockHash], found: Sequence[tuple[str, int]],
             block_ids: Sequence[int]) -> None:
        """Queue loads of these tier hits (from `hits`) into new pool blocks. The copies stay in the
        tier (a block evicted again needs no second save)."""
        for block_hash, (medium, slot), block_id in zip(block_hashes, found, block_ids, strict=True):
            self.loads.append(("load", medium, slot, block_id, block_tag(block_hash)))
            self.pinned.add((medium, slot))
            self.entries[medium].move_to_end(block_hash)
            if medium == "host":
                self.stats.host_hit_blocks += 1
            else:
                self.stats.disk_hit_blocks += 1

    def take_orders(self) -> tuple[list[tuple], list[tuple]]:
        """(saves and demotions, loads) for this step's SchedulerOutput; unpins the loads' slots."""
        saves, loads = self.saves, self.loads
        self.saves, self.loads, self.pinned = [], [], set()
        return saves, loads

    # --- what went wrong ---------------------------------------------------------------------------
    def forget_failed(self, orders: Sequence[tuple]) -> set[int]:
        """Orders a worker could not carry out: the copies they were to make or read are not to be
        trusted; forget them (their slots are free again). Returns the blocks the failed loads were
        to fill (their requests' KV cannot stand)."""
        bad: dict[str, set[int]] = {m: set() for m in TIER_MEDIA}
        targets = {order[3] for order in orders if order[0] == "load"}
        for order in orders:
            if order[0] == "save":
                bad["host"].add(order[2])
                self.stats.save_failures += 1
            elif order[0] == "demote":
                bad["disk"].add(order[2])
                self.stats.save_failures += 1
            else:
                bad[order[1]].add(order[2])
                self.stats.load_failures += 1
        for medium, slots in bad.items():
            gone = [h for h, s in self.entries[medium].items() if s in slots]
            for block_hash in gone:
                self.free[medium].append(self.entries[medium].pop(block_hash))
            if gone:
                self._record(BlockRemoved(gone, medium))
        return targets

    def clear(self) -> None:
        """Forget every copy (a prefix-cache reset; the caller records AllCleared)."""
        for medium in TIER_MEDIA:
            self.entries[medium].clear()
            self.free[medium] = list(range(self.num_slots[medium] - 1, -1, -1))
        self.saves, self.loads, self.pinned = [], [], set()
