"""Hardening in the engine (no Ray): one bad request never harms another. A request whose own
sampling raises fails alone while a neighbour's stream goes on token-exact; a step that raises fails
its requests, un-caches the blocks it never filled and the engine goes on; steps that keep failing
end the engine (EngineDeadError); top_k beyond the vocabulary keeps every token.

Unit input checks: tests/unit/test_input_checks.py; a replica Ray cannot place:
tests/cluster/test_pools.py; the HTTP side: tests/serving/."""
from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncLLMEngine
from records.errors import EngineDeadError, RequestFailedError


def test_top_k_beyond_the_vocabulary_keeps_every_token(tiny_llama):
    """top_k larger than the vocabulary (e.g. a client's 'all') samples exactly like no top_k."""
    with LLM(tiny_llama, dtype="float32", max_model_len=128) as llm:
        prompt = {"prompt_token_ids": [5, 6, 7, 8]}
        outs = [llm.generate(prompt, SamplingParams(temperature=1.0, top_k=k, seed=3, max_tokens=8, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids for k in (-1, 10**12, 2**63 - 1)]
    assert outs[0] == outs[1] == outs[2]


# --- the engine keeps serving -----------------------------------------------------------------------
POISON = 1.25          # a presence_penalty that marks the request whose sampling is made to raise


def _greedy(tiny_llama, prompt, max_tokens):
    with LLM(tiny_llama, dtype="float32", max_model_len=256) as llm:
        return llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                        ignore_eos=True), use_tqdm=False)[0]


async def _collect(engine, rid, prompt, params):
    async def run():
        out = None
        async for item in engine.generate(rid, prompt, params):
            out = item
        return out

    return await asyncio.wait_for(run(), 120)          # a request that never ends fails the test


def test_a_request_whose_sampling_raises_fails_alone(tiny_llama, monkeypatch):
    """The neighbour in the same batch keeps every token it would have had alone, the bad request
    ends with RequestFailedError naming the cause, and the engine stays healthy."""
    import engine.sample.sampler as sampler

    original, batched = sampler._penalize_row, sampler.apply_penalties

    def poisoned(logits, i, row, penalties=True):
        if row.params.presence_penalty == POISON and len(row.output_token_ids) >= 3:
            raise RuntimeError("poisoned row")
        original(logits, i, row, penalties)

    def poisoned_batch(logits, rows, params, stats):      # the batched path falls back to the rows
        if any(p.presence_penalty == POISON for p in params):
            raise RuntimeError("poisoned batch")
        batched(logits, rows, params, stats)

    monkeypatch.setattr(sampler, "_penalize_row", poisoned)
    monkeypatch.setattr(sampler, "apply_penalties", poisoned_batch)
    neighbour_prompt = list(range(20, 60))
    want = _greedy(tiny_llama, neighbour_prompt, 40).outputs[0].token_ids
    engine = AsyncLLMEngine.from_args(tiny_llama, dtype="float32", max_model_len=256)

    async def main():
        neighbour = asyncio.create_task(_collect(engine, "n", neighbour_prompt,
                                                 SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0.05)
        with pytest.raises(RequestFailedError, match="applying penalties failed: RuntimeError\\('poisoned row'\\)"):
            await _collect(engine, "bad", [7, 8, 9], SamplingParams(presence_penalty=POISON, max_tokens=30,
                                                                    ignore_eos=True))
        with pytest.raises(RequestFailedError, match="poisoned row"):      # n = 2: both rows fail
            await _collect(engine, "bad2", [7, 8, 9], SamplingParams(n=2, presence_penalty=POISON, max_tokens=30,
                                                                     temperature=0.7, ignore_eos=True))
        out = await neighbour
        assert out.outputs[0].token_ids == want
        assert engine.is_healthy
        after = await _collect(engine, "after", [7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(after.outputs[0].token_ids) == 4
        await engine.shutdown()

    asyncio.run(main())
    engine.engine.check_no_leaks()


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_llama, monkeypatch):
    """A step that raises outside any one row: its requests fail, the blocks it never filled leave the
    prefix cache (the same prompt afterwards gives the exact greedy output), the engine keeps serving;
    three failing steps in a row end it."""
    from engine.worker.model_runner import ModelRunner

    original = ModelRunner.execute
    failures = {"left": 0}

    def flaky(self, sched):
        if failures["left"] and sched.scheduled:
            failures["left"] -= 1
            raise RuntimeError("injected step failure")
        return original(self, sched)

    monkeypatch.setattr(ModelRunner, "execute", flaky)
    prompt = list(range(100, 150))                 # three full blocks: cached as they are allocated
    want = _greedy(tiny_llama, prompt, 6)
    engine = AsyncLLMEngine.from_args(tiny_llama, dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        failures["left"] = 1
        with pytest.raises(RequestFailedError, match="the engine step failed: RuntimeError"):
            await _collect(engine, "first", prompt, params)
        assert engine.is_healthy
        failures["left"] = 1        # n = 2: the step fails its leader while the other choice waits to fork
        with pytest.raises(RequestFailedError, match="the engine step failed"):
            await _collect(engine, "forked", list(range(300, 340)), SamplingParams(n=2, max_tokens=4))
        again = await _collect(engine, "again", prompt, params)
        assert again.outputs[0].token_ids == want.outputs[0].token_ids
        failures["left"] = 3                       # a run of failures: the engine itself is broken
        for i in range(3):
            with pytest.raises((RequestFailedError, EngineDeadError)):
                await _collect(engine, f"doomed-{i}", [1, 2, 3], params)
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            await _collect(engine, "late", [1, 2, 3], params)
        await engine.shutdown()

    asyncio.run(main())
    engine.engine.check_no_leaks()
