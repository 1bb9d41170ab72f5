"""Speculative decoding: greedy output identical to plain decoding, sampling exact in distribution,
rollback of rejected tokens under prefix caching, chunked prefill and preemption, stop conditions
inside an accepted run, metrics, config validation."""
from __future__ import annotations

import pytest
import torch
from helpers import mixed_prompts, save_random_model

from engine import LLM, SamplingParams
from engine.sample.rejection_sampler import Verification, accept_greedy, verify
from engine.sample.sampler import SamplingRow
from engine.spec_decode.ngram import NgramProposer
from records.config_resolution import engine_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine their spin-waits
    cost more than the work (thousands of tiny steps here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                               use_tqdm=False)]


FAVOURED = ["Ġthe", "Ġcat", "Ġsat", "Ġon", "Ġa", "Ġmat", "Ġand", "."]


@pytest.fixture(scope="module")
def loopy_llama(tmp_path_factory, smol_tokenizer) -> str:
    """A random Llama with the embedded model's tokenizer whose output head favours 8 word tokens:
    its greedy output soon repeats itself, as text that copies spans does, so lookups hit (a plain
    random model's output never repeats and no proposal would ever be accepted)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=smol_tokenizer.bos_token_id, eos_token_id=smol_tokenizer.eos_token_id)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    favoured = smol_tokenizer.convert_tokens_to_ids(FAVOURED)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
        head = model.lm_head.weight
        kept = head[favoured] * 4
        head.zero_()
        head[favoured] = kept
    out = tmp_path_factory.mktemp("loopy-llama")
    model.save_pretrained(out, safe_serialization=True)
    smol_tokenizer.save_pretrained(out)
    return str(out)


def copy_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span (lookup finds it) besides the plain mixed-length ones."""
    prompts = mixed_prompts(vocab, seed)
    return prompts + [p[:12] * 3 for p in prompts if len(p) >= 12][:3]


def chi_squared_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of `counts` against `probs`, cells with expectation < 5 pooled into one."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


# --- the rules, in isolation ------------------------------------------------------------------------
def test_accept_greedy_takes_the_matching_prefix_and_the_targets_token():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7, 8], [1, 6, 7]) == [5]


def _wrong_resample_from_p(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
    """A plausible but wrong rule: accept with p(d), on rejection resample from p (d not removed)."""
    if torch.rand(1, generator=generator, dtype=torch.float64).item() < probs[0, drafts[0]].item():
        return drafts[:1]
    return [int(torch.multinomial(probs[0], 1, generator=generator))]


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.8}, {"top_k": 3}])
def test_rejection_sampling_matches_the_target_distribution_and_the_test_has_power(filters):
    """`verify` at temperature 1 over a proposal the draft favours wrongly: its first emitted token
    follows the target's (filtered) distribution; accepting every proposal, or (unfiltered)
    resampling from p without removing the rejected proposal, fails the same test."""
    from engine.sample.nucleus import filtered_probs

    logits = torch.tensor([[0.05, 0.30, 0.15, 0.40, 0.10]] * 2).log()
    params = SamplingParams(temperature=1.0, **filters)
    probs = filtered_probs(logits.clone(), [params] * 2)
    draft_dist = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2])    # proposals favour a low-probability token
    g = torch.Generator().manual_seed(1234)
    num = 20_000
    drafts = torch.multinomial(draft_dist, num, replacement=True, generator=g).tolist()
    row = SamplingRow(params, g, [0], [], frozenset())
    # every request verified at once, as the runner verifies a step's (each its own two rows)
    emitted = verify(logits.repeat(num, 1), [Verification(row, [d], 1) for d in drafts])
    exact = torch.bincount(torch.tensor([out[0].token_id for out in emitted]), minlength=5).float()
    kept = probs[0] > 0
    assert exact[~kept].sum() == 0 and chi_squared_p_value(exact[kept], probs[0][kept]) > 0.01
    always = torch.bincount(torch.tensor(drafts), minlength=5)
    assert chi_squared_p_value(always, probs[0]) < 1e-6          # always accepting the proposal
    if not filters:     # (with a filter most proposals fall outside it, where the wrong rule is right)
        wrong = torch.zeros(5)
        for d in drafts:
            wrong[_wrong_resample_from_p(probs, [d], g)[0]] += 1
        assert chi_squared_p_value(wrong, probs[0]) < 1e-6       # residual not renormalized


