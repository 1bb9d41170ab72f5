"""Beam search (engine/beam_search.py; LLM.generate with use_beam_search) against transformers'
`generate(num_beams=k)` on tiny random models in fp32: the same n best sequences, in order, with
the same scores, under its length penalties and early-stopping modes, through EOS (a frequent
token made a stop token, on both sides) and max-length endings; the prompt's blocks are held once
for all beams (the pool's peak use checked against a copy per beam); per-token logprobs are
transformers' transition scores. The served path is
tests/serving/test_completions.py's beam test."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = [[(i * 31 + j * 7) % 800 + 3 for j in range(n)] for i, n in enumerate((5, 23, 41))]
MAX_TOKENS = 10


def hf_beams(hf, prompt: list[int], k: int, n: int, eos: list[int], **kwargs) -> list[tuple[list[int], float]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=n, do_sample=False,
                          max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=eos[0],
                          return_dict_in_generate=True, output_scores=True, **kwargs)
    beams = []
    for i in range(n):
        length = int((out.beam_indices[i] >= 0).sum())
        beams.append((out.sequences[i, len(prompt):len(prompt) + length].tolist(), float(out.sequences_scores[i])))
    return beams


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_beam_search_matches_transformers(request, kind):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(f"tiny_{kind}")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", block_size=8, max_model_len=128)
    eos = sorted(llm.llm_engine.eos_token_ids)
    # A token the model often writes, made a stop token on both sides: some beams end early.
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8,
                                                                                      ignore_eos=True),
                          use_tqdm=False)
    stop = max(set(greedy[1].outputs[0].token_ids), key=greedy[1].outputs[0].token_ids.count)
    cases = [(4, 2, {}, []), (3, 3, {"length_penalty": 0.5, "early_stopping": True}, [stop]),
             (4, 1, {"length_penalty": 1.5, "early_stopping": "never"}, [stop]), (2, 2, {}, [stop])]
    ended = set()
    for k, n, kwargs, stops in cases:
        params = SamplingParams(use_beam_search=True, best_of=k, n=n, max_tokens=MAX_TOKENS, stop_token_ids=stops,
                                **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            want = hf_beams(hf, prompt, k, n, sorted(set(eos) | set(stops)), **kwargs)
            got = [(c.token_ids, c.cumulative_logprob / len(c.token_ids) ** params.length_penalty)
                   for c in out.outputs]
            assert [g[0] for g in got] == [w[0] for w in want], (k, n, kwargs, prompt)
            assert all(abs(g[1] - w[1]) < 1e-4 for g, w in zip(got, want)), (got, want)
            ended |= {c.finish_reason for c in out.outputs}
    assert ended == {"stop", "length"}      # both endings were exercised


def test_beam_logprobs_are_transformers_transition_scores(tiny_llama):
    """With `logprobs`, each beam's tokens carry their log probabilities (transformers'
    `compute_transition_scores` for the same beams) and the position's top entries, ranked; they sum
    to the beam's cumulative logprob; the beams come best first. (Not checked: that the best beam is
    at least as likely as the greedy sequence. Beam search does not promise it, and on this random
    model one prompt's best of three beams is less likely: -63.53 against -63.51.)"""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    llm = LLM(tiny_llama, dtype="float32", block_size=8, max_model_len=128)
    eos = sorted(llm.llm_engine.eos_token_ids)
    k, top = 3, 2
    params = SamplingParams(use_beam_search=True, best_of=k, n=k, max_tokens=MAX_TOKENS, logprobs=top)
    for prompt in PROMPTS[:2]:
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, do_sample=False,
                              max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=eos[0],
                              return_dict_in_generate=True, output_scores=True)
        steps = hf.compute_transition_scores(ref.sequences, ref.scores, ref.beam_indices, normalize_logits=False)
        assert len({tuple(c.token_ids) for c in out}) == k
        for i, beam in enumerate(out):
            assert len(beam.logprobs) == len(beam.token_ids)
            chosen = [entry[t].logprob for t, entry in zip(beam.token_ids, beam.logprobs)]
            assert chosen == pytest.approx(steps[i, :len(chosen)].tolist(), abs=1e-4)
            assert sum(chosen) == pytest.approx(beam.cumulative_logprob, abs=1e-4)
            for t, entry in zip(beam.token_ids, beam.logprobs):
                ranked = list(entry.values())
                assert [lp.rank for lp in ranked[:top]] == [1, 2]
                assert ranked[0].logprob >= ranked[1].logprob
                if t not in list(entry)[:top]:                  # outside the top: after them, ranked
                    assert len(entry) == top + 1 and entry[t].rank > top
                    assert entry[t].logprob <= ranked[top - 1].logprob
        scores = [c.cumulative_logprob / len(c.token_ids) for c in out]     # length_penalty 1
        assert scores == sorted(scores, reverse=True)


def test_beams_share_the_prompt_blocks_and_free_them(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", block_size=8, max_model_len=128)
    engine = llm.llm_engine
    pool = engine.scheduler.kv.block_pool
    peak = 0
    step = engine.step

    def counting_step():
        nonlocal peak
        outs = step()
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
        return outs

    engine.step = counting_step
    prompt = [(j * 13) % 700 + 3 for j in range(64)]            # 8 full blocks
    k = 4
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(use_beam_search=True, best_of=k, n=k,
                                                                      max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs) == k and all(len(c.token_ids) == 12 for c in out.outputs)
    per_copy = -(-(64 + 12) // 8)                               # blocks one beam alone needs at the end
    # Every beam reads the prompt's 8 blocks from the prefix cache: held once, each beam adding its
    # own tail (at most two blocks), far below a copy per beam.
    assert peak <= 8 + 2 * k < k * per_copy, peak
    assert engine.stats().prefix_cache_hits >= 11 * k * 64      # every step after the first


def test_beam_search_refuses_what_it_cannot_take(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128)
    for kwargs, field in ((dict(stop=["x"]), "stop"), (dict(prompt_logprobs=2), "prompt_logprobs"),
                          (dict(best_of=11, n=1), "best_of"), (dict(presence_penalty=0.5), "penalties")):
        with pytest.raises(ValueError, match=field):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(use_beam_search=True, **kwargs),
                         use_tqdm=False)
    with pytest.raises(ValueError, match="best_of must be n .1. without use_beam_search"):
        SamplingParams(best_of=3)
    assert SamplingParams(best_of=2, n=2).best_of is None       # OpenAI's default meaning: nothing more
    with pytest.raises(ValueError, match="use_beam_search: beam search runs over the engine"):
        llm.llm_engine.add_request("x", None, PROMPTS[0], SamplingParams(use_beam_search=True, best_of=2))
