"""A simulated engine (EngineArgs.simulate) is the real engine but its forward pass: its scheduler,
blocks, prefix cache, preemption and KV transfers run as always, its steps take the profile's time,
and its tokens are deterministic. Checked in virtual time (records/clock.py), where a step's time is
exact, never measured."""
from __future__ import annotations

import pytest

import records.clock as clock
from engine.executor.simulated import SimulatedExecutor, simulated_token, step_shape
from engine.llm_engine import LLMEngine
from records.config_resolution import engine_config
from records.sampling_params import SamplingParams

PROFILE = "h200-llama3-8b"


def _engine(**kwargs) -> LLMEngine:
    return LLMEngine(engine_config(None, simulate=PROFILE, **kwargs))


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    return out


def _params(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, output_kind="delta", **kw)


def test_steps_take_the_profiles_time_and_tokens_are_deterministic():
    with clock.virtual(clock.VirtualClock()) as c:
        engine = _engine(max_model_len=8192, max_num_batched_tokens=1024)
        assert isinstance(engine.executor, SimulatedExecutor)
        assert engine.config.model_config.max_model_len == 8192 <= engine.config.simulation.profile.model.max_model_len
        profile = engine.config.simulation.profile
        prompt = list(range(100, 2100))          # 2,000 tokens: two chunks of the 1,024-token budget
        engine.add_request("a", None, prompt, _params(12))
        expected = 0.0
        inner = engine.executor.submit

        def submit(sched):
            nonlocal expected
            expected += profile.step_time(step_shape(sched)) + profile.overhead_time(len(sched.scheduled))
            inner(sched)

        engine.executor.submit = submit
        tokens = _run(engine)["a"]
        assert c.now == pytest.approx(expected)          # exactly the cost model's steps, back to back
        assert len(tokens) == 12 and not engine.eos_token_ids & set(tokens)    # runs to max_tokens, no EOS
        # The same sequence gives the same tokens on another engine (a migration goes on alike), and a
        # seed gives others.
        other = _engine(max_model_len=8192)
        other.add_request("b", None, prompt, _params(12))
        other.add_request("c", None, prompt, _params(12, seed=3))
        again = _run(other)
        assert again["b"] == tokens and again["c"] != tokens
        vocab = engine.config.model_config.vocab_size
        assert all(0 <= t < vocab for t in tokens)
        assert simulated_token(5, 9, 0, vocab, frozenset({simulated_token(5, 9, 0, vocab, frozenset())})) != \
            simulated_token(5, 9, 0, vocab, frozenset())


def test_the_real_scheduler_caches_prefixes_and_preempts():
    with clock.virtual(clock.VirtualClock()):
        # Room for 40 blocks of 16 tokens: three sequences of 451 tokens (29 blocks, their first 18
        # shared) cannot all fit.
        engine = _engine(max_model_len=512, num_kv_blocks=40, max_num_seqs=8)
        shared = list(range(200, 500))
        for i in range(3):
            engine.add_request(f"r{i}", None, shared + [1000 + i], _params(150))
        out = _run(engine)
        assert sorted(len(t) for t in out.values()) == [150, 150, 150]
        stats = engine.stats()
        assert stats.num_preemptions > 0                 # by recompute, as the real engine
        assert stats.prefix_cache_hits >= 2 * 288           # the shared 300 tokens' full blocks hit
        engine.check_no_leaks()


def test_pd_between_simulated_engines_moves_no_bytes_and_leaves_nothing():
    """A prefill engine leases its blocks, the decode engine's pull takes the link's time and its
    release ends the lease: every block free on both sides, the tokens one engine's."""
    with clock.virtual(clock.VirtualClock()) as c:
        p = _engine(max_model_len=4096, kv_connector="torch_dist")
        d = _engine(max_model_len=4096, kv_connector="torch_dist")
        prompt = list(range(300, 1800))
        p.add_request("x", None, prompt, _params(1), kv_transfer_params={"do_remote_decode": True})
        params = None
        while p.has_unfinished_requests() and params is None:
            for o in p.step():
                params = o.kv_transfer_params or params
        assert params is not None and params["do_remote_prefill"]
        d.add_request("x", None, prompt, _params(20), kv_transfer_params=params)
        before = c.now
        tokens: list[int] = []
        while d.has_unfinished_requests() or p.has_unfinished_requests():
            for o in d.step():
                tokens += o.outputs[0].token_ids
            p.step()
            clock.advance(c.now + 1e-3)      # a pull ends in time, not in steps
        pulled = d.stats().kv_transfer.blocks_pulled
        assert pulled == -(-(len(prompt) - 1) // 16) and p.stats().kv_transfer.leases_active == 0
        pull_s = d.config.simulation.profile.transfer_time(pulled * d.config.kv_block_bytes())
        assert c.now - before >= pull_s
        alone = _engine(max_model_len=4096)
        alone.add_request("y", None, prompt, _params(20))
        assert tokens == _run(alone)["y"]
        p.check_no_leaks()
        d.check_no_leaks()


def _decode_gaps(engine: LLMEngine, decoding: list[str], until: str) -> tuple[list[float], float, dict]:
    """Step `engine` in virtual time until request `until` has its first token: the gaps between the
    tokens of `decoding`'s streams meanwhile, the time `until` waited, and every request's tokens
    once all finish."""
    last: dict[str, float] = {}
    gaps: list[float] = []
    start, first = clock.monotonic(), None
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            now = clock.monotonic()
            if o.request_id in decoding and first is None and o.outputs[0].token_ids:
                if o.request_id in last:
                    gaps.append(now - last[o.request_id])
                last[o.request_id] = now
            if o.request_id == until and first is None:
                first = now - start
    return gaps, first, out


def test_an_itl_target_paces_prompt_chunks_between_decodes():
    """A long prompt arrives while 16 streams decode: unpaced, each of its 4,096-token steps holds
    every stream's next token (vLLM's semantics); with itl_target_ms its chunks shrink until a step
    takes about the target, the streams' tokens come that often, the prompt takes longer to its
    first token, and every request's tokens are the same."""
    prompts = {f"d{i}": list(range(300 + 40 * i, 332 + 40 * i)) for i in range(16)}
    long_prompt = list(range(1000, 17000))
    runs = {}
    for target in (None, 60.0):
        with clock.virtual(clock.VirtualClock()):
            engine = _engine(max_model_len=20000, max_num_batched_tokens=4096, itl_target_ms=target)
            for rid, p in prompts.items():
                engine.add_request(rid, None, p, _params(400))
            for _ in range(3):                      # the streams are decoding
                engine.step()
            engine.add_request("long", None, long_prompt, _params(4))
            runs[target] = _decode_gaps(engine, set(prompts), "long")
            engine.check_no_leaks()
    (unpaced, ttft_unpaced, out_unpaced), (paced, ttft_paced, out_paced) = runs[None], runs[60.0]
    assert out_paced == out_unpaced and len(out_paced["long"]) == 4
    assert max(unpaced) > 0.1                       # a 4,096-token step holds every stream
    # After a few paced steps, within a quarter of the target: a prompt token's cost grows with the
    # context its chunk attends to, and the cap follows it a step behind.
    settled = paced[len(paced) // 2:]
    assert max(settled) <= 0.06 * 1.25, max(settled)
    assert sum(settled) / len(settled) >= 0.06 * 0.7     # not paced far below the target either
    assert ttft_paced > ttft_unpaced