def test_a_steps_requests_verify_together_as_each_alone():
    """One `verify` over a step's requests (greedy, seeded, unseeded sharing a generator, one whose
    grammar allows fewer proposals, one whose row fails): each seeded or greedy request emits what
    it emits verified alone, a seeded generator moves one number per emitted token, a grammar's
    limit caps the accepted run, and a failing request fails alone."""
    g = torch.Generator().manual_seed(0)
    vocab = 300
    logits = torch.randn(14, vocab, generator=g) * 2

    def requests():
        shared = torch.Generator().manual_seed(9)
        # proposals: each row's argmax, so that greedy accepts them all and sampling some
        top = logits.argmax(dim=-1).tolist()
        return [Verification(SamplingRow(SamplingParams(temperature=0), None, [1], [], frozenset()), top[0:3], 3),
                Verification(SamplingRow(SamplingParams(temperature=0.7, seed=5), torch.Generator().manual_seed(5),
                                         [1], [2], frozenset()), top[4:6], 2),
                Verification(SamplingRow(SamplingParams(temperature=0.9), shared, [1], [], frozenset()), top[7:8], 1),
                Verification(SamplingRow(SamplingParams(temperature=0), None, [1], [], frozenset()), top[9:11], 1),
                Verification(SamplingRow(SamplingParams(temperature=1.0, repetition_penalty=1.2), shared, [1],
                                         [10**6], frozenset()), top[12:13], 1)]      # a token outside the vocabulary

    together = verify(logits.clone(), batch := requests())
    rows = [0, 4, 7, 9, 12, 14]
    alone = [verify(logits[rows[i]:rows[i + 1]].clone(), [r])[0] for i, r in enumerate(requests())]
    assert [t.token_id for t in together[0]] == logits[0:4].argmax(-1).tolist()     # all 3 accepted + 1
    assert [t.token_id for t in together[3]] == logits[9:11].argmax(-1).tolist()    # the grammar's 1, + 1
    for i in (0, 1, 3):
        assert [t.token_id for t in together[i]] == [t.token_id for t in alone[i]], i
    once = torch.Generator().manual_seed(5)
    torch.rand(len(together[1]), generator=once, dtype=torch.float64)
    assert torch.equal(batch[1].row.generator.get_state(), once.get_state())
    assert isinstance(together[4], str) and "penalties" in together[4]
    assert not isinstance(together[2], str) and 1 <= len(together[2]) <= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verification_on_cuda_emits_what_it_emits_on_the_host():
    """The runner verifies where the logits are (no host copy unless a grammar or prompt logprobs
    ask): seeded and greedy requests emit the same tokens from CUDA logits as from the host's."""
    logits = torch.randn(12, 128256, generator=torch.Generator().manual_seed(4)) * 3
    top = logits.argmax(dim=-1).tolist()

    def requests():
        seeded = [SamplingRow(SamplingParams(temperature=0.8, top_p=0.95, seed=s), torch.Generator().manual_seed(s),
                              [1], [], frozenset()) for s in range(2)]
        greedy = SamplingRow(SamplingParams(temperature=0), None, [1], [], frozenset())
        return [Verification(row, top[4 * i:4 * i + 3], 3) for i, row in enumerate([*seeded, greedy])]

    host = verify(logits.clone(), requests())
    device = verify(logits.cuda(), requests())
    assert [[t.token_id for t in r] for r in device] == [[t.token_id for t in r] for r in host]


def test_verify_applies_penalties_per_position_and_reports_target_logprobs():
    # Greedy with a repetition penalty: position 1 sees proposal 0 as already generated.
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0], [0.0, 3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=1)
    row = SamplingRow(params, None, [0], [], frozenset())
    out, = verify(logits.clone(), [Verification(row, [1], 1)])
    assert [t.token_id for t in out] == [1, 2]                     # 1 accepted, then 3.0/1.5 < 2.9
    raw = torch.log_softmax(logits, dim=-1)
    assert out[1].logprob == pytest.approx(raw[1, 2].item()) and out[1].rank == 2


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(_spec_config(1, 3))
    assert proposer.lookup([1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3], 2) == [5, 1]     # latest 3-gram match
    assert proposer.lookup([7, 8, 9, 7, 8], 5) == [9, 7, 8]                       # up to the end
    assert proposer.lookup([1, 2, 3, 4], 3) == []
    assert NgramProposer(_spec_config(2, 3)).lookup([4, 1, 5, 6, 1], 3) == []   # 1-gram not enough


