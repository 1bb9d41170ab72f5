"""Hybrid KV cache groups (records/kv_groups.py: KVGroups, vLLM's hybrid KV cache manager): where
local and global layers mix (Gemma 2, 3) each group has a table of its own and the local ones release
the blocks behind their window, so a long sequence holds about (local layers x window + global layers
x length) of KV; output token-identical to transformers, with prefix hits, swap and the offload tier.
(P/D transfer of hybrid tables: tests/kv_transfer's Gemma families.)"""
from __future__ import annotations

import pytest
from helpers import hf_greedy, mixed_prompts, save_random_model

from engine import LLM, SamplingParams
from engine.core.block_pool import NULL_BLOCK
from engine.core.kv_cache_manager import KVCacheManager
from records.config_resolution import engine_config
from records.kv_groups import KVGroups
from records.request import Request

WINDOW, BLOCK = 512, 16
PROMPT, OUTPUT = 4000, 96           # a sequence of 4,096 tokens


def test_groups_of_equal_size_with_the_local_ones_last():
    """Gemma 3's 5:1 of 12 layers: groups of the two global layers' size; 26 layers (Gemma 3 1B's
    four global): groups of four, the last local one padded; Gemma 2's 1:1: two groups; one window
    everywhere, no window, or hybrid off: one group, a tensor per layer."""
    five_to_one = tuple(None if i % 6 == 5 else WINDOW for i in range(12))
    groups = KVGroups.of(five_to_one, hybrid=True)
    assert groups.windows == (None,) + (WINDOW,) * 5 and groups.num_slots == 2
    assert groups.layer_slots[5] == (0, 0) and groups.layer_slots[11] == (0, 1)
    assert groups.layer_slots[:5] == ((1, 0), (1, 1), (2, 0), (2, 1), (3, 0))
    gemma3_1b = tuple(None if i % 6 == 5 else WINDOW for i in range(26))
    groups = KVGroups.of(gemma3_1b, hybrid=True)
    assert groups.num_slots == 4 and groups.windows == (None,) + (WINDOW,) * 6
    assert sum(g == 6 for g, _ in groups.layer_slots) == 2          # 22 local layers: 5 x 4 + 2
    assert KVGroups.of((WINDOW, None) * 3, hybrid=True).windows == (None, WINDOW)
    assert KVGroups.of((WINDOW,) * 4, hybrid=True) == KVGroups((WINDOW,), tuple((0, i) for i in range(4)), 4)
    assert KVGroups.of(five_to_one, hybrid=False).windows == (None,)
    assert KVGroups.of((None,) * 3, hybrid=True).windows == (None,)


def _request(rid: str, n: int) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(), frozenset({0}), 16, max_tokens=8)


def test_manager_gives_each_group_its_table_and_releases_only_the_local_ones():
    """A global and a local group (window 32, 16-token blocks), interleaved in one list: the local
    group's blocks behind the window go back to the pool (still cached), the global group's stay; a
    prefix hit takes the local group's only where the first query's window reads; a fork copies
    each group's partial block on write; swap keeps released places released; the router hears only
    the global group's blocks, under their own hashes."""
    kv = KVCacheManager(64, 16, True, num_cpu_blocks=32, windows=(None, 32))
    a = _request("a", 200)
    assert len(kv.allocate_slots(a, 200)) == 26            # 13 logical blocks x 2 groups
    a.num_computed_tokens = 207         # the query whose window first leaves block 10 behind
    assert kv.allocate_slots(a, 1) == []
    table = kv.block_ids("a")
    # first_read(207) = (207 - 31) // 16 = 11: the local group's blocks 0-10 released
    assert [table[2 * j + 1] == NULL_BLOCK.block_id for j in range(13)] == [True] * 11 + [False] * 2
    assert kv.num_held_blocks("a") == 13 + 2
    assert all(len(h) == 32 for e in kv.take_events() for h in getattr(e, "block_hashes", []))
    # The same prompt again: 12 full blocks hit, of the local group only those from block 10 on
    # (first_read(192) = 10): block 10, released but still cached, is taken back.
    b = _request("b", 200)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 192 and len(hits) == 24
    assert [hits[2 * j + 1] is NULL_BLOCK for j in range(12)] == [True] * 10 + [False] * 2
    assert all(hits[2 * j] is not NULL_BLOCK for j in range(12))
    # A fork writing into the shared partial block copies it in both groups.
    child = _request("c", 200)
    child.num_computed_tokens = 207
    kv.fork(a, child)
    assert kv.allocate_slots(child, 1) is not None and len(kv.take_pending_copies()) == 2
    # Swap: the released places stay released (-1), the rest go to the CPU pool and back.
    mapping = kv.swap_out(a)
    assert len(mapping) == 15 and kv.swapped["a"].count(-1) == 11
    assert len(kv.swap_in(a)) == 15 and kv.block_ids("a")[1] == NULL_BLOCK.block_id
    for r in (a, child):
        kv.free(r)
    kv.check_no_leaks()


