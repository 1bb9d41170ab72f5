"""Sampling parameters: seeds, filters, penalties, logprobs, stops, lengths, n."""
from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, hf_model

from engine import LLM, SamplingParams
from engine.text.tokenizer import bad_words_token_ids

PROMPTS = [list(range(20, 45)), list(range(300, 310)), list(range(500, 560))]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32")


def gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = gen(llm, [PROMPTS[0]], params)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batched = gen(llm, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [unseeded, params, unseeded])
    assert batched[1].outputs[0].token_ids == alone
    other_seed = gen(llm, [PROMPTS[0]], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16,
                                                        ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_seeded_n_children_differ_but_reproduce(llm):
    params = SamplingParams(n=3, temperature=1.5, seed=7, max_tokens=12, ignore_eos=True)
    a = [c.token_ids for c in gen(llm, [PROMPTS[0]], params)[0].outputs]
    b = [c.token_ids for c in gen(llm, [PROMPTS[0]], params)[0].outputs]
    assert a == b and len({tuple(t) for t in a}) == 3


def test_a_finished_request_leaves_nothing_behind_through_an_empty_step(tiny_llama):
    """The ranks drop a finished request's generator when a later step names it finished. A step
    with nothing to run is not sent, so the ids it would carry wait for the next one: once they were
    lost there, and a later request of the same id drew on from the old generator (found under
    PP, whose pipelined steps meet an empty schedule whenever both batches are in flight)."""
    def run(engine, seed, rid="r"):
        engine.add_request(rid, None, PROMPTS[0], SamplingParams(temperature=1.0, seed=seed, max_tokens=6,
                                                                  ignore_eos=True))
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [o.outputs[0].token_ids for o in engine.step() if o.finished]
        return tokens

    engine = LLM(tiny_llama, dtype="float32").llm_engine
    first = run(engine, 7)
    assert engine.step() == []                 # nothing to run: nothing sent
    runner = engine.executor.worker.runner
    assert list(runner.generators) == ["r"]    # "r" finished; no step has said so yet
    assert run(engine, 3) == run(LLM(tiny_llama, dtype="float32").llm_engine, 3) != first
    for rid in ("a", "b", "c"):
        run(engine, 5, rid)
        assert engine.step() == []
    assert list(runner.generators) == ["c"]    # every earlier one dropped (they piled up before)


def test_top_k_one_and_tiny_min_p_top_p_are_greedy(llm, tiny_llama):
    expected = hf_greedy(tiny_llama, PROMPTS, 10)
    for params in (SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True, seed=0),
                   SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=10, ignore_eos=True, seed=0),
                   SamplingParams(temperature=1.0, min_p=1.0, max_tokens=10, ignore_eos=True, seed=0)):
        assert [o.outputs[0].token_ids for o in gen(llm, PROMPTS, params)] == expected


def test_sampling_follows_the_distribution(llm, tiny_llama):
    """The first sampled token's empirical distribution matches softmax(logits / T)."""
    prompt = PROMPTS[1]
    with torch.no_grad():
        logits = hf_model(tiny_llama)(torch.tensor([prompt])).logits[0, -1]
    probs = torch.softmax(logits / 2.0, dim=-1)
    params = [SamplingParams(temperature=2.0, max_tokens=1, seed=s, top_k=5) for s in range(400)]
    outs = gen(llm, [prompt] * 400, params)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]), minlength=len(probs))
    top5 = probs.topk(5)
    expected = top5.values / top5.values.sum()
    observed = counts[top5.indices].float() / 400
    assert counts.sum() == counts[top5.indices].sum()          # never outside the top 5
    assert torch.allclose(observed, expected, atol=0.08), (observed, expected)


def test_repetition_penalty_matches_transformers(llm, tiny_llama):
    params = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=15, ignore_eos=True)
    expected = hf_greedy(tiny_llama, PROMPTS, 15, repetition_penalty=1.3)
    assert [o.outputs[0].token_ids for o in gen(llm, PROMPTS, params)] == expected