def _spec_config(lo: int, hi: int):
    from records.config import SpeculativeConfig

    return SpeculativeConfig("ngram", 3, lo, hi)


# --- the engine: greedy identity ------------------------------------------------------------------
@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 2048},
    {"max_num_batched_tokens": 20},                                           # chunked prefill, tight budget
    {"num_kv_blocks": 14, "max_model_len": 200, "max_num_batched_tokens": 64,
     "preemption_mode": "recompute"},
    {"num_kv_blocks": 14, "max_model_len": 200, "max_num_batched_tokens": 64, "preemption_mode": "swap"},
], ids=["default", "chunked-budget20", "preempt-recompute", "preempt-swap"])
def test_ngram_greedy_output_identical(loopy_llama, engine_args):
    prompts = copy_prompts(1000)
    args = {"dtype": "float32", "max_model_len": 512, **engine_args}
    plain = run(LLM(loopy_llama, **args), prompts, greedy())
    llm = LLM(loopy_llama, **args, speculative_config=NGRAM)
    spec = run(llm, prompts, greedy())
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.llm_engine.stats()
    # Both paths ran: accepted runs and rejected proposals (rolled back).
    assert 0 < stats.spec.num_accepted_tokens < stats.spec.num_draft_tokens
    assert stats.generation_tokens == 24 * len(prompts)
    if "num_kv_blocks" in engine_args:
        assert stats.num_preemptions > 0


