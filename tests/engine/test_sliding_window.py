"""Sliding-window attention through the engine: a Mistral v0.1-shaped model (every layer local, a
32-token window) decodes far past its window token-identical to transformers, on every path
(chunked prefill, prefix hits, preemption by recompute and swap, both CPU kernel sets), while a
sequence holds at most window / block_size + 2 blocks of the pool."""
from __future__ import annotations

import json
import shutil

import pytest
from helpers import hf_greedy, mixed_prompts

from engine import LLM, SamplingParams
from records.config_resolution import engine_config

WINDOW, BLOCK = 32, 16
MAX_TOKENS = 48         # every prompt ends past the window (the longest prompt alone is 130)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts(1000, seed=11)


@pytest.fixture(scope="module")
def expected(tiny_mistral_swa, prompts) -> list[list[int]]:
    return hf_greedy(tiny_mistral_swa, prompts, MAX_TOKENS)


def test_window_is_attended_not_a_length_cap(tiny_mistral_swa, tiny_qwen2, tmp_path):
    """The window no longer bounds max_model_len; the KV cache releases blocks only where every
    layer is local; Qwen2's configs carry a window with use_sliding_window off: none."""
    config = engine_config(tiny_mistral_swa, dtype="float32")
    assert config.model_config.max_model_len == 2048 and config.kv_groups.windows == (WINDOW,)
    qwen2 = tmp_path / "qwen2"
    shutil.copytree(tiny_qwen2, qwen2)
    raw = json.loads((qwen2 / "config.json").read_text())
    (qwen2 / "config.json").write_text(json.dumps({**raw, "sliding_window": 64, "use_sliding_window": False}))
    assert engine_config(str(qwen2), dtype="float32").kv_groups.windows == (None,)


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
def test_decodes_past_the_window_like_transformers(tiny_mistral_swa, prompts, expected, kernels, monkeypatch):
    """Chunked prefill at a budget of 24 (chunks start inside and beyond the window), a batch of
    lengths 1-130, 48 tokens each."""
    monkeypatch.setenv("PDSERVE_KERNELS", kernels)
    llm = LLM(tiny_mistral_swa, dtype="float32", max_num_batched_tokens=24)
    assert run(llm, prompts) == expected
    llm.llm_engine.check_no_leaks()


def test_a_long_sequence_holds_window_over_block_size_plus_two_blocks(tiny_mistral_swa):
    """Step by step, a 20-token prompt decoding 300 tokens never holds more than
    WINDOW / BLOCK + 2 = 4 blocks (without the window it would reach 20); freed blocks stay in the
    prefix cache, and everything is free at the end."""
    llm = LLM(tiny_mistral_swa, dtype="float32", block_size=BLOCK)
    engine = llm.llm_engine
    engine.add_request("long", None, list(range(5, 25)), greedy(300))
    held, listed = [], 0
    while engine.has_unfinished_requests():
        engine.step()
        held.append(engine.kv_cache_manager.num_held_blocks("long"))
        listed = max(listed, len(engine.kv_cache_manager.block_ids("long")))
    assert max(held) <= WINDOW // BLOCK + 2 and listed == -(-320 // BLOCK)
    assert held[-2] > 0 and engine.kv_cache_manager.block_pool.cached      # released blocks stay cached
    engine.check_no_leaks()


def test_prefix_hits_keep_output(tiny_mistral_swa, prompts, expected):
    """The same prompts twice: the second run hits blocks the first released behind its window."""
    llm = LLM(tiny_mistral_swa, dtype="float32", max_num_batched_tokens=40)
    assert run(llm, prompts) == expected
    before = llm.llm_engine.stats().prefix_cache_hits
    assert run(llm, prompts) == expected
    assert llm.llm_engine.stats().prefix_cache_hits > before
    llm.llm_engine.check_no_leaks()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_output(tiny_mistral_swa, prompts, expected, mode):
    """Ten blocks cannot hold seven sequences' windows at once: requests are preempted and resumed
    (a swapped request's released places stay released)."""
    llm = LLM(tiny_mistral_swa, dtype="float32", num_kv_blocks=10, preemption_mode=mode, max_num_batched_tokens=64)
    assert run(llm, prompts) == expected
    assert llm.llm_engine.stats().num_preemptions > 0
    llm.llm_engine.check_no_leaks()
