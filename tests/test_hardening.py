"""Hardening, below the HTTP layer: one bad request never harms another.

- unit: SamplingParams and validate_request refuse every value that would break a step (ints that
  do not fit int64, seeds outside torch's range, non-finite floats, too many stop strings, token
  ids outside the vocabulary); request bodies that are not UTF-8 JSON objects of bounded depth;
  admission tickets that release once; metrics that forget replaced replicas.
- engine (no Ray): a request whose own sampling raises fails alone while a neighbour's stream goes
  on token-exact; a step that raises fails its requests, un-caches the blocks it never filled and
  the engine goes on; steps that keep failing end the engine (EngineDeadError).
- pools (Ray): a replica that Ray cannot place fails the start within the timeout, naming the
  resource.

The HTTP side (abort storms, malformed requests, schemathesis fuzzing) runs on the live apps of
tests/test_serving.py.
"""
from __future__ import annotations

import asyncio
import gc
import json
import time

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncLLMEngine
from engine.errors import EngineDeadError, RequestFailedError
from engine.sampling_params import validate_request
from router.admission import Admission
from router.protocol import MAX_JSON_DEPTH, parse_json_object


# --- unit -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    ({"top_k": 2**70, "temperature": 1.0}, "top_k"), ({"seed": 2**64}, "seed"), ({"seed": -2**63 - 1}, "seed"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"max_tokens": 2**63}, "max_tokens"), ({"min_tokens": 2**63}, "min_tokens"), ({"priority": 2**70}, "priority"),
    ({"n": 2**64}, "n"), ({"stop": ["x"] * 1000}, "stop"), ({"stop": ["y" * 257]}, "stop"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"), ({"stop_token_ids": list(range(300))}, "stop_token_ids"),
    ({"logprobs": True}, "logprobs"), ({"stop": 5}, "stop"),
])
def test_sampling_params_refuse_what_would_break_a_step(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**kwargs)


def test_edge_values_that_are_accepted():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1          # torch's seed range, all of it
    assert SamplingParams(seed=-2**63, top_k=2**63 - 1, stop=["z" * 256] * 32).top_k == 2**63 - 1


def test_validate_request_knows_the_model():
    params = SamplingParams(stop_token_ids=[5, 1000])
    with pytest.raises(ValueError, match=r"stop_token_ids must be token ids in \[0, 1000\)"):
        validate_request([1, 2], params, vocab_size=1000, max_model_len=64)
    with pytest.raises(ValueError, match="n must be <= 4"):
        validate_request([1, 2], SamplingParams(n=5), 1000, 64, max_num_seqs=4)
    with pytest.raises(ValueError, match="min_tokens must be <= 62"):
        validate_request([1, 2], SamplingParams(min_tokens=63, max_tokens=None), 1000, 64)


def test_top_k_beyond_the_vocabulary_keeps_every_token(tiny_llama):
    """top_k larger than the vocabulary (e.g. a client's 'all') samples exactly like no top_k."""
    with LLM(tiny_llama, dtype="float32", max_model_len=128) as llm:
        prompt = {"prompt_token_ids": [5, 6, 7, 8]}
        outs = [llm.generate(prompt, SamplingParams(temperature=1.0, top_k=k, seed=3, max_tokens=8, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids for k in (-1, 10**12, 2**63 - 1)]
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("body,message", [
    (b'{"model": "m", "prompt": "\xff\xfe"}', "not valid UTF-8"),
    (b'{"temperature": NaN}', "NaN is not a JSON number"),
    (b'{"temperature": Infinity}', "Infinity is not a JSON number"),
    (b"[" * 2000 + b"]" * 2000, "nests arrays and objects more than"),
    (b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}", "nests arrays and objects more than"),
    (b'[1, 2]', "must be a JSON object; got list"),
    (b'{"model": ', "not valid JSON"),
])
def test_bodies_that_are_refused(body, message):
    with pytest.raises(ValueError, match=message):
        parse_json_object(body)


def test_bodies_that_are_accepted():
    nested = {"a": json.loads("[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2))}
    assert parse_json_object(json.dumps(nested).encode()) == nested
    assert parse_json_object(b"") == {} and parse_json_object('{"p": "café"}'.encode()) == {"p": "café"}


def test_admission_tickets_release_exactly_once():
    seen = []
    admission = Admission(3, seen.append)
    a = admission.admit(2)
    assert a is not None and admission.admit(2) is None and admission.in_flight == 2
    a.release()
    a.release()                                   # idempotent
    assert admission.in_flight == 0 and seen == [2, 0]
    b = admission.admit(3)
    assert b is not None and admission.in_flight == 3
    del b                                         # dropped unreleased: garbage collection releases it
    gc.collect()
    assert admission.in_flight == 0


def test_series_of_removed_replicas_are_dropped():
    from router.metrics import ServingMetrics
    from router.pd import RequestRouter
    from router.policy import PolicyConfig, RoutingPolicy

    metrics = ServingMetrics()
    router = RequestRouter("prefill", {"prefill-0": object(), "prefill-1": object()}, 16,
                           RoutingPolicy(PolicyConfig("prefix_aware", 0.5, 8), 8), metrics)
    for r in router.replicas:
        metrics.set_engine_stats("prefill", r, {"num_requests_running": 1, "prompt_tokens": 10})
    router.set_replicas({"prefill-1": router.replicas["prefill-1"]})
    text = metrics.render()
    assert 'replica="prefill-1"' in text and 'replica="prefill-0"' not in text


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
    import engine.layers.sampler as sampler

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
    from engine.model_runner import ModelRunner

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


@pytest.mark.ray
def test_a_replica_that_cannot_be_placed_fails_naming_the_resource(tiny_llama):
    """The cluster's total would hold the pool, but another workload holds the CPUs: the start fails
    within the placement timeout naming what a replica needs and what is free (never a pending
    actor forever)."""
    import ray

    from cluster.config import ClusterConfig
    from cluster.launch import init_ray
    from cluster.pool import EnginePool
    from engine.errors import PlacementError

    init_ray(num_cpus=8)
    free = ray.available_resources().get("CPU", 0.0)
    blocker = ray.remote(num_cpus=max(free - 0.5, 0.01))(type("Blocker", (), {"ping": lambda self: 1})).remote()
    ray.get(blocker.ping.remote())
    config = ClusterConfig(model=tiny_llama, engine={"dtype": "float32"}, pools={"decode": {"num_cpus": 1}})
    pool = EnginePool("decode", config.pools["decode"], config.engine_config(), "pdserve-unplaced")
    pool.start()
    try:
        start = time.monotonic()
        with pytest.raises(PlacementError, match=r"pools.decode: replica decode-0 was not placed within 3 s: "
                                                 r"one replica needs \{CPU: 1\}; the cluster has \{CPU: 0\.[0-9]+"):
            asyncio.run(pool.wait_ready(place_timeout_s=3.0))
        assert time.monotonic() - start < 30
    finally:
        pool.shutdown()
        ray.kill(blocker)
