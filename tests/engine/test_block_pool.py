"""Block pool, hashing and KV cache manager: unit tests without a model."""
from __future__ import annotations

import subprocess
import sys

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from records.hashing import hash_block_tokens
from records.kv_events import AllCleared, BlockRemoved, BlockStored
from records.request import Request
from records.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], block_size: int = 4, **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), frozenset({0}), block_size, max_tokens=8)


def test_block_hash_is_identical_across_processes():
    tokens = list(range(40))
    here = [h.hex() for h in hash_block_tokens(tokens, 16)]
    code = ("from records.hashing import hash_block_tokens;"
            "print(' '.join(h.hex() for h in hash_block_tokens(list(range(40)), 16)))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.split()
    assert here == there and len(here) == 2
    # The chain: changing block 0 changes block 1's hash; extra keys change every hash.
    other = hash_block_tokens([1] + tokens[1:], 16)
    assert other[1] != bytes.fromhex(here[1])
    salted = hash_block_tokens(tokens, 16, extra_keys=("salt",))
    assert all(a != bytes.fromhex(b) for a, b in zip(salted, here))


def test_free_queue_is_lru_and_eviction_emits_events():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_blocks(blocks[:2], [b"h0", b"h1"])
    assert pool.take_events() == [BlockStored([b"h0", b"h1"])]
    pool.free_blocks([blocks[2], blocks[1], blocks[0]])      # tail first, as a finished request does
    assert pool.num_free_blocks == 4 and pool.usage == 0
    # Cached blocks can be touched back while free.
    hit = pool.get_cached_block(b"h1")
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free_blocks([hit])
    # Allocation takes the never-used block, then the oldest freed ones; evicting h0 emits an event.
    order = [b.block_id for b in pool.get_new_blocks(3)]
    assert order == [3, 2, 0]
    assert pool.take_events() == [BlockRemoved([b"h0"])]
    assert pool.get_cached_block(b"h0") is None and pool.get_cached_block(b"h1") is not None


def test_unread_events_fold_into_a_snapshot_of_the_cache(monkeypatch):
    """Nobody takes the events (an offline engine): the log stays bounded, and what it holds still
    rebuilds the cache's contents when applied as the router applies them."""
    import engine.core.block_pool as block_pool
    from router.routing.prefix_index import PrefixIndex

    monkeypatch.setattr(block_pool, "MAX_UNREAD_EVENTS", 16)
    pool = BlockPool(8, enable_caching=True)
    for i in range(40):                       # allocate, cache, free: stores and evictions
        [block] = pool.get_new_blocks(1)
        pool.cache_blocks([block], [bytes([i]) * 32])
        pool.free_blocks([block])
        assert len(pool.events) <= 16
    index = PrefixIndex()
    index.apply("r", pool.take_events())
    assert index.num_blocks("r") == len(pool.cached) == 8
    assert index.match(list(pool.cached)) == {"r": 8}


def test_reset_prefix_cache_refused_while_blocks_in_use():
    pool = BlockPool(2, enable_caching=True)
    [b] = pool.get_new_blocks(1)
    pool.cache_blocks([b], [b"x"])
    assert not pool.reset_prefix_cache()
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert isinstance(pool.take_events()[-1], AllCleared) and not pool.cached


def test_computed_blocks_leave_the_last_token_to_recompute():
    kv = KVCacheManager(16, block_size=4)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    kv.free(a)
    b = make_request("b", list(range(8)))             # same 8 tokens: 2 full cached blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and len(hits) == 1                  # capped: token 7 is recomputed
    c = make_request("c", list(range(9)))
    hits, n = kv.get_computed_blocks(c)
    assert n == 8
    assert kv.prefix_cache_hits == kv.prefix_cache_queries == 0   # lookups count on admission only
    kv.check_no_leaks()


def test_allocate_returns_none_when_full_and_changes_nothing():
    kv = KVCacheManager(3, block_size=4, enable_caching=False)
    a = make_request("a", list(range(10)))
    assert kv.allocate_slots(a, 10) is not None and kv.num_free_blocks == 0
    b = make_request("b", list(range(3)))
    assert kv.allocate_slots(b, 3) is None
    assert "b" not in kv.req_to_blocks
    kv.free(a)
    kv.check_no_leaks()


def test_fork_then_write_copies_the_shared_partial_block():
    kv = KVCacheManager(8, block_size=4, enable_caching=False)
    parent = make_request("p", list(range(6)))
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork("c", 1)
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    assert kv.block_ids("p") == kv.block_ids("c")
    child.append_output_token(99)
    assert kv.allocate_slots(child, 1) == []           # the write lands in the shared block 1
    [(src, dst)] = kv.take_pending_copies()
    assert src == kv.block_ids("p")[1] and dst == kv.block_ids("c")[1] != src
    assert kv.block_ids("p")[0] == kv.block_ids("c")[0]
    kv.free(parent)
    kv.free(child)
    kv.check_no_leaks()


def test_swap_out_and_in_round_trip_accounting():
    kv = KVCacheManager(4, block_size=4, enable_caching=True, num_cpu_blocks=2)
    r = make_request("r", list(range(7)))
    kv.allocate_slots(r, 7)
    r.num_computed_tokens = 7
    device_ids = kv.block_ids("r")
    out = kv.swap_out(r)
    assert [d for d, _ in out] == device_ids and kv.num_free_blocks == 4
    nothing = make_request("n", list(range(3)))        # holds no computed KV: nothing to copy
    assert kv.swap_out(nothing) == []
    kv.free(nothing)
    back = kv.swap_in(r)
    assert [c for c, _ in back] == [c for _, c in out] and len(kv.block_ids("r")) == 2
    kv.free(r)
    kv.check_no_leaks()
