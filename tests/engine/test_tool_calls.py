"""Tool calling (engine/text/tool_calls.py): the readers of both formats, whole and streamed in pieces of
every size; the format read from the chat template and the prompt each kind of template gets;
tool_choice required / named / strict auto enforced by the grammar on the embedded model, sampled,
with arguments that validate against their schemas. The HTTP round trip is in tests/serving/test_chat.py."""
from __future__ import annotations

import copy
import json
import os
import sys

import jsonschema
import pytest
from helpers import REPO

from engine import LLM, SamplingParams
from engine.text.tokenizer import apply_chat_template
from engine.text.tool_calls import ToolFormat
from engine.text.tool_parser import ToolCallStream, coalesce
from records.sampling_params import StructuredOutputsParams

sys.path.append(os.path.join(REPO, "benchmarks"))
from structured import TOOLS  # benchmarks/structured.py (appended to the path: it must not shadow the packages)

SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
# (format, text, content, [(name, arguments as objects)])
CASES = [
    ("hermes", HERMES, "Let me look.\n", [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]),
    ("hermes", "A plain answer, <tool not a call>.", "A plain answer, <tool not a call>.", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call> then text", "<tool_call>\n{not json}\n</tool_call> then text",
     []),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1', None,
     [("add", '{"a": 1')]),                                      # cut off by max_tokens: what it had
    ("hermes", '<tool_call>\n{"arguments": {"b": "}"}, "name": "add"}\n</tool_call>', None,
     [("add", {"b": "}"})]),                                     # name last: the call goes out whole
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"s": "a \\" } </tool_call> {"}}\n</tool_call>x', "x",
     [("f", {"s": 'a " } </tool_call> {'})]),                    # braces and tags inside strings
    ("hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 5}"}\n</tool_call>', None,
     [("add", {"a": 5})]),                                        # arguments as JSON text
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
     '"parameters": {"city": "Oslo", "unit": "f"}}', None, [("add", {"a": 1, "b": 2}),
                                                          ("get_weather", {"city": "Oslo", "unit": "f"})]),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", '
     '"arguments": {"city": "Oslo", "unit": "f"}}]', "Sure.", [("add", {"a": 1, "b": 2}),
                                                              ("get_weather", {"city": "Oslo", "unit": "f"})]),
    ("mistral", '[TOOL_CALLS] {"name": "add", "arguments": {}}', None, [("add", {})]),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("mistral", "A [TOOL plain answer", "A [TOOL plain answer", []),
    ("llama3_json", 'It is {"name": "add"}', 'It is {"name": "add"}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),    # JSON, but not a call
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_readers_whole_and_streamed(fmt, text, content, calls):
    """Fed in pieces of every size from 1 to 9 characters, the streaming reader gives the same content
    and calls as the whole-text parse, and both give what the text holds; each piece's call deltas,
    coalesced as a chunk sends them, hold one entry per call."""
    got_content, got_calls = ToolFormat(fmt, native=True).parse(text)
    assert got_content == content
    assert [(c.name, _args(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)
    if fmt == "mistral":          # what Mistral's templates accept when the calls come back
        assert all(len(c.id) == 9 and c.id.isalnum() for c in got_calls)
    for size in range(1, 10):
        reader, streamed, deltas = ToolCallStream(fmt), "", []
        for i in range(0, len(text), size):
            more, new = reader.feed(text[i:i + size])
            streamed += more
            new = coalesce(new)
            assert len({d.index for d in new}) == len(new), size
            deltas += new
        more, new = reader.finish()
        new = coalesce(new)
        assert (streamed + more or None) == content, size
        assembled: dict[int, list[str]] = {}          # as the SDK assembles streamed calls
        for d in deltas + new:
            assert (d.id is not None and d.name is not None) == (d.index not in assembled), size
            assembled.setdefault(d.index, [d.name, ""])[1] += d.arguments
        assert [(name, _args(args)) for name, args in assembled.values()] == calls, size
        assert [(c.name, c.arguments) for c in got_calls] == [tuple(v) for v in assembled.values()]
        if size == 1 and text == HERMES:              # the arguments went out as they came
            assert len(deltas + new) > 2 * len(calls)


def _args(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text                     # a call cut off by max_tokens


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>"
    "{{ m.content }}<|eot_id|>{% endfor %}{% if tools %}Tools: {{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}")
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% for m in messages %}"
    "{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}[TOOL_CALLS]"
    "{{ m.tool_calls | map(attribute='function') | list | tojson }}</s>{% elif m.role == 'tool' %}"
    "[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_format_and_prompt_follow_the_chat_template(smol_tokenizer):
    """A template that ignores tools (SmolLM2's) gets them, and the earlier call and its result, as
    Hermes text; a template that renders tools gets them itself, with the arguments as objects; a
    call tag that is a special token is noted (the text must keep it); Llama 3's is read as
    llama3_json."""
    fmt = ToolFormat.of(smol_tokenizer)
    assert fmt == ToolFormat("hermes", native=False)
    messages, tools = fmt.template_inputs(copy.deepcopy(CONVERSATION), TOOLS)
    assert tools is None and messages[0]["role"] == "system"
    prompt = smol_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in prompt

    native = copy.deepcopy(smol_tokenizer)
    native.chat_template = HERMES_TEMPLATE
    fmt = ToolFormat.of(native)
    assert fmt == ToolFormat("hermes", native=True)
    messages, tools = fmt.template_inputs(copy.deepcopy(CONVERSATION), TOOLS)
    assert tools == TOOLS and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}
    prompt = native.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "add"' in prompt and '"arguments": {"city": "Paris", "unit": "c"}}' in prompt

    assert not fmt.special_tag
    native.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    assert ToolFormat.of(native).special_tag        # the text keeps special tokens for these

    native.chat_template = MISTRAL_TEMPLATE
    fmt = ToolFormat.of(native)
    assert fmt.name == "mistral" and fmt.native
    prompt = native.apply_chat_template(*fmt.template_inputs(copy.deepcopy(CONVERSATION), TOOLS), tokenize=False)
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]' in prompt

    native.chat_template = LLAMA_TEMPLATE
    assert ToolFormat.of(native) == ToolFormat("llama3_json", native=True)
    assert ToolFormat.of(native, "hermes").name == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ToolFormat.of(native, "pythonic")