def test_speculation_pauses_while_the_batch_is_large(loopy_llama):
    """disable_by_batch_size (vLLM's): no proposals while that many requests run, proposals again
    once fewer do; the output is plain decoding's either way."""
    prompts = copy_prompts(1000)[:4]
    args = {"dtype": "float32", "max_model_len": 512}
    plain = run(LLM(loopy_llama, **args), prompts, greedy())
    llm = LLM(loopy_llama, **args, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    engine = llm.llm_engine
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", None, p, greedy(max_tokens=8 + 8 * i))
    drafted = []          # (running before the step, draft tokens so far)
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        engine.step()
        drafted.append((running, engine.stats().spec.num_draft_tokens))
    # a step verifies what was proposed after the step before: nothing while two or more ran, then
    # proposals for the last request alone
    assert max(d for n, d in drafted if n >= 2) == 0 < drafted[-1][1]
    assert [n for n, _ in drafted[1:]] == sorted((n for n, _ in drafted[1:]), reverse=True)   # (first: all waiting)
    assert [o.token_ids for o in run(llm, prompts, greedy())] == [o.token_ids for o in plain]


def test_prefix_cache_after_rejections_holds_only_verified_kv(loopy_llama):
    """Blocks are cached while speculating; a second run served from that cache (and a plain engine)
    must give the same tokens, which fails if a rejected proposal's KV were cached."""
    prompts = copy_prompts(1000, seed=4)
    llm = LLM(loopy_llama, dtype="float32", speculative_config=NGRAM)
    params = greedy(max_tokens=40)
    first = run(llm, prompts, params)
    hits = llm.llm_engine.stats().prefix_cache_hits
    # Continue each request from its own output: the prompt now covers blocks filled while speculating.
    extended = [p + o.token_ids for p, o in zip(prompts, first)]
    again = run(llm, extended, greedy(max_tokens=8))
    assert llm.llm_engine.stats().prefix_cache_hits > hits
    assert llm.llm_engine.stats().spec.num_draft_tokens > llm.llm_engine.stats().spec.num_accepted_tokens
    plain = LLM(loopy_llama, dtype="float32", enable_prefix_caching=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in run(plain, extended, greedy(max_tokens=8))]


def _emission_steps(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[range]]:
    """The output tokens and, per step, the range of output indices it emitted."""
    engine = llm.llm_engine
    engine.add_request("probe", None, prompt, params)
    steps, num = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
            steps.append(range(num, len(tokens)))
            num = len(tokens)
    return tokens, steps


def test_stop_conditions_cut_an_accepted_run(loopy_llama, smol_tokenizer):
    """A stop string met inside an accepted run ends the output there, as without speculation
    (and max_tokens caps the proposals); logprobs are the target's."""
    plain_llm = LLM(loopy_llama, dtype="float32")
    spec_llm = LLM(loopy_llama, dtype="float32", speculative_config=NGRAM)
    cases = [(p, greedy(max_tokens=7)) for p in copy_prompts(1000, seed=2)[:3]]
    cases += [(p, greedy(max_tokens=30, logprobs=2)) for p in copy_prompts(1000, seed=2)[:3]]
    # Prompts in the output's own words: proposals copy from them too, so a token's first
    # appearance in the output can be an accepted proposal.
    favoured = smol_tokenizer.convert_tokens_to_ids(FAVOURED)
    g = torch.Generator().manual_seed(0)
    worded = [[favoured[i] for i in torch.randint(0, len(favoured), (24,), generator=g)] for _ in range(8)]
    found_string = False
    for prompt in worded:
        tokens, steps = _emission_steps(spec_llm, prompt, greedy(max_tokens=40))
        mid_run = [i for r in steps for i in r[:-1]]        # emitted with more tokens after it
        for i in mid_run:
            if not found_string and i >= 2:
                stop = smol_tokenizer.decode(tokens[i - 2:i + 1])
                text = smol_tokenizer.decode(tokens)
                end = text.find(stop) + len(stop)
                if len(smol_tokenizer.decode(tokens[:i])) < end <= len(smol_tokenizer.decode(tokens[:i + 1])):
                    cases.append((prompt, greedy(max_tokens=40, stop=[stop])))
                    found_string = True
    assert found_string
    for prompt, params in cases:
        a = run(plain_llm, [prompt], params)[0]
        b = run(spec_llm, [prompt], params)[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
            (a.token_ids, a.text, a.finish_reason, a.stop_reason), params
        if params.logprobs:
            assert [sorted(d) for d in b.logprobs] == [sorted(d) for d in a.logprobs]
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
    assert spec_llm.llm_engine.stats().spec.num_accepted_tokens > 0


def test_scheduler_rolls_back_rejections_and_stops_inside_a_run():
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.scheduler import Scheduler
    from records.config import SchedulerConfig
    from records.request import Request, RequestStatus
    from records.step import ModelRunnerOutput, SampledToken

    kv = KVCacheManager(16, 4, True, 0)
    scheduler = Scheduler(SchedulerConfig(), kv)
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[42])
    request = Request("r", [1, 2, 3, 4, 5], params, frozenset(), 4, 20)
    scheduler.add_request(request)

    def step(spec: list[int], emitted: list[int]):
        request.spec_token_ids = spec
        out = scheduler.schedule()
        tokens = [SampledToken(t) for t in emitted]
        runner = (ModelRunnerOutput(sampled={}, spec_sampled={"r": tokens}) if spec
                  else ModelRunnerOutput(sampled={"r": tokens[0]}))
        scheduler.update_from_output(out, runner)
        return out.scheduled[0]

    step([], [7])                                             # prefill
    sched = step([8, 9, 10], [8, 11])                         # 1 accepted, 9 rejected: 11 is the target's
    assert (sched.start, sched.token_ids, sched.spec_token_ids) == (5, [7, 8, 9, 10], [8, 9, 10])
    assert request.num_computed_tokens == 7 and request.all_token_ids[5:] == [7, 8, 11]
    sched = step([12, 42, 13], [12, 42, 13, 14])              # all accepted, but 42 stops it
    assert sched.start == 7 and sched.token_ids == [11, 12, 42, 13]
    assert request.output_token_ids == [7, 8, 11, 12, 42]
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == 42
    kv.check_no_leaks()


def test_n_greater_than_one_and_seeded_sampling_run_beside_speculation(loopy_llama):
    prompts = copy_prompts(1000, seed=6)[:4]
    llm = LLM(loopy_llama, dtype="float32", speculative_config=NGRAM)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n=2), use_tqdm=False)
    plain = LLM(loopy_llama, dtype="float32")
    expected = plain.generate([{"prompt_token_ids": p} for p in prompts], greedy(n=2), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in expected]
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=16, ignore_eos=True)
    a = run(llm, prompts, seeded)
    b = run(llm, prompts, seeded)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]      # reproducible under a seed
    # Token i takes the i-th number of the request's stream, speculating or not: the same tokens as
    # without speculation (so a stream resumed elsewhere, skipping one number a token, goes on).
    assert llm.llm_engine.stats().spec.num_accepted_tokens > 0
    assert [o.token_ids for o in a] == [o.token_ids for o in run(plain, prompts, seeded)]