def test_frequency_and_presence_penalties_change_output(llm):
    base = gen(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    pen = gen(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                frequency_penalty=2.0, presence_penalty=2.0))
    b, p = base[0].outputs[0].token_ids, pen[0].outputs[0].token_ids
    assert b != p
    assert len(set(p)) >= len(set(b))


def test_logit_bias_matches_transformers_and_is_checked(llm, tiny_llama):
    """logit_bias adds to the logits before the choice, as transformers' sequence_bias does for
    one-token sequences; a biased row leaves its batch neighbour alone; 100 forces a token even when
    sampling; keys may be JSON's strings; bad keys and values are ValueErrors naming the field."""
    base = gen(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    first = base[0].outputs[0].token_ids
    bias = {first[0]: -5.0, first[1]: -3.5, 123: 2.5}
    expected = hf_greedy(tiny_llama, [PROMPTS[0]], 12, sequence_bias=[[[t], b] for t, b in bias.items()])[0]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=bias),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected != first
    assert out[1].outputs[0].token_ids == base[1].outputs[0].token_ids
    forced = gen(llm, [PROMPTS[2]], SamplingParams(temperature=0.8, seed=3, max_tokens=5, logit_bias={"77": 100}))
    assert forced[0].outputs[0].token_ids == [77] * 5
    for bad in ({1: 101}, {"x": 1}, {-1: 1.0}, {2: float("nan")}, [1, 2]):
        with pytest.raises(ValueError, match="logit_bias must be"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match=r"logit_bias must be keyed by token ids in \[0, "):
        gen(llm, [PROMPTS[0]], SamplingParams(logit_bias={10**7: 1.0}))


def test_allowed_token_ids_restrict_every_token(llm):
    """vLLM's allowed_token_ids: greedy takes the likeliest of them (not of the vocabulary), sampling
    never leaves them, a neighbour without them is untouched; out-of-vocabulary or empty lists are
    ValueErrors naming the field."""
    base = gen(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    allowed = [5, 77, 123, 300]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert set(out[0].outputs[0].token_ids) <= set(allowed)
    assert out[1].outputs[0].token_ids == base[1].outputs[0].token_ids
    sampled = gen(llm, PROMPTS[:3], SamplingParams(temperature=1.5, top_p=0.9, max_tokens=12, ignore_eos=True,
                                                    allowed_token_ids=allowed))
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in sampled)
    for bad in ([], [-1], ["x"], 5):
        with pytest.raises(ValueError, match="allowed_token_ids must be"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match=r"allowed_token_ids must be token ids in \[0, "):
        gen(llm, [PROMPTS[0]], SamplingParams(allowed_token_ids=[1, 10**7]))


