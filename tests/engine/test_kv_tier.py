"""The offload tier (engine/core/kv_tier.py, engine/worker/kv_tier_store.py): evicted prefix blocks
kept in host memory and on disk, loaded back instead of recomputed, token-identical to transformers
and to the engine without a tier, falling back to recompute when a load fails."""
from __future__ import annotations

import os

import pytest
from helpers import hf_greedy

from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_tier import KVTier, block_tag
from records.engine_args import EngineArgs
from records.kv_events import AllCleared, BlockRemoved, BlockStored
from records.request import Request
from router.routing.prefix_index import PrefixIndex

MAX_TOKENS = 6
SLOT_GIB = 8192 / (1 << 30)     # one block of the tiny models (2 layers, 2 KV heads x 16, fp32, 16 tokens)


# --- bookkeeping, without a model ---------------------------------------------------------------------
def test_tier_keeps_evicted_blocks_lru_demotes_to_disk_and_pins_loaded_slots():
    events = []
    tier = KVTier(2, 1, events.append)
    tier.offload([(5, b"a"), (6, b"b")])
    assert tier.take_orders() == ([("save", 5, 0), ("save", 6, 1)], [])
    assert events == [BlockStored([b"a", b"b"], "host")]
    tier.offload([(5, b"a")])                     # already kept: only marked recently used
    tier.offload([(7, b"c")])                     # host full: its LRU entry ("b") moves to disk
    saves, _ = tier.take_orders()
    assert saves == [("demote", 1, 0, block_tag(b"b")), ("save", 7, 1)]
    assert tier.where(b"b") == ("disk", 0) and tier.where(b"c") == ("host", 1) and tier.where(b"a") == ("host", 0)
    assert events[1:] == [BlockRemoved([b"b"], "host"), BlockStored([b"b"], "disk"), BlockStored([b"c"], "host")]
    # A lookup: the leading run only; its slots are pinned until the orders are taken.
    assert tier.hits([b"a", b"b", b"x", b"c"]) == [("host", 0), ("disk", 0)]
    tier.load([b"a", b"b"], [("host", 0), ("disk", 0)], [10, 11])
    tier.offload([(8, b"d")])       # host full, "a" pinned: "c" goes down, and disk is full: "b" pinned
    saves, loads = tier.take_orders()
    assert loads == [("load", "host", 0, 10, block_tag(b"a")), ("load", "disk", 0, 11, block_tag(b"b"))]
    assert saves == [("save", 8, 1)] and tier.where(b"c") is None and tier.stats.blocks_dropped == 1
    # Failed orders are forgotten; a reset forgets everything.
    tier.forget_failed([loads[1]])
    assert tier.where(b"b") is None and tier.stats.load_failures == 1
    assert tier.snapshot() == [BlockStored([b"a", b"d"], "host")]
    tier.clear()
    assert len(tier) == 0 and tier.hits([b"a"]) == []


def test_manager_offloads_what_the_pool_evicts_and_finds_tier_hits():
    kv = KVCacheManager(4, 4, True, tier_slots=(8, 0))
    req = Request("a", list(range(13)), SamplingParams(), frozenset({0}), 4, max_tokens=8)
    assert kv.allocate_slots(req, 13) is not None
    kv.free(req)
    kv.take_events()
    other = Request("b", list(range(100, 113)), SamplingParams(), frozenset({0}), 4, max_tokens=8)
    assert kv.allocate_slots(other, 13) is not None          # evicts a's three cached blocks
    saves, _ = kv.tier.take_orders()
    assert sorted(o[1] for o in saves) == [0, 1, 2]
    events = kv.take_events()
    assert BlockStored(req.block_hashes[:3][::-1], "host") in events or any(
        isinstance(e, BlockStored) and e.medium == "host" and set(e.block_hashes) == set(req.block_hashes[:3])
        for e in events)
    again = Request("c", list(range(13)), SamplingParams(), frozenset({0}), 4, max_tokens=8)
    hits, _ = kv.get_computed_blocks(again)
    hashes, found = kv.tier_hits(again, len(hits), 8)
    assert hits == [] and hashes == req.block_hashes[:3] and [m for m, _ in found] == ["host"] * 3
    kv.free(other)
    index = PrefixIndex()
    index.apply("r", [AllCleared(), *kv.block_pool.snapshot()])
    assert index.match_tiers(again.block_hashes, index.match(again.block_hashes)) == {"r": 3}


def test_a_lookups_copies_outlive_the_evictions_of_its_own_allocation():
    """The blocks a lookup found in the tier are pinned: allocating the request's blocks evicts pool
    blocks whose saves would otherwise push those very copies out of a full host store."""
    kv = KVCacheManager(4, 4, True, tier_slots=(3, 0))
    make = lambda rid, tokens: Request(rid, list(tokens), SamplingParams(), frozenset({0}), 4, max_tokens=8)  # noqa: E731
    a, b = make("a", range(13)), make("b", range(100, 113))
    for r in (a, b):                      # b's allocation pushes a's three blocks into the host store
        assert kv.allocate_slots(r, 13) is not None
        kv.free(r)
    kv.tier.take_orders()
    again = make("c", range(13))
    hashes, found = kv.tier_hits(again, 0, 4)
    assert len(found) == 3
    assert kv.allocate_slots(again, 13, [], cache=False) is not None     # evicts b's three blocks
    kv.tier.load(hashes, found, kv.block_ids("c")[:3])
    saves, loads = kv.tier.take_orders()
    assert saves == [] and [o[1:3] for o in loads] == found             # b's copies were not kept
    kv.free(again)


