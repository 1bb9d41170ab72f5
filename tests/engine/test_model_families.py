"""Gemma 2, Gemma 3 (text) and Phi-3 are token-identical to transformers (fp32, greedy) on tiny
random configs that exercise what sets each apart (tests/conftest.py: soft-caps, local and global
layers with their own ropes, linear rope scaling, LongRoPE, fused checkpoint projections), through
chunked prefill, prefix-cache hits and preemption, on both CPU kernel sets."""
from __future__ import annotations

import pytest
from helpers import hf_greedy, mixed_prompts

from engine import LLM, SamplingParams

FAMILIES = ["gemma2", "gemma3", "phi3"]
MAX_TOKENS = 20


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts(1000, seed=21)


@pytest.fixture(scope="module")
def oracle(prompts):
    cache: dict[str, list[list[int]]] = {}

    def get(path: str) -> list[list[int]]:
        if path not in cache:
            cache[path] = hf_greedy(path, prompts, MAX_TOKENS)
        return cache[path]
    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernels", ["cpu", "reference"])
def test_chunked_batch_matches_transformers(family, kernels, prompts, oracle, request, monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNELS", kernels)
    path = request.getfixturevalue(f"tiny_{family}")
    llm = LLM(path, dtype="float32", max_num_batched_tokens=24, max_model_len=512)
    assert run(llm, prompts) == oracle(path)
    llm.llm_engine.check_no_leaks()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_and_preemption_keep_output(family, prompts, oracle, request):
    """A second pass over the same prompts hits the prefix cache; fourteen blocks cannot hold the
    batch, so requests are preempted and recomputed."""
    path = request.getfixturevalue(f"tiny_{family}")
    llm = LLM(path, dtype="float32", num_kv_blocks=14, max_model_len=200, max_num_batched_tokens=64)
    assert run(llm, prompts) == oracle(path)
    stats = llm.llm_engine.stats()
    assert run(llm, prompts) == oracle(path)
    after = llm.llm_engine.stats()
    assert after["num_preemptions"] > 0 and after["prefix_cache_hits"] > stats["prefix_cache_hits"]
    llm.llm_engine.check_no_leaks()