def test_bad_words_never_complete(llm, tiny_llama):
    """vLLM's bad_words: a word's last token is masked wherever the output ends with its other tokens.
    Banning a pair the greedy output makes leaves the output as it was up to the pair's first token
    and changes the next; a one-token word never appears, sampled or not; a neighbour without them is
    untouched. Words given as text are tokenized as they begin the text and after a space."""
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in gen(llm, PROMPTS[:2], plain)]
    pair = base[0][3:5]
    first = next(j for j in range(len(base[0]) - 1) if base[0][j:j + 2] == pair)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words_token_ids=[pair])
    out = [o.outputs[0].token_ids for o in gen(llm, PROMPTS[:2], [params, plain])]
    assert out[0][:first + 1] == base[0][:first + 1] and out[0][first + 1] != pair[1]
    assert not any(out[0][j:j + 2] == pair for j in range(len(out[0]) - 1))
    assert out[1] == base[1]
    banned = sorted(set(base[0][:4]))
    sampled = gen(llm, PROMPTS[:3], SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True,
                                                    bad_words_token_ids=[[t] for t in banned]))
    assert all(not set(o.outputs[0].token_ids) & set(banned) for o in sampled)

    tokenizer = llm.llm_engine.tokenizer
    words = bad_words_token_ids(["hello", " Paris", "the end"], tokenizer)
    expected = []
    for word in ("hello", "Paris", "the end"):
        alone, spaced = (tokenizer.encode(t, add_special_tokens=False) for t in (word, " " + word))
        expected += [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    assert words == expected and len(words) > 3
    text = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=["hello", "the end"])
    done = gen(llm, [PROMPTS[0]], text)[0].outputs[0].token_ids
    assert text.bad_words_token_ids == bad_words_token_ids(["hello", "the end"], tokenizer)
    assert not any(done[j:j + len(w)] == w for w in text.bad_words_token_ids for j in range(len(done)))
    for bad in ([""], ["  "], [3], 5, ["x" * 300]):
        with pytest.raises(ValueError, match="bad_words must be"):
            SamplingParams(bad_words=bad)
    assert SamplingParams(bad_words="stop").bad_words == ["stop"]
    with pytest.raises(ValueError, match=r"bad_words must tokenize to ids in \[0, "):
        gen(llm, [PROMPTS[0]], SamplingParams(bad_words_token_ids=[[1, 10**7]]))
    with pytest.raises(ValueError, match="bad_words"):
        gen(llm, [PROMPTS[0]], SamplingParams(use_beam_search=True, best_of=2, n=1, temperature=0,
                                              bad_words=["hello"]))


def test_generation_config_sampling_defaults(tiny_llama, tmp_path):
    """As vLLM's generation_config="auto": the model's generation_config.json sampling fields are the
    defaults of requests that leave them unset (LLM with no SamplingParams; the HTTP request models,
    field by field); "vllm" ignores them."""
    import json
    import shutil

    from router.ingress.protocol import ChatCompletionRequest, CompletionRequest

    path = tmp_path / "model"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(
        {**config, "temperature": 0.0, "top_k": 0, "repetition_penalty": 1.3, "max_new_tokens": 5}))
    llm = LLM(str(path), dtype="float32")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty) == (0.0, -1, 1.3)
    assert defaults.max_tokens == SamplingParams().max_tokens          # max_new_tokens is not taken
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], use_tqdm=False)[0].outputs[0].token_ids
    assert out == hf_greedy(tiny_llama, [PROMPTS[0]], 16, repetition_penalty=1.3)[0]
    assert LLM(str(path), dtype="float32", generation_config="vllm").get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(str(path), generation_config="model")
    model_defaults = llm.llm_engine.config.model_info().sampling_defaults
    unset = CompletionRequest(model="m", prompt="x").to_sampling_params(model_defaults)
    assert (unset.temperature, unset.repetition_penalty) == (0.0, 1.3)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], temperature=0.5)
    assert (chat.to_sampling_params(None, model_defaults).temperature,
            chat.to_sampling_params(None, model_defaults).repetition_penalty) == (0.5, 1.3)


def test_logprobs_match_transformers(llm, tiny_llama):
    prompt = PROMPTS[0]
    out = gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=4, ignore_eos=True))[0]
    comp = out.outputs[0]
    with torch.no_grad():
        full = torch.tensor([prompt + comp.token_ids])
        ref = torch.log_softmax(hf_model(tiny_llama)(full).logits[0].float(), dim=-1)
    for step, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + step]
        top = row.topk(4)
        assert set(entry) == set(top.indices.tolist()) | {token}
        assert entry[token].rank == 1
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid].item()) < 1e-4
        assert [lp.logprob for lp in entry.values()] == sorted((lp.logprob for lp in entry.values()), reverse=True)
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(comp.logprobs, comp.token_ids)))


