"""Greedy output is token-identical to transformers (fp32) on every path of the engine."""
from __future__ import annotations

import pytest
from helpers import hf_greedy, mixed_prompts

from engine import LLM, SamplingParams

MAX_TOKENS = 20


def greedy(n: int = 1, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | None = None) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params or greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def oracle():
    cache: dict[str, list[list[int]]] = {}

    def get(path: str, prompts: list[list[int]]) -> list[list[int]]:
        key = path + repr(prompts)
        if key not in cache:
            cache[key] = hf_greedy(path, prompts, MAX_TOKENS)
        return cache[key]
    return get


@pytest.mark.parametrize("chunked,budget", [(True, 2048), (True, 24), (False, 512)],
                         ids=["chunked-default", "chunked-budget24", "no-chunking"])
def test_batch_matches_transformers(tiny_model, oracle, chunked, budget):
    prompts = mixed_prompts(1000)
    llm = LLM(tiny_model, dtype="float32", max_num_batched_tokens=budget, max_model_len=512,
              enable_chunked_prefill=chunked, enable_prefix_caching=False)
    assert run(llm, prompts) == oracle(tiny_model, prompts)


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
def test_kernel_sets_match_transformers(tiny_model, oracle, kernels, monkeypatch):
    """Each CPU kernel set on its own, chunked (budget 24): the compiled CPU kernels (what auto
    picks here) and the pure-torch reference (the fallback where they cannot be built)."""
    monkeypatch.setenv("PDSERVE_KERNELS", kernels)
    prompts = mixed_prompts(1000)
    llm = LLM(tiny_model, dtype="float32", max_num_batched_tokens=24, max_model_len=512)
    expected = {"cpu": "kernels.cpu_ops", "reference": "kernels.reference"}[kernels]
    runner = llm.llm_engine.executor.worker.runner
    assert runner.kernels.__name__ == expected
    bound = [m.kernels for m in runner.model.modules() if hasattr(type(m), "kernels")]
    assert len(bound) >= 4 and all(k is runner.kernels for k in bound)     # chosen once, per model
    backends = [m.backend for m in runner.model.modules() if hasattr(type(m), "backend")]
    assert backends and all(b is runner.attention and b.kernels is runner.kernels for b in backends)
    assert not runner.attention.can_capture_cuda_graphs                    # CPU: no graphs
    packs = []
    pack = runner.kernels.pack_prefill
    monkeypatch.setattr(runner.kernels, "pack_prefill", lambda *a: packs.append(1) or pack(*a))
    steps = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda sched: steps.append(sched) or execute(sched))
    assert run(llm, prompts) == oracle(tiny_model, prompts)
    # The prefill segments are packed once per step that has them, not once per layer.
    assert len(packs) == sum(any(len(r.token_ids) > 1 for r in s.scheduled) for s in steps) > 0


def test_mistral_mqa_matches_transformers(tiny_mistral):
    prompts = mixed_prompts(1000, seed=3)[:4]
    llm = LLM(tiny_mistral, dtype="float32")
    assert run(llm, prompts) == hf_greedy(tiny_mistral, prompts, MAX_TOKENS)


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
def test_qwen3_qk_norm_matches_transformers(tiny_qwen3, kernels, monkeypatch):
    """Qwen3 (q and k RMS-normalized per head before the rotary embedding; head_dim 32 where
    hidden / heads is 16), chunked prefill and decode (through the CPU decode plan with the C++
    kernels), each CPU kernel set."""
    monkeypatch.setenv("PDSERVE_KERNELS", kernels)
    prompts = mixed_prompts(1000, seed=4)[:6]
    llm = LLM(tiny_qwen3, dtype="float32", max_num_batched_tokens=24, max_model_len=512)
    assert run(llm, prompts) == hf_greedy(tiny_qwen3, prompts, MAX_TOKENS)
    assert (llm.llm_engine.executor.worker.runner.decode_plan is not None) == (kernels == "cpu")