@pytest.fixture(scope="module")
def embedded() -> LLM:
    return LLM(None, max_model_len=2048, max_num_seqs=16)


def _params(fmt: ToolFormat, choice, parallel: bool, seed: int, temperature: float = 0.8) -> SamplingParams:
    tag = fmt.constraint(TOOLS, choice, parallel)
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=200,
                          structured_outputs=StructuredOutputsParams(structural_tag=tag) if tag else None)


@pytest.mark.parametrize("fmt_name", ["hermes", "llama3_json", "mistral"])
def test_enforced_tool_choice_gives_valid_calls(embedded, fmt_name):
    """On the embedded model (which was not trained to call tools), told the format and shown one
    call, in each format: "required" answers with calls only, each to an offered tool with arguments
    valid under its schema; a named function, exactly that call; parallel_tool_calls=False, exactly
    one call. Sampled at temperature 0.8, except "required" with parallel calls: a sample of this
    small model may go on adding calls to the list (the grammar allows any number) until max_tokens,
    so that one is greedy. Every block comes back."""
    tokenizer = embedded.get_tokenizer()
    fmt = ToolFormat.of(tokenizer, fmt_name)
    # One call and its answer before: the model follows the example in its next turn.
    messages = CONVERSATION + [{"role": "assistant", "content": "It is 21 degrees in Paris."},
                               {"role": "user", "content": "And the weather in Rome? What is 2 plus 3?"}]
    prompt = apply_chat_template(tokenizer, *fmt.template_inputs(copy.deepcopy(messages), TOOLS))
    named = {"type": "function", "function": {"name": "add"}}
    cases = [("required", True), ("required", False), (named, True)]
    params = [_params(fmt, choice, parallel, 10 * k + seed, 0.0 if parallel and choice == "required" else 0.8)
              for k, (choice, parallel) in enumerate(cases) for seed in range(2)]
    outs = embedded.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        choice, parallel = cases[i // 2]
        text = out.outputs[0].text
        content, calls = fmt.parse(text)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMA[call.name])
        assert out.outputs[0].finish_reason == "stop", (choice, text)
        assert content is None and calls, (choice, text)
        if not parallel or choice == named:
            assert len(calls) == 1
        if choice == named:
            assert calls[0].name == "add"
    pool = embedded.llm_engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_strict_tool_under_auto_checks_calls_only(embedded):
    """A strict tool under "auto": the grammar lets any text through, and the end, but once a call
    begins its arguments must follow the schema."""
    import xgrammar as xgr

    from engine.sample.structured_output import compiler_for

    tokenizer = embedded.get_tokenizer()
    info = embedded.llm_engine.config.model_info()
    compiler = compiler_for(info.model, info.gguf_file, info.vocab_size)
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    grammar = compiler.compile(StructuredOutputsParams(structural_tag=ToolFormat.of(tokenizer).constraint(
        strict, "auto", True)))

    def accepts(text: str, end: bool) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        ok = all(matcher.accept_token(t) for t in tokenizer.encode(text))
        return ok and (not end or matcher.accept_token(tokenizer.eos_token_id))

    assert accepts("Any text at all, <b>even</b> {json}.", end=True)
    assert accepts(HERMES.split("\n<tool_call>\n{\"name\": \"add\"")[0], end=True)
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": 5', end=False)
    assert not accepts('<tool_call>\n{"name": "nope"', end=False)
    assert not accepts('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', end=False)