def test_prompt_logprobs_match_transformers_with_chunking(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_num_batched_tokens=16)
    prompt = PROMPTS[2]                                   # 60 tokens: 4 chunks
    out = gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(tiny_llama)(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4
        assert len(entry) in (2, 3)
        assert list(entry) == sorted(entry, key=lambda t: -entry[t].logprob)          # ranked
    # A one-token prompt: its one entry, None (it was left empty).
    assert gen(llm, [[5]], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs == [None]


def test_stop_strings_stop_tokens_and_lengths(llm, tiny_llama):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = gen(llm, [PROMPTS[0]], params)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    text = full.text
    assert text == tok.decode(full.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.find(stop)
    stopped = gen(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                     stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[:cut]
    kept = gen(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop,
                                                  include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:cut + len(stop)]
    token = full.token_ids[5]
    by_token = gen(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                      stop_token_ids=[token]))[0].outputs[0]
    first = full.token_ids.index(token)
    assert by_token.token_ids == full.token_ids[:first + 1]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token


def test_eos_and_min_tokens(llm):
    eos = min(llm.llm_engine.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = gen(llm, [PROMPTS[1]], params)[0].outputs[0].token_ids
    # Make the 4th greedy token a stop token: with min_tokens=6 it is masked, so generation goes on.
    stop_tok = full[3]
    early = gen(llm, [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))
    assert len(early[0].outputs[0].token_ids) == 4
    late = gen(llm, [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok],
                                                  min_tokens=6))[0].outputs[0]
    assert stop_tok not in late.token_ids[:6] and len(late.token_ids) >= 6
    assert eos in llm.llm_engine.eos_token_ids


def test_max_tokens_none_runs_to_max_model_len(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=48)
    out = gen(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 48 - len(PROMPTS[0])
    assert out.outputs[0].finish_reason == "length"


def test_greedy_ids_is_argmax_with_first_maximum():
    from engine.sample.sampler import greedy_ids

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 1001, generator=g)
    logits[3, [10, 500, 900]] = 50.0                       # ties: the first maximum, as argmax
    logits[5, :] = 0.0
    assert torch.equal(greedy_ids(logits), logits.argmax(dim=-1))
    assert greedy_ids(logits)[3].item() == 10 and greedy_ids(logits)[5].item() == 0


def test_low_precision_logits_go_through_a_kept_float32_buffer(tiny_llama):
    """A bf16 model's float32 logits are converted into the runner's buffer, kept across steps and
    grown when a step has more rows; the values are those of a fresh conversion."""
    llm = LLM(tiny_llama, dtype="bfloat16")
    runner = llm.llm_engine.executor.worker.runner
    hidden = torch.randn(5, runner.model.config.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    fresh = runner.model.compute_logits(hidden)
    buffered = runner.model.compute_logits(hidden, runner._logits_buffer(5))
    assert fresh.dtype == buffered.dtype == torch.float32 and torch.equal(fresh, buffered)
    kept = runner._logits_buffer(3)
    assert kept.data_ptr() == runner._logits_buffer(5).data_ptr() and kept.shape[0] >= 5
    assert runner._logits_buffer(40).shape[0] >= 40
    out = gen(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    alone = gen(llm, [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert out[2].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_plain_greedy_rows_skip_the_sampler_with_the_same_tokens(tiny_llama):
    """A bf16 step whose rows all just take their argmax reads it from the bf16 logits (no float32
    copy, no sampler); asking for logprobs sends the same requests through the sampler instead:
    the tokens agree, and so do the two ways of taking the argmax."""
    llm = LLM(tiny_llama, dtype="bfloat16")
    plain = gen(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    sampled = gen(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0))
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in sampled]
    from engine.sample.sampler import greedy_ids

    model = llm.llm_engine.executor.worker.runner.model
    hidden = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    low = model.compute_logits(hidden, model_dtype=True)
    assert low.dtype == torch.bfloat16
    assert torch.equal(greedy_ids(low), greedy_ids(model.compute_logits(hidden)))


FILTERS = [dict(top_p=0.9), dict(top_k=5), dict(top_k=700, top_p=0.95), dict(min_p=0.05), dict(top_p=0.999),
           dict(top_k=3, top_p=0.5, min_p=0.2), dict(), dict(top_k=1000, top_p=0.9, min_p=0.3), dict(top_k=40),
           dict(top_k=30, top_p=0.7), dict(min_p=0.02, top_p=0.8)]


@pytest.mark.parametrize("kw", FILTERS)
def test_candidates_keep_what_the_full_sort_keeps(kw):
    """`candidates` (one topk) against `filtered_probs` (a sort of the whole vocabulary): the rows it
    finds keep the same tokens with the same renormalized probabilities; a flat row is left to the
    wide draw; and a row's candidates do not depend on the rows beside it."""
    from engine.sample.nucleus import candidates, filtered_probs

    g = torch.Generator().manual_seed(len(str(kw)))
    logits = torch.randn(6, 5000, generator=g) * torch.tensor([0.5, 1.0, 2.0, 4.0, 8.0, 0.1])[:, None]
    params = [SamplingParams(temperature=1.0, **kw)] * 6
    vals, ids, sizes, wide, _ = candidates(logits, params)
    expected = filtered_probs(logits.clone(), params)
    assert (5 in wide.tolist()) == (kw.get("top_k", 5000) > 64)    # the flattest row
    for r in range(6):
        if r in wide.tolist():      # its cut not known inside its 64 most likely tokens, or no filter
            assert sizes[r] == 0 and (int((expected[r] > 0).sum()) > 64 or kw.get("top_k", 0) > 64 or not kw)
            continue
        kept = torch.zeros(5000)
        kept[ids[r, :sizes[r]]] = vals[r, :sizes[r]]
        assert torch.equal(kept > 0, expected[r] > 0)
        torch.testing.assert_close(kept / kept.sum(), expected[r], rtol=1e-4, atol=1e-7)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2)]
    for r in range(6):
        alone = candidates(logits[r:r + 1], params[r:r + 1])
        mixed = candidates(torch.cat([logits[:1], logits[r:r + 1], logits[1:2]]), [others[0], params[r], others[1]])
        n = alone.sizes[0]
        assert mixed.sizes[1] == n and (1 in mixed.wide.tolist()) == (0 in alone.wide.tolist())
        assert torch.equal(mixed.ids[1, :n], alone.ids[0, :n]) and torch.equal(mixed.vals[1, :n], alone.vals[0, :n])


@pytest.mark.parametrize("kw", FILTERS[:8] + [dict(top_k=12, top_p=1.0), dict(top_k=30, min_p=0.01)])
def test_wide_draws_follow_the_filtered_distribution(kw):
    """`draw_wide` (rejection within the nucleus, a rejected row reusing where its number fell) on a
    flat row: 40,000 draws, each row with its own number, never outside what the full sort keeps,
    and their frequencies within 5 standard errors of its renormalized probabilities."""
    from engine.sample.nucleus import draw_wide, filtered_probs

    vocab, n = 48, 40_000
    g = torch.Generator().manual_seed(len(str(kw)))
    logits = torch.randn(vocab, generator=g) * 1.5
    params = [SamplingParams(temperature=1.0, **kw)] * n
    expected = filtered_probs(logits[None, :], params[:1])[0]
    tokens = draw_wide(logits.softmax(-1).expand(n, vocab).contiguous(), params,
                       torch.rand(n, generator=g, dtype=torch.float64))
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[expected == 0].sum() == 0, "a draw outside the nucleus"
    observed = counts / n
    bound = 5 * (expected.double() * (1 - expected.double()) / n).sqrt() + 1e-4
    assert ((observed - expected.double()).abs() <= bound).all(), (observed, expected)


def test_a_wide_row_draws_the_same_alone_and_in_a_batch():
    """Seeded rows through `sample`, flat ones among them (drawn by rejection): each row's token is
    the one it draws alone, whatever the rows beside it; an overflowed flat row keeps its argmax."""
    from engine.sample.sampler import SamplingRow, sample

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 2000, generator=g) * torch.tensor([0.05, 4.0, 0.2, 8.0, 0.1, 1.0])[:, None]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1), SamplingParams(temperature=0.9, top_p=0.9, seed=2),
              SamplingParams(temperature=1.5, top_k=500, top_p=0.95, seed=3), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, min_p=0.001, seed=5), SamplingParams(temperature=1e-300, top_p=0.9)]

    def rows(which):
        return [SamplingRow(params[i], torch.Generator().manual_seed(params[i].seed or 0), [1], [], frozenset())
                for i in which]

    batch = rows(range(6))
    together, failed = sample(logits.clone(), batch)
    assert not failed
    for i in range(6):
        alone, _ = sample(logits[i:i + 1].clone(), rows([i]))
        assert alone[0].token_id == together[i].token_id, i
    assert together[5].token_id == int(logits[5].argmax())
    # One number a token from a seeded row's generator, rejected draws or not (a stream resumed on
    # another replica skips one a token: engine/worker/model_runner.py _sampling_row).
    for i in (0, 1, 2, 4):
        once = torch.Generator().manual_seed(params[i].seed)
        torch.rand((), generator=once, dtype=torch.float64)
        assert torch.equal(batch[i].generator.get_state(), once.get_state()), i


