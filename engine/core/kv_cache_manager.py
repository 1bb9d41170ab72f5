"""KVCacheManager: which physical blocks each request holds, prefix-cache lookups, CoW forks, swap.

Ownership: the manager holds one reference per (request, block). `free(request)` drops them all;
blocks shared with a fork sibling or cached for a prefix survive until their last reference goes.
"Does not fit now" is returned as None, never raised: the scheduler answers it by preempting.
With an offload tier (engine/core/kv_tier.py) evicted prefix blocks are kept beyond the pool, and
`tier_hits` finds the ones a lookup can load back.

Layer groups (`windows`: one per group; records/kv_groups.py: KVGroups): usually one group, whose
window is None, or the sliding window where every layer attends to at most that many tokens (as
Mistral v0.1's do). With hybrid groups (Gemma 2/3: local and global layers) each group has a table
of its own, drawn from the one pool, and a request's list interleaves them: logical block j of
group g is entry j * num_groups + g. A group with a window (a local one) releases the blocks wholly
before the window of a request's next query as it advances, their places taken by NULL_BLOCK, so
it holds at most window / block_size + 2 blocks of a long sequence. Released blocks keep their
prefix-cache entries (their KV is valid; a later prefix hit takes them back). A prefix hit needs
every block of a global group but of a local one only those the first query's window reads. A
request that exports its KV to a decode engine (`remote_decode`) keeps all of its blocks: the pull
reads them whole. Each group caches its blocks under its own key of a block's hash (`group_key`);
group 0's is the hash itself, which is all the router's KV events report.
"""
from __future__ import annotations

from engine.core.block_pool import NULL_BLOCK, BlockPool, KVCacheBlock
from engine.core.kv_tier import KVTier
from records.hashing import BlockHash
from records.kv_events import BlockRemoved, BlockStored, KVEvent
from records.request import BlockHolder, Request

