"""Completions over HTTP on the shared apps (tests/serving/conftest.py), through the official `openai`
client: the offline engine's greedy text, whole and streamed; echo, logprobs in OpenAI's and vLLM's
shapes, stop strings, logit_bias, and vLLM's extras (token ids, prompt truncation, cache salt)."""
from __future__ import annotations

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from serving.apps import auth

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
pytestmark = pytest.mark.ray


def test_completion_matches_offline_engine_and_stream_matches(server, client, tiny_llama):
    prompt = "The quick brown fox jumps over the lazy dog and"
    llm = LLM(tiny_llama, dtype="float32", max_model_len=1024)
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    full = client.completions.create(model=server["model"], prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24
    chunks = list(client.completions.create(model=server["model"], prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats: the usage so far in every chunk, on both endpoints.
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create, body in ((client.completions.create, {"prompt": prompt}),
                         (client.chat.completions.create, {"messages": [{"role": "user", "content": prompt}]})):
        every = list(create(model=server["model"], max_tokens=5, temperature=0, stream=True, stream_options=options,
                            extra_body={"ignore_eos": True}, **body))
        assert [c.usage.completion_tokens for c in every] == [1, 2, 3, 4, 5, 5]
        assert len({(c.usage.prompt_tokens, c.usage.total_tokens - c.usage.completion_tokens) for c in every}) == 1


def test_echo_puts_the_prompt_first_with_its_logprobs(server, client, tiny_llama):
    """echo=True: each prompt before its completion, whole and streamed (in the first chunk); with
    logprobs the prompt's tokens come first with theirs (the first None), equal to the offline
    engine's prompt logprobs: what evaluation harnesses read to score a text's likelihood."""
    prompt = "The quick brown fox jumps over the lazy dog"
    llm = LLM(tiny_llama, dtype="float32", max_model_len=1024)
    off = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1,
                                              ignore_eos=True), use_tqdm=False)[0]
    ids, done = off.prompt_token_ids, off.outputs[0]
    want = [None] + [e[t].logprob for t, e in zip(ids[1:], off.prompt_logprobs[1:])]
    want += [e[t].logprob for t, e in zip(done.token_ids, done.logprobs)]
    kwargs = dict(model=server["model"], prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0]
    assert full.text == prompt + done.text
    lp = full.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 3
    assert lp.top_logprobs[0] is None and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(c.text for c in chunks) == full.text and chunks[0].text.startswith(prompt)
    assert chunks[0].logprobs.tokens == lp.tokens[:len(ids) + 1]
    assert [t for c in chunks for t in c.logprobs.token_logprobs][1:] == pytest.approx(want[1:], abs=1e-4)
    # max_tokens 0 with echo: the prompt alone, what a text-scoring client asks; without echo a 400.
    alone = client.completions.create(**{**kwargs, "max_tokens": 0})
    assert alone.choices[0].text == prompt and alone.usage.completion_tokens == 0
    assert len(alone.choices[0].logprobs.tokens) == len(ids)
    assert alone.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want[1:len(ids)], abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client.completions.create(model=server["model"], prompt=prompt, max_tokens=0)
    # Token-id prompts echo their decoding; echo without logprobs adds none; n > 1 cannot have both.
    two = client.completions.create(model=server["model"], prompt=[ids, ids[:4]], max_tokens=2, temperature=0,
                                    echo=True)
    assert [c.text[:len(prompt)] for c in two.choices][0] == prompt and two.choices[0].logprobs is None
    assert two.choices[1].text.startswith(llm.get_tokenizer().decode(ids[:4]))
    with pytest.raises(openai.BadRequestError, match="echo with logprobs needs n = 1"):
        client.completions.create(model=server["model"], prompt=prompt, max_tokens=2, n=2, echo=True, logprobs=1)


def test_prompt_logprobs_as_vllm_returns_them_and_no_model_field(server, client, tiny_llama):
    """vLLM's `prompt_logprobs`: a completion's choices each carry their prompt's (the first null,
    then the top N and the prompt's own token), equal to the offline engine's, on the colocated and
    the disaggregated app (whose router prefills such requests on the decode replica); a chat
    response carries them at the top level; with stream=true, or with n > 1 (the engine scores a
    prompt once), a 400. A request without `model` is served by the base model, as vLLM serves it."""
    prompt = "The quick brown fox jumps over the lazy dog"
    llm = LLM(tiny_llama, dtype="float32", max_model_len=1024)
    off = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ids = off.prompt_token_ids
    for prefix in ("", "/pd"):
        body = httpx.post(f"{server['base']}{prefix}/v1/completions", headers=auth(), timeout=120,
                          json={"prompt": [prompt, prompt], "max_tokens": 1, "prompt_logprobs": 2}).json()
        assert body.get("model") == server["model"] and len(body["choices"]) == 2, body
        for choice in body["choices"]:
            got = choice["prompt_logprobs"]
            assert got[0] is None and len(got) == len(ids)
            for tid, entry, want in zip(ids[1:], got[1:], off.prompt_logprobs[1:]):
                assert set(entry) == {str(t) for t in want}          # the top 2 and the prompt's token
                assert entry[str(tid)]["logprob"] == pytest.approx(want[tid].logprob, abs=1e-4)
                assert sorted(e["rank"] for e in entry.values() if e["rank"] is not None) == [1, 2]
                assert all(e["decoded_token"] == llm.get_tokenizer().decode([int(t)]) for t, e in entry.items())
    chat = client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    lps = chat.model_extra["prompt_logprobs"]
    assert lps[0] is None and len(lps) == chat.usage.prompt_tokens and all(len(e) == 1 for e in lps[1:])
    plain = client.completions.create(model=server["model"], prompt=prompt, max_tokens=1)
    assert "prompt_logprobs" not in plain.choices[0].model_extra
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs is not available with stream=true"):
        client.completions.create(model=server["model"], prompt=prompt, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs must be None when n > 1"):
        client.completions.create(model=server["model"], prompt=prompt, max_tokens=1, n=2,
                                  extra_body={"prompt_logprobs": 1})


def test_logprobs_and_stop(server, client):
    out = client.completions.create(model=server["model"], prompt="One two three", max_tokens=6, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob >= c.top_logprobs[-1].logprob for c in content)     # greedy: chosen is the best

    base = client.completions.create(model=server["model"], prompt="One two three", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    assert stop.strip(), base
    cut = client.completions.create(model=server["model"], prompt="One two three", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:base.index(stop)]


def test_logit_bias_over_http(server, client):
    """OpenAI's logit_bias (token ids as strings): 100 forces a token on both endpoints; out of
    range or off the vocabulary is a 400 naming the field."""
    kwargs = dict(model=server["model"], max_tokens=3, temperature=0.7, seed=1, logit_bias={"77": 100})
    want = httpx.post(f"{server['base']}/detokenize", json={"tokens": [77] * 3}, headers=auth()).json()["prompt"]
    assert client.completions.create(prompt="One two three", **kwargs).choices[0].text == want
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kwargs)
    assert chat.choices[0].message.content == want
    for bias in ({"77": 500}, {"10000000": 1}, {"x": 1}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.completions.create(model=server["model"], prompt="Hi", max_tokens=2, logit_bias=bias)


def test_vllm_token_ids_salt_and_truncation(server, client):
    """vLLM's request extras: `return_token_ids` (the prompt's ids and each choice's, whole and
    streamed, chat and completions: the ids /tokenize gives and the ones the text decodes from),
    `truncate_prompt_tokens` (the prompt's last k tokens: the same greedy answer as those ids sent
    alone) and `cache_salt` (a salt's cached prompt is reused by the same salt only)."""
    model = server["model"]
    base = server["base"]
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = httpx.post(f"{base}/tokenize", json={"messages": messages}, headers=auth()).json()["tokens"]
    extra = {"return_token_ids": True}
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                          extra_body=extra)
    out = chat.choices[0].model_extra["token_ids"]
    assert chat.model_extra["prompt_token_ids"] == ids and len(out) == chat.usage.completion_tokens
    assert httpx.post(f"{base}/detokenize", json={"tokens": out}, headers=auth()).json()["prompt"] == \
        chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, extra_body=extra))
    assert chunks[0].model_extra["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == out
    prompt = "The colours of the rainbow are"
    pids = httpx.post(f"{base}/tokenize", json={"prompt": prompt}, headers=auth()).json()["tokens"]
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, extra_body=extra)
    assert whole.choices[0].model_extra["prompt_token_ids"] == pids
    streamed = list(client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                              stream=True, extra_body=extra))
    assert streamed[0].choices[0].model_extra["prompt_token_ids"] == pids
    assert [t for c in streamed for t in c.choices[0].model_extra["token_ids"]] == \
        whole.choices[0].model_extra["token_ids"]

    cut = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 3, **extra})
    alone = client.completions.create(model=model, prompt=pids[-3:], max_tokens=5, temperature=0)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].model_extra["prompt_token_ids"] == pids[-3:]
    assert cut.choices[0].text == alone.choices[0].text

    long_prompt = "Salted prompt, " + " ".join(f"word{i}" for i in range(80))

    def cached(salt: str | None) -> int:
        body = {} if salt is None else {"cache_salt": salt}
        r = client.completions.create(model=model, prompt=long_prompt, max_tokens=1, extra_body=body)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0 and cached("tenant-a") > 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    bad = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "x", "cache_salt": ""},
                     headers=auth())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_beam_search_over_http_equals_offline(server, client, tiny_llama):
    """vLLM's use_beam_search / best_of / n / length_penalty on completions and chat: the beams the
    offline engine finds (equal to transformers', tests/engine/test_beam_search.py), best first."""
    prompt = [(j * 17) % 600 + 3 for j in range(20)]
    llm = LLM(tiny_llama, dtype="float32", max_model_len=1024)
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=8, length_penalty=0.8)
    want = [c.token_ids for c in llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs]
    body = {"use_beam_search": True, "best_of": 3, "length_penalty": 0.8}
    got = client.completions.create(model=server["model"], prompt=prompt, max_tokens=8, n=2, extra_body=body)
    tok = llm.get_tokenizer()
    assert [c.text for c in got.choices] == [tok.decode(w, skip_special_tokens=True) for w in want]
    assert got.usage.completion_tokens == sum(len(w) for w in want)
    messages = [{"role": "user", "content": "Name a color."}]
    want = llm.chat(messages, params, use_tqdm=False)[0].outputs
    chat = client.chat.completions.create(model=server["model"], messages=messages, max_tokens=8, n=2,
                                          extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.8})
    assert [c.message.content for c in chat.choices] == [w.text for w in want]
    # With logprobs: three distinct beams, each token's logprob the offline engine's (and its top 1).
    params = SamplingParams(use_beam_search=True, n=3, max_tokens=8, logprobs=1)
    want = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs
    got = client.completions.create(model=server["model"], prompt=prompt, max_tokens=8, n=3, logprobs=1,
                                    extra_body={"use_beam_search": True})
    assert len({c.text for c in got.choices}) == 3
    for c, w in zip(got.choices, want, strict=True):
        assert c.logprobs.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(w.token_ids, w.logprobs)],
                                                          abs=1e-5)
        assert all(len(top) in (1, 2) for top in c.logprobs.top_logprobs)
    want = llm.chat(messages, params, use_tqdm=False)[0].outputs
    chat = client.chat.completions.create(model=server["model"], messages=messages, max_tokens=8, n=3,
                                          logprobs=True, top_logprobs=1, extra_body={"use_beam_search": True})
    for c, w in zip(chat.choices, want, strict=True):
        assert [x.logprob for x in c.logprobs.content] == pytest.approx(
            [e[t].logprob for t, e in zip(w.token_ids, w.logprobs)], abs=1e-5)
        assert all(len(x.top_logprobs) == 1 for x in c.logprobs.content)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model=server["model"], prompt="x", max_tokens=4, stream=True,
                                  extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match=r"best_of must be n \(1\) without use_beam_search"):
        client.completions.create(model=server["model"], prompt="x", max_tokens=4, extra_body={"best_of": 2})
    # OpenAI's default (best_of 1, n 1) is no beam search: the plain greedy answer
    plain = client.completions.create(model=server["model"], prompt="x", max_tokens=4, temperature=0)
    assert client.completions.create(model=server["model"], prompt="x", max_tokens=4, temperature=0,
                                     best_of=1).choices[0].text == plain.choices[0].text