def test_top_p_is_renormalized_over_a_large_top_k_even_where_min_p_cuts_early():
    """Three likely tokens and a flat tail: min_p keeps only the three, but top_p must still be
    measured against the top 1000's mass (0.92), not 1: two are kept."""
    from engine.sample.nucleus import candidates, draw_wide, filtered_probs

    probs = torch.full((5000,), 0.1 / 4997)
    probs[:3] = torch.tensor([0.31, 0.30, 0.29])
    params = [SamplingParams(temperature=1.0, top_k=1000, top_p=0.63, min_p=0.5)]
    expected = filtered_probs(probs.log()[None, :], params)
    assert int((expected[0] > 0).sum()) == 2 and set(expected[0].nonzero().flatten().tolist()) == {0, 1}
    # A top_k above the topk's 64 with a top_p: a wide row, drawn by rejection against that mass too.
    assert candidates(probs.log()[None, :], params).wide.tolist() == [0]
    g = torch.Generator().manual_seed(0)
    n = 4000
    tokens = draw_wide(probs.expand(n, -1).contiguous(), params * n, torch.rand(n, generator=g, dtype=torch.float64))
    assert set(tokens.tolist()) == {0, 1}


def test_batched_penalties_equal_the_per_row_reference_across_steps():
    """TokenCounts kept across steps (outputs growing, one shrinking, one request released and its
    slot reused, min_tokens masks beside): the penalized logits equal the per-row reference's
    exactly, for rows with and without each penalty."""
    from engine.sample.penalties import TokenCounts
    from engine.sample.sampler import SamplingRow, _batched_penalties, apply_penalties_and_masks

    vocab, gen = 300, torch.Generator().manual_seed(0)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.2, min_tokens=5),
              SamplingParams(), SamplingParams(presence_penalty=1.5, min_tokens=2, stop_token_ids=[7])]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (40, 3, 25, 10, 60)]
    outputs: list[list[int]] = [[] for _ in params]
    keys = [f"r{i}" for i in range(len(params))]
    counts = TokenCounts()
    for step in range(12):
        if step == 6:
            outputs[1] = outputs[1][:2]                    # shrank: recounted
        if step == 8:
            counts.release("r0")                           # freed; a new request takes its slot
            keys[0], outputs[0] = "r5", []
        rows = [SamplingRow(p, None, pr, out, frozenset({0}), k)
                for p, pr, out, k in zip(params, prompts, outputs, keys)]
        logits = torch.randn(len(rows), vocab, generator=gen) * 3
        expected = logits.clone()
        apply_penalties_and_masks(expected, rows)
        done = _batched_penalties(logits, rows, counts)
        assert done == {0, 1, 2, 4}
        apply_penalties_and_masks(logits, rows, {}, skip_penalties=done)
        assert torch.equal(logits, expected), step
        for out in outputs:
            out.extend(torch.randint(0, vocab, (int(torch.randint(1, 3, (), generator=gen)),), generator=gen).tolist())
    assert len(counts) == 4


