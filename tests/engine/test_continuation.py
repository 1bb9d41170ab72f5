"""A request continued on another engine (records/request.py: Continuation), what the router's
migration sends when the replica running a stream is lost: the new engine computes the prompt and
the tokens already sent, and goes on exactly as the lost one would have. Checked against the same
engine's uninterrupted run at several cut points (a block boundary, a stop string spanning the cut,
seeded sampling, penalties, logprobs, an output constraint); bad continuations are refused naming
the field."""
from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from records.request import Continuation

PROMPT = list(range(40, 61))          # 21 tokens: the cut points below fall on either side of a block


@pytest.fixture(scope="module")
def engine(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", block_size=16)
    yield llm.llm_engine
    llm.shutdown()


def run(engine, rid: str, params: SamplingParams, continuation: Continuation | None = None) -> list:
    """The request's delta outputs' completions, one per step, until it finishes."""
    params = dataclasses.replace(params, output_kind="delta")
    engine.add_request(rid, None, PROMPT, params, continuation=continuation)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o.outputs[0] for o in engine.step() if o.request_id == rid and o.outputs]
    engine.check_no_leaks()
    return outs


def cut(outs: list, k: int) -> Continuation:
    """What a client had after the first k tokens: those tokens and the text sent with them."""
    tokens, chars = [], 0
    for c in outs:
        if len(tokens) >= k:
            break
        tokens += c.token_ids
        chars += len(c.text)
    assert len(tokens) == k          # one token per step (no speculative decoding here)
    return Continuation(tuple(tokens), chars)


def joined(outs: list) -> tuple[list[int], str, str | None]:
    return ([t for c in outs for t in c.token_ids], "".join(c.text for c in outs), outs[-1].finish_reason)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    # top_k: draws far from a boundary between candidates (over the whole vocabulary of a random
    # model, the prefill-computed logits of the resumed tokens, a few 1e-6 off the decode-computed
    # ones, move a boundary across a draw now and then: the draws are the same, a token is not).
    SamplingParams(temperature=1.0, top_k=4, seed=1234, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5,
                   repetition_penalty=1.2, min_tokens=20),
], ids=["greedy", "seeded", "penalties"])
def test_a_continued_request_goes_on_as_the_uninterrupted_one(engine, params):
    whole = run(engine, "whole", params)
    tokens, text, finish = joined(whole)
    assert len(tokens) == 24 and finish == "length"
    for k in (1, 11, 16, 23):          # 21 + 11 = 32 tokens: a whole number of blocks
        c = cut(whole, k)
        rest = run(engine, f"cont-{k}", params, c)
        r_tokens, r_text, r_finish = joined(rest)
        assert list(c.token_ids) + r_tokens == tokens, k
        assert text[:c.num_chars] + r_text == text, k
        assert r_finish == finish


def test_a_stop_string_spanning_the_cut_and_held_back_text(engine):
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    text = joined(run(engine, "free", free))[1]
    stop = text[len(text) // 2:len(text) // 2 + 6]
    params = dataclasses.replace(free, stop=[stop])
    whole = run(engine, "stopped", params)
    tokens, expected, finish = joined(whole)
    assert (finish, whole[-1].stop_reason, expected) == ("stop", stop, text[:text.index(stop)])
    # Cut inside the run of text held back for the stop string (sent chars < the text of k tokens).
    for k in range(1, len(tokens)):
        c = cut(whole, k)
        rest = run(engine, f"stop-{k}", params, c)
        r_tokens, r_text, r_finish = joined(rest)
        assert expected[:c.num_chars] + r_text == expected, k
        assert (r_finish, rest[-1].stop_reason) == ("stop", stop), k


def test_a_continued_request_keeps_to_its_output_constraint(engine):
    """The grammar's matcher catches up with the tokens already sent, then constrains the rest."""
    from records.sampling_params import StructuredOutputsParams

    spec = StructuredOutputsParams(regex=r"(the|a|an) [a-z ]{30,40}")
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec)
    whole = run(engine, "so", params)
    tokens, text, finish = joined(whole)
    assert finish == "stop" and 32 <= len(text) <= 44, text
    c = cut(whole, 4)
    rest = run(engine, "so-cont", params, c)
    assert list(c.token_ids) + joined(rest)[0] == tokens and text[:c.num_chars] + joined(rest)[1] == text


def test_logprobs_of_a_continued_request_are_those_of_its_new_tokens(engine):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    whole = run(engine, "lp", params)
    lps = [d for c in whole for d in c.logprobs]
    rest = run(engine, "lp-cont", params, cut(whole, 5))
    got = [d for c in rest for d in c.logprobs]
    assert len(got) == 7
    for a, b in zip(got, lps[5:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


@pytest.mark.parametrize(("change", "continuation", "match"), [
    ({"n": 2}, Continuation((5,)), "continuation needs n == 1"),
    ({}, Continuation(()), r"continuation.token_ids must be a non-empty list of token ids in \[0, "),
    ({}, Continuation((10**9,)), r"continuation.token_ids must be a non-empty list of token ids"),
    ({"max_tokens": 2}, Continuation((5, 6)), r"has 2 tokens; the request's max_tokens \(2\) leaves none"),
    ({}, Continuation((5,), -1), "continuation.num_chars must be >= 0"),
])
def test_bad_continuations_are_refused(engine, change, continuation, match):
    params = dataclasses.replace(SamplingParams(temperature=0.0, max_tokens=8), **change)
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", None, PROMPT, params, continuation=continuation)
    assert not engine.has_unfinished_requests()
    engine.check_no_leaks()