# --- the engine: sampling exactness ---------------------------------------------------------------
VOCAB = 8


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory) -> str:
    """A random Llama over 8 tokens, no tokenizer: every token of the prompt recurs, so the n-gram
    lookup (n = 1) always proposes."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    return save_random_model(tmp_path_factory, config, "tiny-vocab", seed=11, std=0.3)


def _exact_marginals(path: str, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's exact distributions of the 2nd and 3rd generated tokens (temperature 1)."""
    from helpers import hf_model

    model = hf_model(path)

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor(prefixes)).logits[:, -1].softmax(-1).double()

    p1 = next_probs([prompt])[0]                                              # [V]
    p2 = next_probs([prompt + [a] for a in range(VOCAB)])                     # [V(a), V]
    p3 = next_probs([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    second = p1 @ p2
    third = torch.einsum("a,ab,abc->c", p1, p2, p3)
    return second, third


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_is_exact_in_distribution(tiny_vocab_model, method):
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 3, 1, 4]
    num = 8000
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    if method == "draft_model":     # the target drafting greedily for itself: accepted w.p. p(argmax)
        spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": tiny_vocab_model}
    llm = LLM(tiny_vocab_model, dtype="float32", max_model_len=64, max_num_seqs=512, seed=3,
              speculative_config=spec)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = run(llm, [prompt] * num, params)
    stats = llm.llm_engine.stats()
    assert stats.spec.num_drafts >= num                     # every request verified proposals
    assert 0 < stats.spec.num_accepted_tokens < stats.spec.num_draft_tokens
    second, third = _exact_marginals(tiny_vocab_model, prompt)
    assert second.max() < 0.6 and third.max() < 0.6             # spread out: the test can tell rules apart
    counts2 = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=VOCAB)
    counts3 = torch.bincount(torch.tensor([o.token_ids[2] for o in outs]), minlength=VOCAB)
    assert chi_squared_p_value(counts2, second) > 0.001
    assert chi_squared_p_value(counts3, third) > 0.001


# --- config and metrics ----------------------------------------------------------------------------
@pytest.mark.parametrize("spec,field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "keys"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_speculative_config_is_validated(tiny_llama, spec, field):
    with pytest.raises(ValueError, match=field):
        engine_config(tiny_llama, speculative_config=spec)


def test_draft_model_must_share_the_vocabulary(tiny_llama, tiny_vocab_model):
    with pytest.raises(ValueError, match="vocabulary"):
        engine_config(tiny_llama, speculative_config={
            "method": "draft_model", "model": tiny_vocab_model, "num_speculative_tokens": 2})


def test_cluster_spec_sets_speculation_on_the_decode_pool(tiny_llama):
    from cluster.config import ClusterConfig

    config = ClusterConfig(model=tiny_llama, mode="disaggregated", pools={
        "prefill": {}, "decode": {"speculative_config": NGRAM}})
    spec = config.engine_config("decode").speculative_config
    assert spec is not None and spec.method == "ngram" and spec.num_speculative_tokens == 3
    assert config.engine_config("prefill").speculative_config is None
    with pytest.raises(ValueError, match="pools.decode.speculative_config"):
        ClusterConfig(model=tiny_llama, engine={"speculative_config": NGRAM})
    with pytest.raises(ValueError, match="only the decode pool decodes"):
        ClusterConfig(model=tiny_llama, mode="disaggregated", pools={
            "prefill": {"speculative_config": NGRAM}, "decode": {}})


# --- the draft-model proposer ---------------------------------------------------------------------
@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 20},
                                         {"num_kv_blocks": 14, "max_model_len": 200, "max_num_batched_tokens": 64}],
                         ids=["default", "chunked-budget20", "preempt"])
def test_draft_model_greedy_output_identical(loopy_llama, tiny_llama, engine_args):
    prompts = copy_prompts(1000)
    args = {"dtype": "float32", **engine_args}
    plain = [o.token_ids for o in run(LLM(loopy_llama, **args), prompts, greedy())]
    own = LLM(loopy_llama, **args, speculative_config={
        "method": "draft_model", "model": loopy_llama, "num_speculative_tokens": 3})
    assert [o.token_ids for o in run(own, prompts, greedy())] == plain
    stats = own.llm_engine.stats()
    assert stats.spec.num_draft_tokens > 0
    assert stats.spec.acceptance_rate == 1.0                 # the target as its own draft
    other = LLM(loopy_llama, **args, speculative_config={
        "method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3})
    assert [o.token_ids for o in run(other, prompts, greedy())] == plain
    assert other.llm_engine.stats().spec.num_draft_tokens > 0