def test_penalties_through_the_engine_match_the_per_row_path(tiny_llama, monkeypatch):
    """Greedy with every penalty, batched in the runner against the per-row path: same tokens."""
    import engine.sample.sampler as sampler

    params = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.4, frequency_penalty=0.6,
                            presence_penalty=0.3, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm = LLM(tiny_llama, dtype="float32")
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.llm_engine.executor.worker.runner.token_counts is not None
    monkeypatch.setattr(sampler, "_batched_penalties", lambda logits, rows, counts: set())
    llm = LLM(tiny_llama, dtype="float32")
    per_row = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert batched == per_row


def test_logprob_records_for_the_batch_equal_the_per_row_ones():
    """Rows asking 0, 1 and 5 logprobs beside rows asking none (greedy and seeded): the batched
    records equal to_sampled's on each row's own log-softmax, and rows that ask nothing get none."""
    from engine.sample.sampler import SamplingRow, sample, to_sampled

    gen = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0),
              SamplingParams(temperature=0.9, seed=1, logprobs=0), SamplingParams(temperature=0.7, seed=2),
              SamplingParams(temperature=0, logprobs=1)]
    logits = torch.randn(len(params), 500, generator=gen) * 2
    raw = torch.log_softmax(logits, dim=-1)
    rows = [SamplingRow(p, torch.Generator().manual_seed(i), [1, 2], [], frozenset()) for i, p in enumerate(params)]
    tokens, failed = sample(logits.clone(), rows)
    assert not failed
    for i, (p, token) in enumerate(zip(params, tokens)):
        assert token == to_sampled(token.token_id, p, raw[i] if p.logprobs is not None else None)
    assert tokens[1].top_logprobs is None and tokens[0].rank >= 1 and len(tokens[0].top_logprobs) >= 5