def test_vllm_request_ids_token_names_and_prompt_options(server, client):
    """vLLM's request_id (the response's id; an X-Request-Id header where the body names none, through
    Serve's proxy; equal ids from two requests at once both answered), return_tokens_as_token_ids
    (logprobs name tokens "token_id:<id>", the echoed prompt's too), truncation_side "right" (the
    prompt's first k tokens), chat echo (the continued message first, whole and streamed) and the
    fields refused with their reason."""
    import concurrent.futures

    model, base = server["model"], server["base"]
    kwargs = dict(model=model, max_tokens=4, temperature=0)
    assert client.completions.create(prompt="Hi", **kwargs, extra_body={"request_id": "r-1"}).id == "cmpl-r-1"
    messages = [{"role": "user", "content": "Name a colour."}]
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kwargs,
                                                 extra_body={"request_id": "r 2"}))
    assert {c.id for c in chunks} == {"chatcmpl-r 2"}
    header = client.with_options(default_headers={"X-Request-Id": "hdr-7"})
    assert header.chat.completions.create(messages=messages, **kwargs).id == "chatcmpl-hdr-7"
    assert header.chat.completions.create(messages=messages, **kwargs, extra_body={"request_id": "b"}).id == \
        "chatcmpl-b"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        same = list(pool.map(lambda _: client.completions.create(
            prompt="One two three", model=model, max_tokens=12, temperature=0,
            extra_body={"request_id": "dup", "ignore_eos": True}), range(4)))
    assert {r.id for r in same} == {"cmpl-dup"} and len({r.choices[0].text for r in same}) == 1
    assert all(r.usage.completion_tokens == 12 for r in same)
    bad = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "x"},
                     headers={**auth(), "X-Request-Id": "tab\there"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"

    as_ids = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    out = client.completions.create(prompt="One two", logprobs=2, echo=True, **kwargs, extra_body=as_ids).choices[0]
    ids = out.model_extra["prompt_token_ids"] + out.model_extra["token_ids"]
    assert out.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in out.logprobs.top_logprobs[1:] for k in top)
    assert out.logprobs.text_offset == [sum(len(f"token_id:{t}") for t in ids[:i]) for i in range(len(ids))]
    chat = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **kwargs,
                                          extra_body=as_ids).choices[0]
    named = [f"token_id:{t}" for t in chat.model_extra["token_ids"]]
    assert [c.token for c in chat.logprobs.content] == named
    assert [bytes(c.bytes).decode() for c in chat.logprobs.content] == named
    assert all(t.token.startswith("token_id:") for c in chat.logprobs.content for t in c.top_logprobs)

    prompt = "The colours of the rainbow are"
    pids = httpx.post(f"{base}/tokenize", json={"prompt": prompt}, headers=auth()).json()["tokens"]
    first = client.completions.create(prompt=prompt, **kwargs, extra_body={
        "truncate_prompt_tokens": 3, "truncation_side": "right", "return_token_ids": True}).choices[0]
    assert first.model_extra["prompt_token_ids"] == pids[:3]
    assert first.text == client.completions.create(prompt=pids[:3], **kwargs).choices[0].text

    opened = [*messages, {"role": "assistant", "content": "My colour is"}]
    cont = dict(messages=opened, **kwargs, extra_body={"add_generation_prompt": False, "continue_final_message": True})
    plain = client.chat.completions.create(**cont).choices[0].message.content
    echoed = client.chat.completions.create(**{**cont, "extra_body": {**cont["extra_body"], "echo": True}})
    assert echoed.choices[0].message.content == "My colour is" + plain
    streamed = list(client.chat.completions.create(**{**cont, "extra_body": {**cont["extra_body"], "echo": True}},
                                                   stream=True))
    assert streamed[0].choices[0].delta.content == "My colour is" and streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "My colour is" + plain

    for field, value in (("chat_template", "{{ messages }}"), ("kv_transfer_params", {"do_remote_decode": True})):
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": model, "messages": messages, field: value},
                       headers=auth())
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