HASH_BYTES = 32        # a block hash's length (records/hashing.py); other groups' keys are longer


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a block of `group` (the hash itself for group 0)."""
    return block_hash if group == 0 else block_hash + bytes((group,))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_cpu_blocks: int = 0, tier_slots: tuple[int, int] = (0, 0),
                 windows: tuple[int | None, ...] = (None,)) -> None:
        """tier_slots: (host, disk) slots of the offload tier; (0, 0): none (prefix caching only).
        windows: each layer group's sliding window (None: global; see the module); the local
        groups share one window."""
        self.block_size = block_size
        self.windows = windows
        self.num_groups = len(windows)
        self.local_groups = [g for g, w in enumerate(windows) if w]
        self.global_groups = [g for g, w in enumerate(windows) if not w]
        assert len({windows[g] for g in self.local_groups}) <= 1, f"local groups of several windows: {windows}"
        self.sliding_window = windows[self.local_groups[0]] if self.local_groups else None
        self.num_released: dict[str, int] = {}           # leading logical blocks the window released
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.tier: KVTier | None = None
        if enable_caching and tier_slots[0] > 0:
            self.tier = KVTier(*tier_slots, record=self.block_pool._record)
            self.block_pool.on_evict = self.tier.offload
            self.block_pool.snapshot_extra = self.tier.snapshot
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Each request's block ids, kept as its list grows (`block_ids`: a step asks for every
        # scheduled request's whole table, O(context) each time when rebuilt); dropped where a
        # list changes other than by growing.
        self._block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}       # leading blocks already registered as cached
        self.uncacheable: set[str] = set()                # requests whose blocks are never cached (old weights)
        # CPU pool for swap preemption: block ids only; the worker owns the tensors.
        self.num_cpu_blocks = num_cpu_blocks
        self.free_cpu_blocks: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.swapped: dict[str, list[int]] = {}           # request id -> its CPU block ids
        self.pending_copies: list[tuple[int, int]] = []   # CoW copies for the next step
        self.prefix_cache_queries = 0                     # tokens looked up
        self.prefix_cache_hits = 0                        # tokens found

    # --- queries --------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table. The list is the manager's own, extended as the request's
        blocks grow (as the scheduler hands the runner the request's own token lists): read it
        within the step, copy it to keep it."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return []
        ids = self._block_ids.get(request_id)
        if ids is None or len(ids) > len(blocks):
            ids = self._block_ids[request_id] = [b.block_id for b in blocks]
        elif len(ids) < len(blocks):
            ids.extend([b.block_id for b in blocks[len(ids):]])
        return ids

    def num_held_blocks(self, request_id: str) -> int:
        """Pool blocks the request holds (its list less the places a window released)."""
        return sum(b is not NULL_BLOCK for b in self.req_to_blocks.get(request_id, ()))

    def num_blocks_for(self, num_tokens: int) -> int:
        """Logical blocks (in each group's table) covering `num_tokens`."""
        return -(-num_tokens // self.block_size)

    def keys(self, block_hashes: list[BlockHash]) -> list[BlockHash]:
        """The prefix-cache keys of these logical blocks' entries in the interleaved list."""
        if self.num_groups == 1:
            return list(block_hashes)
        return [group_key(h, g) for h in block_hashes for g in range(self.num_groups)]

    def _whole_groups(self, num_entries: int) -> int:
        """`num_entries` of an interleaved list rounded down to whole logical blocks."""
        return num_entries - num_entries % self.num_groups

    def first_read(self, position: int) -> int:
        """The first logical block the local groups read for a query at `position`."""
        return max(0, position - self.sliding_window + 1) // self.block_size if self.sliding_window else 0

    # --- prefix cache -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of the request's leading full blocks that are cached; (blocks, num tokens).

        Capped so that at least the last token is recomputed (its logits are needed). Takes no
        reference and counts nothing: pass the blocks to `allocate_slots`, and call
        `record_prefix_lookup` once the request is admitted.
        """
        if not self.enable_caching or request.sampling_params.reads_whole_prompt:
            return [], 0
        limit = request.num_tokens if request.compute_limit is None else request.compute_limit
        max_blocks = (limit - 1) // self.block_size
        lookup = self.block_pool.get_cached_block
        if not self.local_groups or request.remote_decode:     # every block of every group
            hits = self.cached_run(request.block_hashes[:max_blocks])
            return hits, len(hits) // self.num_groups * self.block_size
        # Local groups: a hit of k blocks needs their blocks [first_read(k * block_size), k) only.
        rows: list[list[KVCacheBlock | None]] = []
        run = 0                 # the local groups' consecutive cached blocks ending at the last row
        best = 0
        for j, block_hash in enumerate(request.block_hashes[:max_blocks]):
            row = [lookup(group_key(block_hash, g)) for g in range(self.num_groups)]
            if any(row[g] is None for g in self.global_groups):
                break
            rows.append(row)
            run = run + 1 if all(row[g] is not None for g in self.local_groups) else 0
            if run >= j + 1 - self.first_read((j + 1) * self.block_size):
                best = j + 1
        first = self.first_read(best * self.block_size)
        hits = [NULL_BLOCK if g in self.local_groups and j < first else row[g]   # type: ignore[misc]
                for j, row in enumerate(rows[:best]) for g in range(self.num_groups)]
        return hits, best * self.block_size

    def tier_hits(self, request: Request, num_pool_hits: int, max_blocks: int
                  ) -> tuple[list[BlockHash], list[tuple[str, int]]]:
        """The request's blocks after its `num_pool_hits` leading pool hits that the offload tier
        holds (the leading run of them, at most `max_blocks`, and never the block of its last
        token): (their hashes, their (medium, slot))."""
        if self.tier is None or max_blocks <= 0 or request.sampling_params.reads_whole_prompt:
            return [], []
        limit = request.num_tokens if request.compute_limit is None else request.compute_limit
        end = min((limit - 1) // self.block_size, num_pool_hits + max_blocks // self.num_groups)
        keys = self.keys(request.block_hashes[num_pool_hits:end])
        found = self.tier.hits(keys)
        found = found[:self._whole_groups(len(found))]
        return keys[:len(found)], found

    def cached_run(self, block_hashes: list[BlockHash]) -> list[KVCacheBlock]:
        """The pool's blocks (every group's, interleaved) of the leading run of logical blocks
        `block_hashes` it holds (no reference taken)."""
        blocks = []
        for key in self.keys(block_hashes):
            block = self.block_pool.get_cached_block(key)
            if block is None:
                break
            blocks.append(block)
        return blocks[:self._whole_groups(len(blocks))]

    def hold_prefix(self, holder_id: str, block_hashes: list[BlockHash]) -> tuple[BlockHolder, int]:
        """Take references for `holder_id` (freed by `free(holder)`) on the leading run of
        `block_hashes` the pool holds and, past it, the run the offload tier holds: those get new
        blocks and are queued as tier loads (run the tier's orders, then `confirm_prefix`).
        Returns (the holder, logical blocks from the pool)."""
        assert holder_id not in self.req_to_blocks, holder_id
        blocks = self.cached_run(block_hashes)
        num_pool = len(blocks) // self.num_groups
        self.block_pool.touch(blocks)        # first: allocating for the tier's blocks must not evict them
        if self.tier is not None and num_pool < len(block_hashes):
            keys = self.keys(block_hashes[num_pool:])
            found = self.tier.hits(keys)[:self.block_pool.num_free_blocks]
            found = found[:self._whole_groups(len(found))]
            if found:
                new = self.block_pool.get_new_blocks(len(found))
                self.tier.load(keys[:len(found)], found, [b.block_id for b in new])
                blocks += new
        self.req_to_blocks[holder_id] = blocks
        self._block_ids.pop(holder_id, None)
        self.num_cached_blocks[holder_id] = num_pool
        return BlockHolder(holder_id), num_pool

    def confirm_prefix(self, holder: BlockHolder, block_hashes: list[BlockHash], failed_block_ids: set[int]) -> int:
        """After `hold_prefix`'s tier loads ran: keep the leading run of blocks that loaded (cached
        under their hashes), free the rest; returns the logical blocks held."""
        blocks, g = self.req_to_blocks[holder.request_id], self.num_groups
        start = self.num_cached_blocks[holder.request_id]
        good = next((i for i in range(start * g, len(blocks)) if blocks[i].block_id in failed_block_ids), len(blocks))
        good -= good % g
        self.block_pool.free_blocks(list(reversed(blocks[good:])))
        del blocks[good:]
        self._block_ids.pop(holder.request_id, None)
        self.block_pool.cache_blocks(blocks[start * g:good], self.keys(block_hashes[start:good // g]))
        self.num_cached_blocks[holder.request_id] = good // g
        return good // g

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    # --- allocation -------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       cache: bool = True) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` are prefix-cache hits (from `get_computed_blocks`) that this call
        references; the caller then advances `num_computed_tokens` past them. A write into a block
        shared with a fork sibling first copies it (copy-on-write; the copy is queued in
        `pending_copies`). Blocks are registered in the prefix cache as they are allocated (the step
        that fills them runs before any later request can read them); `cache=False` defers that for
        blocks filled from elsewhere (a remote pull): call `cache_full_blocks` once they hold their
        KV. Returns the newly allocated blocks, or None if they do not fit (then nothing changed).
        """
        g = self.num_groups
        if num_new_tokens == 1 and not new_computed_blocks:
            # A decode step's usual case, answered without the general bookkeeping (a few µs per
            # request per step): the token lands in the request's own partial last block.
            blocks = self.req_to_blocks.get(request.request_id)
            pos = request.num_computed_tokens
            last = pos // self.block_size * g
            window = self.sliding_window
            if (blocks and pos % self.block_size and last + g <= len(blocks)
                    and all(b.ref_cnt == 1 for b in blocks[last:last + g])
                    and not (window and (pos - window + 1) % self.block_size == 0)):
                if cache:
                    self.cache_full_blocks(request, pos + 1)
                return []
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) // g * self.block_size
        num_required = self.num_blocks_for(num_computed + num_new_tokens) * g
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # The first write lands inside an existing partial block shared with a sibling: copy it.
        cow_indices: list[int] = []
        if num_new_tokens > 0 and num_computed % self.block_size and not new_computed_blocks:
            last = num_computed // self.block_size * g
            cow_indices = [i for i in range(last, min(last + g, len(blocks))) if blocks[i].ref_cnt > 1]
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        needed = num_new_blocks + len(cow_indices) + num_evictable_hits
        if needed > self.block_pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
                self._block_ids.pop(request.request_id, None)
            return None

        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        for i in cow_indices:
            [copy] = self.block_pool.get_new_blocks(1)
            self.pending_copies.append((blocks[i].block_id, copy.block_id))
            self.block_pool.free_blocks([blocks[i]])
            blocks[i] = copy
            self._block_ids.pop(request.request_id, None)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if cache:
            self.cache_full_blocks(request, num_computed + num_new_tokens)
        if self.sliding_window and not request.remote_decode:
            self._release_behind_window(request.request_id, blocks, num_computed)
        return new_blocks

    def _release_behind_window(self, rid: str, blocks: list[KVCacheBlock], first_query: int) -> None:
        """Release the local groups' blocks wholly before the window of the query at position
        `first_query` (the step's first; later ones see later keys). With prefix caching, only blocks
        already registered (a pulled block is registered once its KV has landed: until then it stays)."""
        end = self.first_read(first_query)
        if self.enable_caching:
            end = min(end, self.num_cached_blocks.get(rid, 0))
        start = self.num_released.get(rid, 0)
        if end > start:
            g = self.num_groups
            released = [j * g + group for j in range(start, end) for group in self.local_groups]
            self.block_pool.free_blocks([blocks[i] for i in released])
            for i in released:
                blocks[i] = NULL_BLOCK
            self._block_ids.pop(rid, None)
            self.num_released[rid] = end

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that will be full once `num_tokens` tokens are computed."""
        rid = request.request_id
        if not self.enable_caching or rid in self.uncacheable:
            return
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if end > start:
            blocks, g = self.req_to_blocks[rid], self.num_groups
            self.block_pool.cache_blocks(blocks[start * g:end * g], self.keys(request.block_hashes[start:end]))
            self.num_cached_blocks[rid] = end

    def uncache_from(self, request: Request, num_computed_tokens: int) -> None:
        """Take the request's blocks that are not fully computed (from token `num_computed_tokens`
        on) out of the prefix cache: their KV was never written (a failed step)."""
        rid = request.request_id
        first = num_computed_tokens // self.block_size
        self.block_pool.uncache(self.req_to_blocks.get(rid, [])[first * self.num_groups:])
        if self.num_cached_blocks.get(rid, 0) > first:
            self.num_cached_blocks[rid] = first

    def free(self, request: Request | BlockHolder) -> None:
        """Drop the request's references (device and CPU). Tail blocks are freed first, so they are
        evicted before the shared prefix blocks."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self._block_ids.pop(rid, None)
        self.block_pool.free_blocks(list(reversed(blocks)))
        self.num_cached_blocks.pop(rid, None)
        self.num_released.pop(rid, None)
        self.uncacheable.discard(rid)
        self.free_cpu_blocks.extend(c for c in self.swapped.pop(rid, []) if c >= 0)

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` references to all of `parent`'s blocks (copy-on-write on the next write)."""
        blocks = self.req_to_blocks[parent.request_id]
        for block in blocks:
            if block is not NULL_BLOCK:
                block.ref_cnt += 1
        self.req_to_blocks[child.request_id] = list(blocks)
        self._block_ids.pop(child.request_id, None)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)
        if parent.request_id in self.num_released:
            self.num_released[child.request_id] = self.num_released[parent.request_id]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # --- swap -------------------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the CPU pool; returns (device, cpu) copies, or None if the
        CPU pool is too small (the caller then recomputes instead). A window's released places
        stay released (CPU id -1)."""
        rid = request.request_id
        used = self.req_to_blocks.get(rid, [])[:self.num_blocks_for(request.num_computed_tokens) * self.num_groups]
        if sum(b is not NULL_BLOCK for b in used) > len(self.free_cpu_blocks):
            return None
        cpu_ids = [-1 if b is NULL_BLOCK else self.free_cpu_blocks.pop() for b in used]
        mapping = [(b.block_id, c) for b, c in zip(used, cpu_ids) if c >= 0]
        released, marked = self.num_released.get(rid, 0), rid in self.uncacheable
        self.free(request)
        self.swapped[rid] = cpu_ids
        if released:
            self.num_released[rid] = released
        if marked:
            self.uncacheable.add(rid)
        return mapping

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request's blocks back; returns (cpu, device) copies or None if the device
        pool lacks room now."""
        rid = request.request_id
        cpu_ids = self.swapped[rid]
        held = [c for c in cpu_ids if c >= 0]
        if len(held) > self.block_pool.num_free_blocks:
            return None
        new = iter(self.block_pool.get_new_blocks(len(held)))
        blocks = [NULL_BLOCK if c < 0 else next(new) for c in cpu_ids]
        self.req_to_blocks[rid] = blocks
        self._block_ids.pop(rid, None)
        del self.swapped[rid]
        self.free_cpu_blocks.extend(held)
        self.num_cached_blocks[rid] = 0
        self.cache_full_blocks(request, request.num_computed_tokens)
        return [(c, b.block_id) for c, b in zip(cpu_ids, blocks) if c >= 0]

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """Forget every cached block, in the pool and the tier (refused while blocks are in use,
        unless `force`: a weight update, after which the requests holding blocks, their KV the old
        weights', register none of theirs either)."""
        if not self.block_pool.reset_prefix_cache(force):
            return False
        self.uncacheable.update(self.req_to_blocks, self.swapped)
        if self.tier is not None:
            self.tier.clear()
        return True

    def take_events(self) -> list[KVEvent]:
        """The cache's changes since the last call, for the router: group 0's blocks (the others'
        keys are not hashes the router computes)."""
        events = self.block_pool.take_events()
        if self.num_groups == 1:
            return events
        for event in events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                event.block_hashes = [h for h in event.block_hashes if len(h) == HASH_BYTES]
        return [e for e in events if not isinstance(e, (BlockStored, BlockRemoved)) or e.block_hashes]

    def check_no_leaks(self) -> None:
        """Raise AssertionError unless every block is free (for tests and shutdown)."""
        assert not self.req_to_blocks, f"requests still hold blocks: {list(self.req_to_blocks)}"
        assert not self._block_ids, f"block tables outlive their requests: {list(self._block_ids)}"
        assert not self.swapped, f"requests still hold CPU blocks: {list(self.swapped)}"
        held = [b for b in self.block_pool.blocks if b.ref_cnt]
        assert not held, f"blocks still referenced: {held[:8]}"
        assert self.block_pool.num_free_blocks == self.block_pool.num_blocks
        assert len(self.free_cpu_blocks) == self.num_cpu_blocks
        assert not self.num_released, f"released-block counts outlive their requests: {list(self.num_released)}"
        assert not self.uncacheable, f"requests outlive their uncacheable mark: {list(self.uncacheable)}"
        if self.tier is not None:         # every tier slot is either free or holds one block
            for medium, entries in self.tier.entries.items():
                slots = sorted([*entries.values(), *self.tier.free[medium]])
                assert slots == list(range(self.tier.num_slots[medium])), f"{medium} tier slots leaked"
