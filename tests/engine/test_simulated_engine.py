"""A simulated engine (EngineArgs.simulate) is the real engine but its forward pass: its scheduler,
blocks, prefix cache, preemption and KV transfers run as always, its steps take the profile's time,
and its tokens are deterministic. Checked in virtual time (records/clock.py), where a step's time is
exact, never measured."""
from __future__ import annotations

import pytest

import records.clock as clock
from engine.executor.simulated import SimulatedExecutor, simulated_token, step_shape
from engine.llm_engine import LLMEngine
from records.config import EngineConfig
from records.sampling_params import SamplingParams

PROFILE = "h200-llama3-8b"


def _engine(**kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig.create(None, simulate=PROFILE, **kwargs))


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
