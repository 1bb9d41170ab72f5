"""Chat completions over HTTP on the shared apps (tests/serving/conftest.py): streamed and whole
answers and n, a reasoning parser's thinking apart from the content, structured outputs (the SDK's
parse() and vLLM's extras, on the P/D path too) and tool calls round trips."""
from __future__ import annotations

import json
import re

import openai
import pytest

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
pytestmark = pytest.mark.ray


def test_chat_stream_equals_non_stream_and_n2(server, client):
    messages = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model=server["model"], messages=messages, max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=server["model"], messages=messages, max_tokens=20,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert full.choices[0].message.role == "assistant"
    # The role goes out with the first token (as vLLM sends it), so a client's time to first chunk
    # is its time to first token: no chunk before it, and every chunk carries one token's text.
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is not None
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert len(chunks) == 20

    two = client.chat.completions.create(model=server["model"], messages=messages, max_tokens=12,
                                         temperature=1.0, n=2, seed=7)
    again = client.chat.completions.create(model=server["model"], messages=messages, max_tokens=12,
                                           temperature=1.0, n=2, seed=7)
    assert len(two.choices) == 2 and [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [c.message.content for c in again.choices]


def test_reasoning_parser_returns_the_thinking_apart(server):
    """serving.reasoning_parser (vLLM's --reasoning-parser qwen3; on the /limited app): an answer made
    (by a regex constraint, which structured_outputs_in_reasoning applies to the thinking too) to
    think first comes back with the text inside <think> as the message's `reasoning` and the rest as
    its content, streamed alike; with thinking turned off in the template (Qwen3's enable_thinking),
    all of it is content."""
    c = openai.OpenAI(base_url=f"{server['base']}/limited/v1", api_key="none", max_retries=0)
    kwargs = dict(model=server["model"], messages=[{"role": "user", "content": "Think, then answer."}],
                  max_tokens=40, temperature=0, extra_body={"guided_regex": "<think>[a-z]{2,8}</think>[a-z]{2,8}"})
    full = c.chat.completions.create(**kwargs).choices[0].message
    reasoning = full.model_extra["reasoning"]
    assert re.fullmatch("[a-z]{2,8}", reasoning) and re.fullmatch("[a-z]{2,8}", full.content)
    chunks = [ch.choices[0].delta for ch in c.chat.completions.create(**kwargs, stream=True) if ch.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in chunks) == reasoning
    assert "".join(d.content or "" for d in chunks) == full.content
    off = c.chat.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"],
                                                               "chat_template_kwargs": {"enable_thinking": False}}})
    assert off.choices[0].message.content == f"<think>{reasoning}</think>{full.content}"
    assert off.choices[0].message.model_extra["reasoning"] is None
    # vLLM's include_reasoning: false leaves the thinking out, whole and streamed; the content stays
    hidden = {**kwargs, "extra_body": {**kwargs["extra_body"], "include_reasoning": False}}
    quiet = c.chat.completions.create(**hidden).choices[0].message
    assert quiet.content == full.content and quiet.model_extra["reasoning"] is None
    chunks = [ch.choices[0].delta for ch in c.chat.completions.create(**hidden, stream=True) if ch.choices]
    assert not any(d.model_extra.get("reasoning") for d in chunks)
    assert "".join(d.content or "" for d in chunks) == full.content