def test_prefix_cache_hits_keep_output(tiny_llama, oracle):
    shared = mixed_prompts(1000, seed=5)[-1][:70]
    prompts = [shared + [100 + i] * (i + 1) for i in range(4)]
    llm = LLM(tiny_llama, dtype="float32", max_num_batched_tokens=40)
    first = run(llm, prompts)
    stats = llm.llm_engine.stats()
    second = run(llm, prompts)
    after = llm.llm_engine.stats()
    assert after.prefix_cache_hits > stats.prefix_cache_hits > 0
    assert first == second == oracle(tiny_llama, prompts)
    out = llm.generate({"prompt_token_ids": prompts[0]}, greedy(), use_tqdm=False)[0]
    assert out.num_cached_tokens == 64           # 4 full blocks; the last token is recomputed
    # Without preemption, every prompt token is either a prefix-cache hit or computed, once.
    final = llm.llm_engine.stats()
    assert final.prompt_tokens_computed == final.prompt_tokens - final.prefix_cache_hits
    # The latency histograms the planner reads: one first token per request, then one interval per
    # later step of each (every step of these gave one token); nothing queued once done.
    finished = 2 * len(prompts) + 1
    assert sum(final.ttft) == finished
    assert sum(final.itl) == finished * (MAX_TOKENS - 1) and final.num_prompt_tokens_queued == 0
    assert after.prompt_tokens_computed - stats.prompt_tokens_computed == \
        sum(map(len, prompts)) - (after.prefix_cache_hits - stats.prefix_cache_hits) < sum(map(len, prompts))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_output(tiny_qwen2, oracle, mode):
    prompts = [p for p in mixed_prompts(1000, seed=7) if len(p) > 10]
    # 14 blocks of 16 tokens cannot hold 6 sequences of ~40-150 tokens at once.
    llm = LLM(tiny_qwen2, dtype="float32", num_kv_blocks=14, max_model_len=200,
              preemption_mode=mode, max_num_batched_tokens=64)
    outs = run(llm, prompts)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0
    assert outs == oracle(tiny_qwen2, prompts)
    if mode == "recompute":      # a preempted prompt is computed again
        assert stats.prompt_tokens_computed > stats.prompt_tokens - stats.prefix_cache_hits


def test_static_batching_holds_the_barrier_and_keeps_output(tiny_llama, oracle):
    """batching="static": a request that arrives while a batch runs is not scheduled until every
    member of that batch has finished, even with free seats; outputs equal continuous batching's."""
    prompts = mixed_prompts(1000, seed=11)[2:6]
    with pytest.raises(ValueError, match="batching must be one of"):
        LLM(tiny_llama, dtype="float32", batching="dynamic")
    outputs = {}
    for mode in ("continuous", "static"):
        engine = LLM(tiny_llama, dtype="float32", max_num_seqs=4, max_num_batched_tokens=24,
                     batching=mode).llm_engine
        lengths = {"a": 12, "b": 3, "c": 5, "d": 4}            # b finishes long before a
        for rid, p in zip("ab", prompts):
            engine.add_request(rid, None, p, greedy(max_tokens=lengths[rid]))
        scheduled: list[set[str]] = []
        schedule = engine.scheduler.schedule

        def recording(schedule=schedule, scheduled=scheduled):
            out = schedule()
            scheduled.append({s.request_id for s in out.scheduled})
            return out
        engine.scheduler.schedule = recording
        done: dict[str, list[int]] = {}
        finished_at: dict[str, int] = {}
        while engine.has_unfinished_requests():
            if len(scheduled) == 2:                            # a and b are running: c and d arrive
                for rid, p in zip("cd", prompts[2:]):
                    engine.add_request(rid, None, p, greedy(max_tokens=lengths[rid]))
            out = engine.step()
            for o in out:
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
                    finished_at[o.request_id] = len(scheduled) - 1
        first_cd = min(i for i, ids in enumerate(scheduled) if ids & {"c", "d"})
        if mode == "static":
            assert first_cd == finished_at["a"] + 1           # the barrier: after the whole batch
        else:
            assert first_cd == 2                              # free seats are taken at once
        outputs[mode] = done
    assert outputs["static"] == outputs["continuous"]
    assert [outputs["static"][r] for r in "abcd"] == [o[:lengths[r]] for r, o in
                                                       zip("abcd", oracle(tiny_llama, prompts))]