def test_offloading_arguments_are_checked():
    with pytest.raises(ValueError, match="kv_offloading_backend must be one of \\('native',\\)"):
        EngineArgs(kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="kv_offloading_size .* is needed"):
        EngineArgs(kv_offloading_disk_path="/tmp", kv_offloading_disk_size=1)
    with pytest.raises(ValueError, match="kv_offloading_size must be a number of GiB > 0"):
        EngineArgs(kv_offloading_size=0)
    with pytest.raises(ValueError, match="go together"):
        EngineArgs(kv_offloading_size=1, kv_offloading_disk_path="/tmp")
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        EngineArgs(kv_offloading_size=1, enable_prefix_caching=False)


# --- the engine -----------------------------------------------------------------------------------------
def _prompts(n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens sharing nothing (their first tokens differ)."""
    return [[(7 * i + 3 * j + 11) % 900 + 5 for j in range(length)] for i in range(n)]


def _rounds(llm: LLM, prompts: list[list[int]], rounds: int = 2) -> tuple[list[list[int]], list[int]]:
    """Each prompt on its own, `rounds` times over: (outputs, cached tokens of each)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs, cached = [], []
    for _ in range(rounds):
        for p in prompts:
            [o] = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            outs.append(o.outputs[0].token_ids)
            cached.append(o.num_cached_tokens)
    return outs, cached


@pytest.fixture(scope="module")
def expected(tiny_llama):
    """What transformers says, and the engine without a tier (a pool of 24 blocks holds about one
    and a half of these prompts: the second round finds nothing of them cached)."""
    prompts = _prompts(6, 250)
    oracle = hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=24, max_model_len=384)
    outs, cached = _rounds(llm, prompts)
    assert outs == oracle * 2 and sum(cached) == 0
    return prompts, outs, llm.llm_engine.stats().prompt_tokens_computed


@pytest.mark.parametrize("tier", ["host", "host+disk"])
def test_tier_hits_load_instead_of_recompute_token_identical(tiny_llama, expected, tier, tmp_path):
    prompts, want, computed_without = expected
    args = {"kv_offloading_size": 200 * SLOT_GIB}
    if tier == "host+disk":          # a host store too small for one prompt: the disk holds them
        args = {"kv_offloading_size": 8 * SLOT_GIB, "kv_offloading_disk_path": str(tmp_path),
                "kv_offloading_disk_size": 200 * SLOT_GIB}
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=24, max_model_len=384, **args)
    outs, cached = _rounds(llm, prompts)
    assert outs == want
    stats = llm.llm_engine.stats()
    # Round two loads every full block but the last token's: 15 of each prompt's 16 blocks.
    assert cached[:6] == [0] * 6 and cached[6:] == [15 * 16] * 6
    assert stats.prompt_tokens_computed == computed_without - 6 * 15 * 16
    hits = stats.kv_tier.host_hit_blocks + stats.kv_tier.disk_hit_blocks
    assert hits == 6 * 15 and stats.kv_tier.load_failures == 0
    assert stats.kv_tier.bytes_loaded == hits * 8192 and stats.kv_tier.seconds > 0
    if tier == "host+disk":
        assert stats.kv_tier.disk_hit_blocks > 60 and stats.kv_tier.bytes_written_to_disk > 0
        assert os.listdir(tmp_path) == []           # the file was unlinked once open
    # The events say where each block is: a router's index agrees with the tier.
    index = PrefixIndex()
    index.apply("r", llm.llm_engine.kv_cache_manager.block_pool.snapshot())
    assert index.num_tier_blocks("r") == len(llm.llm_engine.kv_cache_manager.tier)


@pytest.mark.parametrize("fault", ["injected", "truncated-disk-file"])
def test_a_failed_tier_load_recomputes_with_identical_output(tiny_llama, expected, tmp_path, fault):
    prompts, want, _ = expected
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=24, max_model_len=384,
              kv_offloading_size=8 * SLOT_GIB, kv_offloading_disk_path=str(tmp_path),
              kv_offloading_disk_size=200 * SLOT_GIB)
    outs, _ = _rounds(llm, prompts, rounds=1)
    store = llm.llm_engine.executor.worker.tier_store
    store.flush()
    if fault == "injected":
        store.fail_loads = 20
    else:
        os.ftruncate(store.fd, 0)                 # every disk read from here on comes back short
    more, cached = _rounds(llm, prompts, rounds=1)
    assert outs + more == want
    stats = llm.llm_engine.stats()
    assert stats.kv_tier.load_failures >= (20 if fault == "injected" else 30)
    assert 0 in cached                            # a failed request recomputed its prompt
    # The failed copies were forgotten: nothing is left to fail again.
    assert stats.kv_tier.disk_blocks < 200