def test_degenerate_distributions_take_the_most_likely_token():
    """Scaled logits that overflow (temperature 1e-300, or an inf logit) leave no distribution to
    draw from: such a row takes its argmax instead of failing, and its neighbours still draw."""
    from engine.sample.sampler import SamplingRow, sample

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=gen)
    logits[1, 17] = float("inf")
    params = [SamplingParams(temperature=1e-300, seed=1), SamplingParams(temperature=0.8, seed=2),
              SamplingParams(temperature=1e-300, top_p=0.5, top_k=5, seed=3), SamplingParams(temperature=1.0, seed=4)]
    rows = [SamplingRow(p, torch.Generator().manual_seed(i), [1], [], frozenset()) for i, p in enumerate(params)]
    tokens, failed = sample(logits.clone(), rows)
    assert not failed
    assert [t.token_id for t in tokens[:3]] == [int(logits[0].argmax()), 17, int(logits[2].argmax())]
    assert 0 <= tokens[3].token_id < 300


def _every_kind_of_row(vocab: int, seed: int = 0):
    """(logits [R, vocab], SamplingRows): greedy, temperature with top_k / top_p / min_p, seeded and
    not, penalties, a logit bias, min_tokens and logprobs, each beside the others."""
    from engine.sample.sampler import SamplingRow

    gen = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.95, seed=1),
              SamplingParams(temperature=1.0, top_k=40, seed=2, logprobs=3),
              SamplingParams(temperature=0.7, min_p=0.05, seed=3, repetition_penalty=1.3),
              SamplingParams(temperature=1.2, seed=4, frequency_penalty=0.5, presence_penalty=0.2,
                             logit_bias={5: 3.0, 7: -100.0}),
              SamplingParams(temperature=0.9, top_k=700, top_p=0.9, seed=5, min_tokens=4, stop_token_ids=[2]),
              SamplingParams(temperature=0, logprobs=0, repetition_penalty=0.9)]
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    rows = [SamplingRow(p, torch.Generator().manual_seed(p.seed) if p.seed is not None else None,
                        list(range(10, 40)), [11, 12, 12, 300][:i % 4], frozenset({0}), key=f"r{i}")
            for i, p in enumerate(params)]
    return logits, rows