def test_an_itl_target_chunks_prompts_between_decodes_and_keeps_output(tiny_llama, oracle):
    """itl_target_ms: while decodes run, a step's prompt tokens are capped (engine/core/step_budget.py).
    A target no step can meet sets the cap to its floor at the first paced step, whatever this
    machine's speed: prompts that arrive while others decode go in chunks of at most that many
    tokens, decodes ride every step, the output is transformers', and every block is freed."""
    from engine.core.step_budget import MIN_PROMPT_TOKENS

    prompts = [p for p in mixed_prompts(1000, seed=5) if len(p) > 10][:4] + [list(range(7, 400))] * 2
    engine = LLM(tiny_llama, dtype="float32", itl_target_ms=1e-6, enable_prefix_caching=False).llm_engine
    arrive = {0: [0, 1, 2], 2: [3], 4: [4, 5]}      # step -> requests: three decode, then one, then two long
    steps: list[tuple[int, int | None, int]] = []   # per step: decodes, the prompt tokens' cap, prompt tokens
    schedule = engine.scheduler.schedule

    def recording():
        decodes = sum(r.num_tokens_to_compute == 1 for r in engine.scheduler.running)
        out = schedule()
        steps.append((decodes, engine.scheduler.budget.prompt_cap, engine.scheduler.budget.prompt_taken))
        return out
    engine.scheduler.schedule = recording
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests() or arrive:
        for i in arrive.pop(len(steps), []):
            engine.add_request(f"r{i}", None, prompts[i], greedy())
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    paced = [(cap, taken) for decodes, cap, taken in steps[4:] if decodes]
    assert steps[2][1] == 2048 and steps[2][2] == len(prompts[3])    # the first paced step: the whole budget
    assert all(cap == MIN_PROMPT_TOKENS and taken <= cap for cap, taken in paced)
    assert sum(taken == MIN_PROMPT_TOKENS for _, taken in paced) == 2 * len(prompts[4]) // MIN_PROMPT_TOKENS
    assert [done[f"r{i}"] for i in range(6)] == oracle(tiny_llama, prompts)
    engine.check_no_leaks()


def test_n_greater_than_one_forks_prompt(tiny_llama, oracle):
    prompts = mixed_prompts(1000, seed=9)[1:4]      # 15, 16 and 17 tokens: partial/full last blocks
    llm = LLM(tiny_llama, dtype="float32", enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n=3), use_tqdm=False)
    expected = oracle(tiny_llama, prompts)
    for out, exp in zip(outs, expected):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == exp for c in out.outputs)


def test_fork_shares_prompt_blocks_and_copies_on_write(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", enable_prefix_caching=False)
    engine = llm.llm_engine
    prompt = list(range(10, 10 + 40))                # 2 full blocks + 8 tokens
    engine.add_request("r", None, prompt, greedy(n=3, max_tokens=3))
    engine.step()                                    # leader computes 39 tokens, then forks
    kv = engine.kv_cache_manager
    tables = [kv.block_ids(f"r#{i}") for i in range(3)]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert all(kv.block_pool.blocks[b].ref_cnt == 3 for b in tables[0])
    engine.step()                                    # each child writes token 39: CoW of block 2
    tables = [kv.block_ids(f"r#{i}") for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    while engine.has_unfinished_requests():
        engine.step()