def test_structured_outputs_over_http(server, client):
    """The openai SDK's parse() with a pydantic model (response_format json_schema, strict), a
    json_object and vLLM's guided_choice / structured_outputs extras, streamed and not, and the
    P/D path; a schema that cannot compile is a 400 naming the field."""
    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        sensor: str = Field(max_length=8)
        value: int = Field(ge=0, le=99)
        ok: bool

    model, messages = server["model"], [{"role": "user", "content": "Give a sensor reading."}]
    for seed in range(3):
        done = client.beta.chat.completions.parse(model=model, messages=messages, response_format=Reading,
                                                  max_tokens=200, temperature=0.8, seed=seed)
        assert isinstance(done.choices[0].message.parsed, Reading), done.choices[0].message.content
    pd = openai.OpenAI(base_url=f"{server['base']}/pd/v1", api_key="none", max_retries=0, timeout=120)
    done = pd.chat.completions.parse(model=model, messages=messages, response_format=Reading, max_tokens=200)
    assert isinstance(done.choices[0].message.parsed, Reading)
    # Any JSON object: this random model's keys may run past max_tokens (test_structured_output.py
    # checks complete objects on the embedded model); what it wrote is an object's start, and parses
    # whenever it stopped.
    obj = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0.5, seed=1,
                                         response_format={"type": "json_object"}).choices[0]
    assert obj.message.content.startswith("{")
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)
    choices = ["red", "green", "blue"]
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=20, stream=True,
                                            extra_body={"guided_choice": choices})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in choices
    text = client.completions.create(model=model, prompt="Code:", max_tokens=20, temperature=0.9,
                                     extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}}).choices[0].text
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", text), text
    with pytest.raises(openai.BadRequestError, match="structured_outputs.json cannot be compiled") as bad:
        client.chat.completions.create(model=model, messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    assert bad.value.response.json()["error"]["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError, match="only one of response_format, structured_outputs"):
        client.chat.completions.create(model=model, messages=messages, response_format={"type": "json_object"},
                                       extra_body={"guided_regex": "a+"})


def test_tool_calls_round_trip(server, client, eventually_no_leaks):
    """tools with tool_choice "required" (the grammar makes even this random model call), streamed
    and not: tool_calls in OpenAI's shape (the SDK assembles the streamed deltas into the same
    calls), finish_reason "tool_calls", arguments valid under the schema; then the tool's result
    goes back and the model answers in text. Unknown tool names, bad schemas and tool_choice
    without tools are 400s naming the field."""
    import jsonschema

    model = server["model"]
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": params}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=named,
                                          max_tokens=100, temperature=0.7, seed=3)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), params)

    # Streamed: by hand, and by the SDK's own stream helper (which assembles the deltas).
    stream = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=100, temperature=0.7, seed=4,
                                            stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            indexes = [d.index for d in c.delta.tool_calls or []]
            assert len(indexes) == len(set(indexes)), chunk        # one entry per call in a chunk
            assert c.delta.role or c.delta.content or indexes or c.finish_reason, chunk   # no empty chunk
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    streamed = calls[0]
    assert streamed["name"] in ("get_weather", "get_time") and streamed["id"].startswith("call_")
    json.loads(streamed["arguments"])
    with client.chat.completions.stream(model=model, messages=messages, tools=tools, tool_choice=named,
                                        max_tokens=100, temperature=0.7, seed=3) as helper:
        final = helper.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (call.function.name, call.function.arguments)]         # same seed as the whole answer above

    pd = openai.OpenAI(base_url=f"{server['base']}/pd/v1", api_key="none", max_retries=0, timeout=120)
    (pd_call,) = pd.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=named,
                                            max_tokens=100, temperature=0.7, seed=3).choices[0].message.tool_calls
    assert (pd_call.function.name, pd_call.function.arguments) == (call.function.name, call.function.arguments)

    # The result goes back (the assistant's call in OpenAI's shape, then the tool message).
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    answer = client.chat.completions.create(model=model, messages=follow, tools=tools, max_tokens=12,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=follow, tools=tools, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert text == (answer.choices[0].message.content or "")

    for body, match, param in [
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope' is not one of",
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
          "tool_choice": "required"}, "cannot be compiled", "tools"),
        ({"tool_choice": "required"}, "needs a non-empty tools list", "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "should match pattern", "tools"),
        ({"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be combined with response_format", "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match) as bad:
            client.chat.completions.create(model=model, messages=messages, max_tokens=5, **body)
        assert (bad.value.response.json()["error"]["param"] or "").startswith(param), body
    for manager in server["managers"][:1]:
        assert eventually_no_leaks(ray.get(manager.replicas.remote("decode")))
