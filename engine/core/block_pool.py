"""Physical KV blocks: ref counts, the free LRU queue, and the hash -> block map of the prefix cache.

Every block object is made up front. A block with ref_cnt 0 sits in the free queue; if it carries a
hash it is still a cache entry and can be "touched" back into use until it reaches the queue's head
and is evicted by an allocation. Freed blocks join the tail, so the least recently freed go first.
Each change to the cached set is recorded as a KV event for the router.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from records.hashing import BlockHash
from records.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent

# Events kept for a reader (the replica, for its routers). Past this many unread ones (an offline
# engine, or a replica no router polls), they are folded into a snapshot of the cache, which a reader
# applies to the same effect: the log stays bounded and the garbage collector does not walk it.
MAX_UNREAD_EVENTS = 4096


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


# What a request's block list holds where a sliding window freed a block (KVCacheManager): no pool
# block, never freed or cached; its id is a valid index, which the kernels never weigh (the
# positions lie before the window).
NULL_BLOCK = KVCacheBlock(0, ref_cnt=1)


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append, and removal anywhere."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not self._tail and block is not None, "no free block"
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.events: list[KVEvent] = []
        # The offload tier (engine/core/kv_tier.py): told of each cached block before it is reused,
        # and what else it holds, for snapshots of the event log.
        self.on_evict: Callable[[Sequence[tuple[int, BlockHash]]], None] | None = None
        self.snapshot_extra: Callable[[], list[KVEvent]] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cache hits, pulling free ones off the free queue."""
        for block in blocks:
            if block is NULL_BLOCK:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their cache entries."""
        assert num_blocks <= self.num_free_blocks, f"asked {num_blocks}, free {self.num_free_blocks}"
        blocks = []
        evicted: list[tuple[int, BlockHash]] = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                evicted.append((block.block_id, block.block_hash))
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        if evicted:
            self._record(BlockRemoved([h for _, h in evicted]))
            if self.on_evict is not None:
                self.on_evict(evicted)
        return blocks

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail in order."""
        for block in blocks:
            if block is NULL_BLOCK:
                continue
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash]) -> None:
        """Register full blocks under their hashes (a hash already cached keeps its first block)."""
        if not self.enable_caching:
            return
        stored = []
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block is NULL_BLOCK or block.block_hash is not None or block_hash in self.cached:
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            stored.append(block_hash)
        if stored:
            self._record(BlockStored(stored))

    def uncache(self, blocks: list[KVCacheBlock]) -> None:
        """Drop these blocks' cache entries (their KV is not what their hash says)."""
        removed = []
        for block in blocks:
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                removed.append(block.block_hash)
                block.block_hash = None
        if removed:
            self._record(BlockRemoved(removed))

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """Forget every cache entry; refused (False) while any block is in use, unless `force` (a
        weight update: every block's KV is the old weights')."""
        if self.num_free_blocks != self.num_blocks and not force:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self._record(AllCleared())
        return True

    def _record(self, event: KVEvent) -> None:
        self.events.append(event)
        if len(self.events) > MAX_UNREAD_EVENTS:
            self.events = self.snapshot()

    def snapshot(self) -> list[KVEvent]:
        """Events that bring a reader's view of this cache (and its tier) in line from any state."""
        extra = self.snapshot_extra() if self.snapshot_extra is not None else []
        return [AllCleared(), BlockStored(list(self.cached)), *extra]

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
