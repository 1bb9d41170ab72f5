"""OpenAI's Responses API (`/v1/responses`) on the shared apps (tests/serving/conftest.py): the chat
completion's text, whole and as typed events, function calls out and back, the thinking as a
reasoning item; and the event stream's shape from chunks that split `<think>` anywhere (unit)."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from engine import SamplingParams
from serving.apps import auth

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
pytestmark = pytest.mark.ray


def test_responses_api_returns_the_thinking_as_a_reasoning_item(server):
    """Under a reasoning parser (the /limited app) the Responses API returns the thinking as a
    `reasoning` item (vLLM's shape: reasoning_text content, streamed as response.reasoning_text.*
    events), the same text as the chat message's `reasoning`; the tiny model never closes its
    thinking, so all of its answer is reasoning (vLLM's rule), and counted so in the usage."""
    c = openai.OpenAI(base_url=f"{server['base']}/limited/v1", api_key="none", max_retries=0)
    chat = c.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "Say it."}],
                                     max_tokens=10, temperature=0)
    kwargs = dict(model=server["model"], input="Say it.", max_output_tokens=10, temperature=0)
    resp = c.responses.create(**kwargs)
    (item,) = resp.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text" and item.status == "completed"
    assert item.content[0].text == chat.choices[0].message.model_extra["reasoning"] and resp.output_text == ""
    assert resp.usage.output_tokens_details.reasoning_tokens == resp.usage.output_tokens == 10
    events = list(c.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text


def test_responses_reasoning_then_message_events():
    """A Responses run (router/ingress/responses_api.py) fed chunks that split `<think>...</think>` anywhere:
    a reasoning item then a message item, every event and the response valid for the openai SDK's
    types, the deltas adding up to the items' texts, the thinking's chunks counted as reasoning."""
    from types import SimpleNamespace

    from pydantic import TypeAdapter

    from router.ingress.responses_api import _Run
    from router.ingress.responses_request import ResponsesRequest

    frontend = SimpleNamespace(count_finished=lambda reason: None,
                               preparer=SimpleNamespace(response_model=lambda params: "m"))
    run = _Run(SimpleNamespace(frontend=frontend), ResponsesRequest(model="m", input="hi"),
               SamplingParams(max_tokens=8), [1, 2, 3], None, thinking=True)
    chunks = ["<thi", "nk>so ", "I think</th", "ink>\n\nHel", "lo"]

    async def deltas():
        for i, text in enumerate(chunks):
            choice = SimpleNamespace(text=text, token_ids=[0], finish_reason="stop" if i == len(chunks) - 1 else None)
            yield 0, SimpleNamespace(choices=[choice], num_cached_tokens=0, weight_version=None)

    async def collect():
        return [e async for e in run.events(deltas())]

    events = asyncio.run(collect())
    usage = events[-1]["response"]["usage"]
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    for e in events:     # (the SDK's usage type wants OpenAI's cache_write_tokens, which no server here sends)
        adapter.validate_python({**e, "response": {**e["response"], "usage": None}} if "response" in e else e)
    final = openai.types.responses.Response.model_validate({**events[-1]["response"], "usage": None})
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "so I think" and final.output_text == "\n\nHello"
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "so I think"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "\n\nHello"
    assert usage["output_tokens_details"]["reasoning_tokens"] == 4 and usage["output_tokens"] == 5

    # With tools, the calls are read from the content only (hermes format: <tool_call> blocks).
    run = _Run(SimpleNamespace(frontend=frontend), ResponsesRequest(model="m", input="hi"),
               SamplingParams(max_tokens=8), [1, 2, 3], SimpleNamespace(name="hermes"), thinking=True)
    chunks = ["<think>a <tool_call> is", " next</think>", '<tool_call>\n{"name": "f", ',
              '"arguments": {"a": 1}}\n</tool_call>']
    events = asyncio.run(collect())
    final = openai.types.responses.Response.model_validate({**events[-1]["response"], "usage": None})
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert final.output[0].content[0].text == "a <tool_call> is next"
    assert (final.output[1].name, json.loads(final.output[1].arguments)) == ("f", {"a": 1})


def test_responses_api(server, client, eventually_no_leaks):
    """OpenAI's Responses API through the SDK's `client.responses`: the same text as the chat
    completion of the same conversation (greedy), whole and streamed (typed events in order, which
    the SDK's stream helper accumulates into the same response); max_output_tokens makes it
    incomplete; function calls (forced by tool_choice) go out as function_call items and come back
    as input with their outputs, answered as chat answers them; 400s name the Responses field."""
    import jsonschema

    model = server["model"]
    chat = client.chat.completions.create(model=model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}])
    kwargs = dict(model=model, instructions="Be brief.", input="Name three colours.", max_output_tokens=12,
                  temperature=0)
    resp = client.responses.create(**kwargs)
    assert resp.output_text == chat.choices[0].message.content and resp.object == "response"
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"

    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{resp.status}"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text
    assert events[-1].response.output_text == resp.output_text
    with client.responses.stream(**kwargs) as helper:       # the SDK's accumulator takes the events in order
        last = list(helper)[-1]
    assert last.type == f"response.{resp.status}" and last.response.output_text == resp.output_text
    # The OpenAI Agents SDK sends an empty `include` on every call.
    assert client.responses.create(**kwargs, include=[]).output_text == resp.output_text
    short = client.responses.create(**{**kwargs, "max_output_tokens": 2})
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"

    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": params}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    required = client.responses.create(model=model, input=ask, tools=tools, tool_choice="required",
                                       temperature=0.7, max_output_tokens=100)
    calls = [o for o in required.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), params)
    # A named choice makes exactly one call (greedy here, so the round trip below is one conversation).
    called = client.responses.create(model=model, input=ask, tools=tools, temperature=0, max_output_tokens=100,
                                     tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in called.output if o.type == "function_call"]
    assert [o.type for o in called.output] == ["function_call"]
    jsonschema.validate(json.loads(calls[0].arguments), params)
    streamed = [e for e in client.responses.create(model=model, input=ask, tools=tools, stream=True,
                                                   tool_choice={"type": "function", "name": "get_weather"},
                                                   max_output_tokens=100)
                if e.type.startswith("response.function_call_arguments")]
    assert streamed[-1].type == "response.function_call_arguments.done"
    assert "".join(e.delta for e in streamed[:-1]) == streamed[-1].arguments
    # The call and its output go back; the answer is the chat answer to the same conversation.
    back = ask + [o.model_dump(exclude_none=True) for o in called.output]
    back += [{"type": "function_call_output", "call_id": c.call_id, "output": '{"temp_c": 21}'} for c in calls]
    answer = client.responses.create(model=model, input=back, tools=tools, max_output_tokens=12, temperature=0)
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls]}]
    follow += [{"role": "tool", "tool_call_id": c.call_id, "content": '{"temp_c": 21}'} for c in calls]
    expected = client.chat.completions.create(model=model, messages=follow, tools=chat_tools, max_tokens=12,
                                              temperature=0).choices[0].message
    assert answer.output_text == (expected.content or "")

    for body, match, param in [
        ({"input": []}, "input must not be empty", "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role must be one of", "input[0].role"),
        ({"input": [{"type": "input_image"}]}, "must be one of message, function_call", "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "this model takes no images", "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "parts must be text", "input[0].content"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"max_output_tokens": 10**6}, "max_output_tokens must be <=", "max_output_tokens"),
        ({"previous_response_id": "resp_1"}, "stores no responses", "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools.type", "tools.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema is required",
         "text.format.schema"),
        ({"reasoning_effort": "high"}, "not supported", "reasoning_effort"),
        ({"reasoning": {"effort": "low"}}, "not supported", "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include: not supported", "include"),
    ]:
        data = {"model": model, "input": "Hi", **body}
        r = httpx.post(f"{server['base']}/v1/responses", json=data, headers=auth())
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert match in err["message"] and err["param"] == param, (body, err)
    for manager in server["managers"][:1]:
        assert eventually_no_leaks(ray.get(manager.replicas.remote("decode")))