def test_the_sampler_names_a_device_for_every_tensor_it_makes():
    """On a GPU the sampler runs where the logits are (a host round trip of [rows, vocab] float32 and
    a host softmax cost an 8B model's step 38 ms at batch 1 and 133 at 32 on an H200, against 6.4 and
    8.5 greedy): every tensor it makes is on the logits' device, or on the host by name (the seeded
    draws, the kept token counts). A factory call without a device would land on the CPU."""
    from torch.overrides import TorchFunctionMode

    from engine.sample.penalties import TokenCounts
    from engine.sample.sampler import sample

    factories = {torch.tensor, torch.zeros, torch.ones, torch.full, torch.arange, torch.empty, torch.rand,
                 torch.randn, torch.as_tensor}

    class Factories(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.made, self.unplaced = 0, []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in factories:
                self.made += 1
                if kwargs.get("device") is None:
                    self.unplaced.append(func.__name__)
            return func(*args, **kwargs)

    for counts in (None, TokenCounts()):          # the per-row penalties, then the batched ones
        logits, rows = _every_kind_of_row(3000)
        with Factories() as mode:
            tokens, failed = sample(logits, rows, counts)
        assert not failed and all(t is not None for t in tokens)
        assert mode.made > 10, "the mode saw the sampler's factory calls"
        assert mode.unplaced == [], f"tensors made without a device: {mode.unplaced}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_sampler_on_cuda_draws_what_it_draws_on_the_host():
    """Every kind of row (seeded draws, filters, penalties, logprobs) on CUDA logits: the same tokens
    as on the host, the same logprobs (a rank may differ by one where the device's log-softmax rounds
    a neighbour's logit to the chosen one's)."""
    from engine.sample.penalties import TokenCounts
    from engine.sample.sampler import sample

    logits, rows = _every_kind_of_row(128256, seed=1)
    host, host_failed = sample(logits.clone(), rows, TokenCounts())
    logits, rows = _every_kind_of_row(128256, seed=1)
    device, device_failed = sample(logits.cuda(), rows, TokenCounts())
    assert not host_failed and not device_failed
    assert [t.token_id for t in device] == [t.token_id for t in host]
    for h, d in zip(host, device):
        assert (h.top_logprobs is None) == (d.top_logprobs is None) and abs((h.rank or 0) - (d.rank or 0)) <= 1
        if h.logprob is not None:
            assert d.logprob == pytest.approx(h.logprob, abs=1e-4)


def test_the_ingress_tokenizes_bad_words_once(tiny_llama):
    """A completion or chat body's bad_words reach the engine tokenized by the ingress (which the
    engine then does not redo: a prepared request); a blank word is a 400."""
    import asyncio

    from cluster.config import ClusterConfig
    from records.errors import InvalidRequestError
    from router.ingress.preparer import RequestPreparer

    preparer = RequestPreparer(ClusterConfig(model=tiny_llama).ingress_spec())
    expected = bad_words_token_ids(["hello", "the end"], preparer.tokenizer)
    words = ["hello", "the end"]
    completion = asyncio.run(preparer.prepare_completion({"prompt": "Hi", "bad_words": words}))
    chat = asyncio.run(preparer.prepare_chat({"messages": [{"role": "user", "content": "Hi"}], "bad_words": words}))
    assert completion.params.bad_words_token_ids == expected == chat.params.bad_words_token_ids
    with pytest.raises(InvalidRequestError, match="bad_words must be") as refused:
        asyncio.run(preparer.prepare_completion({"prompt": "Hi", "bad_words": [" "]}))
    assert refused.value.param == "bad_words"           # the 400's param names the field
    with pytest.raises(InvalidRequestError, match="top_k must be") as refused:
        asyncio.run(preparer.prepare_chat({"messages": [{"role": "user", "content": "Hi"}], "top_k": -7}))
    assert refused.value.param == "top_k"