def test_tool_choice_errors(embedded):
    fmt = ToolFormat.of(embedded.get_tokenizer())
    assert fmt.constraint(TOOLS, "none", True) is None and fmt.constraint(TOOLS, "auto", True) is None
    with pytest.raises(ValueError):
        fmt.constraint(TOOLS, {"type": "function", "function": {"name": "nope"}}, True)
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]
    tag = fmt.constraint(bad, "required", True)
    with pytest.raises(ValueError, match="structured_outputs.structural_tag cannot be compiled"):
        embedded.generate("x", SamplingParams(structured_outputs={"structural_tag": tag}), use_tqdm=False)


def test_tool_call_parser_from_the_command_line_and_the_spec():
    """`pdserve serve --tool-call-parser` (vLLM's flag) and `serving.tool_call_parser` name the
    format; anything else is refused naming the allowed ones."""
    import argparse

    from cluster.config import ClusterConfig
    from cluster.serve_args import add_serve_args, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert config_from_args(parser.parse_args(["--tool-call-parser", "mistral"])).serving.tool_call_parser == "mistral"
    assert config_from_args(parser.parse_args([])).serving.tool_call_parser is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        ClusterConfig.model_validate({"serving": {"tool_call_parser": "pythonic"}})


@pytest.mark.parametrize("text,thinking,want", [
    ("<think>\nabc\n</think>\n\nhello", True, ("\nabc\n", "\n\nhello")),
    ("abc</think>x", True, ("abc", "x")),                   # the template opened the block
    ("<think>abc", True, ("abc", None)),                    # cut off while thinking
    ("plain", True, ("plain", None)),                       # no end tag: all reasoning (vLLM's rule)
    ("<think></think>", True, (None, None)),
    ("  <think>a</think>b", True, ("a", "b")),
    ("<think>x</think>y", False, (None, "<think>x</think>y")),   # Qwen3 with enable_thinking false
    ("a </thin k> b</think>c", True, ("a </thin k> b", "c")),
])
def test_reasoning_split_whole_and_streamed(text, thinking, want):
    """engine/text/reasoning.py: <think>...</think> apart from the content, vLLM's rule; streamed one
    character at a time (a tag split anywhere) and in one piece, the same split."""
    from engine.text.reasoning import ReasoningStream, split_reasoning, thinks

    assert split_reasoning(text, thinking) == want
    stream, parts = ReasoningStream(thinking), [("", "")]
    parts += [stream.feed(ch) for ch in text] + [stream.finish()]
    joined = tuple("".join(p[i] for p in parts) or None for i in (0, 1))
    assert joined == want
    assert thinks("qwen3", None) and not thinks("qwen3", {"enable_thinking": False})
    assert thinks("deepseek_r1", {"enable_thinking": False})
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        thinks("granite", None)


def test_reasoning_parser_starts_constraints_after_the_thinking(tiny_llama):
    """Under a reasoning parser the ingress makes a request's constraint (response_format here, a
    forced tool choice alike) start after `</think>` (structured_outputs.start_after), as vLLM does;
    not when the template closed the thinking (enable_thinking false), nor with
    serving.structured_outputs_in_reasoning, nor without a parser."""
    import asyncio

    from cluster.config import ClusterConfig
    from router.ingress.preparer import RequestPreparer

    body = {"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_object"}}
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}

    def start_after(serving: dict, data: dict) -> tuple[int, ...]:
        preparer = RequestPreparer(ClusterConfig(model=tiny_llama, serving=serving).ingress_spec())
        params = asyncio.run(preparer.prepare_chat(data)).params
        assert params.structured_outputs.json_object
        return params.structured_outputs.start_after

    preparer = RequestPreparer(ClusterConfig(model=tiny_llama).ingress_spec())
    marker = preparer.think_end_ids
    assert preparer.tokenizer.decode(list(marker)) == "</think>"
    assert start_after({"reasoning_parser": "qwen3"}, body) == marker
    assert start_after({"reasoning_parser": "deepseek_r1"}, off) == marker
    assert start_after({"reasoning_parser": "qwen3"}, off) == ()
    assert start_after({"reasoning_parser": "qwen3", "structured_outputs_in_reasoning": True}, body) == ()
    assert start_after({}, body) == ()