@pytest.fixture(scope="module")
def gemma3_5to1(tmp_path_factory, smol_tokenizer) -> str:
    """Gemma 3 of six layers, five local (window 512) to one global, 8k positions."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=len(smol_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=8192, sliding_window=WINDOW, bos_token_id=smol_tokenizer.bos_token_id,
        eos_token_id=smol_tokenizer.eos_token_id,
        layer_types=["sliding_attention"] * 5 + ["full_attention"])
    out = save_random_model(tmp_path_factory, config, "gemma3-5to1", seed=13)
    smol_tokenizer.save_pretrained(out)
    return out


def _held_pages(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Run one request alone, step by step: (its tokens, the most layer pages its blocks held at the
    end of any decode step: blocks held x the layers one block is a page of). (The blocks of the
    last prefill chunk that fall behind the window go at the next step's allocation, as vLLM's.)"""
    engine = llm.llm_engine
    engine.add_request("long", None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    kv, groups = engine.kv_cache_manager, engine.config.kv_groups
    peak, tokens = 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if len(tokens) > 1 and engine.has_unfinished_requests():
            peak = max(peak, kv.num_held_blocks("long") * groups.num_slots)
    engine.check_no_leaks()
    return tokens, peak


def test_a_long_gemma3_sequence_holds_only_its_local_windows(gemma3_5to1):
    """4,096 tokens (a 4,000-token prompt, 96 out): at most local x 512 + global x 4,096 tokens of
    pages, plus one block per group, where one table for all held every layer's whole length (6 x
    256 pages); token-identical to transformers either way."""
    prompt = mixed_prompts(900, seed=5)[-1] * 31
    prompt = prompt[:PROMPT]
    expected = hf_greedy(gemma3_5to1, [prompt], OUTPUT)[0]
    hybrid = LLM(gemma3_5to1, dtype="float32", max_model_len=4096, max_num_seqs=4)
    tokens, pages = _held_pages(hybrid, prompt, OUTPUT)
    assert tokens == expected
    bound = 5 * WINDOW // BLOCK + 1 * (PROMPT + OUTPUT) // BLOCK + hybrid.llm_engine.config.kv_groups.num_groups
    assert pages <= bound, (pages, bound)
    whole = LLM(gemma3_5to1, dtype="float32", max_model_len=4096, max_num_seqs=4, disable_hybrid_kv_cache_manager=True)
    tokens, whole_pages = _held_pages(whole, prompt, OUTPUT)
    assert tokens == expected
    assert whole_pages == 6 * (PROMPT + OUTPUT) // BLOCK
    print(f"\n4,096-token Gemma 3 5:1 sequence: {pages} layer pages hybrid, {whole_pages} with one table "
          f"({whole_pages / pages:.2f}x)")


def test_default_budget_holds_more_sequences_with_hybrid_groups(gemma3_5to1):
    """The same KV bytes are more blocks when a block is a group's pages, not every layer's."""
    hybrid = engine_config(gemma3_5to1, dtype="float32", max_model_len=4096)
    whole = engine_config(gemma3_5to1, dtype="float32", max_model_len=4096, disable_hybrid_kv_cache_manager=True)
    assert hybrid.kv_groups.num_groups == 6 and hybrid.kv_groups.num_slots == 1
    # One sequence of 4,096: the global group's 256 blocks and five local groups' window and chunk.
    chunk = hybrid.scheduler_config.max_num_batched_tokens
    assert hybrid.kv_blocks_per_seq() == 256 + 5 * -(-(WINDOW + chunk + BLOCK) // BLOCK)
    assert whole.kv_blocks_per_seq() == 256
    assert whole.kv_groups.windows == (None,)


@pytest.mark.parametrize("mode", ["swap", "tier"])
def test_hybrid_tables_survive_swap_and_the_offload_tier(tiny_gemma3, mode):
    """Preempted by swap (each group's blocks go to the CPU pool and come back, the released ones
    staying released) or evicted to the offload tier and loaded back: transformers' tokens, every
    block freed, and the tier's blocks used."""
    prompts = mixed_prompts(1000, seed=23)
    expected = hf_greedy(tiny_gemma3, prompts, 24)
    extra = dict(preemption_mode="swap") if mode == "swap" else dict(kv_offloading_size=0.01)
    llm = LLM(tiny_gemma3, dtype="float32", num_kv_blocks=24, max_model_len=200, max_num_batched_tokens=64, **extra)
    assert llm.llm_engine.config.kv_groups.hybrid
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.llm_engine.stats()
    if mode == "swap":
        assert stats.num_preemptions > 0
    else:
        assert stats.kv_tier.host_hit_blocks > 0
    # The router hears of the global group's blocks, under the hashes it computes itself.
    reported = [h for e in llm.llm_engine.take_kv_events() for h in getattr(e, "block_hashes", [])]
    assert reported and all(len(h) == 32 for h in reported)
    llm.llm_engine.check_no_leaks()
