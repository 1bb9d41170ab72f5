"""Tool calling (OpenAI's `tools`): the tools in the prompt, the grammar that enforces a tool choice,
and the parsers that read tool calls out of the model's text, whole or as it streams.

A model family writes its calls in its own format; two are read here:
- "hermes" (Hermes, Qwen 2.5/3, SmolLM3 and most ChatML fine-tunes): any text, then one or more
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks;
- "llama3_json" (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}`, several
  separated by `;` (after `<|python_tag|>`, a special token the detokenizer drops);
- "mistral" (Mistral 7B v0.3, Nemo, Small 3.1): any text, then `[TOOL_CALLS]` (a special token,
  so the text of such requests keeps special tokens) and a JSON list of `{"name", "arguments"}`;
  call ids are 9 letters and digits, which Mistral's templates insist on when the calls come back.

`ToolFormat.of(tokenizer)` picks the format from the chat template and whether the template
renders tools itself. A template that ignores `tools` (SmolLM2's, the embedded model's) gets them in
a system message in Hermes' words, and the conversation's earlier calls and results as Hermes text,
as llama.cpp's server does for such models; vLLM sends the tools to the template only, where a
template without tool support drops them without a word.

`tool_choice` "required" or a named function is enforced by a grammar: xgrammar's structural tag
for the format (`constraint`), so the output is a well-formed call to an offered tool with
arguments valid under its `parameters` schema. "auto" leaves the model free, except that a tool
declared `strict: true` (OpenAI's promise that arguments follow the schema) puts the same tag on
in its triggered form: text stays free, but a call once begun must be valid.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "llama3_json", "mistral")
# xgrammar's builtin structural tags for each format (xgrammar.builtin_structural_tag).
_XGRAMMAR_MODEL = {"hermes": "qwen_3", "llama3_json": "llama"}
# Runs of whitespace inside constrained arguments: as the json constraint's any_whitespace=False,
# this keeps a small model from running on in blank lines inside a call.
_MAX_WHITESPACE = 1

_HERMES_BEGIN, _HERMES_END = "<tool_call>", "</tool_call>"
_SEPARATOR = {"hermes": "\n", "llama3_json": "; "}     # between parallel calls
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_BEGIN = "[TOOL_CALLS]"
_BEGIN = {"hermes": _HERMES_BEGIN, "mistral": _MISTRAL_BEGIN}   # call tags that may be special tokens

_SYSTEM_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                "<tools>\n{tools}\n</tools>\n\n")
# How a template without tool support is told to call them, in each format's words.
_SYSTEM = {
    "hermes": _SYSTEM_HEAD + (
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'),
    "llama3_json": _SYSTEM_HEAD + (
        "To call a function, respond only with a JSON object in the format "
        '{{"name": <function-name>, "parameters": <args-json-object>}}; separate several with "; ".'),
    "mistral": _SYSTEM_HEAD + (
        "To call functions, respond with [TOOL_CALLS] followed by a JSON list of "
        '{{"name": <function-name>, "arguments": <args-json-object>}} objects.'),
}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text (OpenAI's shape)."""
    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def with_short_id(self) -> ToolCall:
        """The same call with a 9-character id of letters and digits (Mistral's templates refuse any
        other when the call comes back in the conversation)."""
        return ToolCall(self.name, self.arguments, uuid.uuid4().hex[:9])


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the `index`-th call as it streams (OpenAI's `delta.tool_calls` entry): the first
    carries the call's id and name, the next ones more of its arguments' text."""
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def body(self) -> dict[str, Any]:
        function = {"arguments": self.arguments} if self.name is None else {"name": self.name,
                                                                             "arguments": self.arguments}
        head = {} if self.id is None else {"id": self.id, "type": "function"}
        return {"index": self.index, **head, "function": function}


def coalesce(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call joined, so that a chunk carries one entry per call (as OpenAI
    and vLLM stream them: a client that reads each index once would otherwise lose text)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index:
            last = out[-1]
            out[-1] = ToolCallDelta(d.index, last.arguments + d.arguments, last.id or d.id, last.name or d.name)
        else:
            out.append(d)
    return out


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls (`name`, one of FORMATS), whether its chat template renders
    `tools` and tool messages itself (`native`), and whether the call tag is one of the tokenizer's
    special tokens (`special_tag`: then the text must keep special tokens for calls to be read)."""
    name: str
    native: bool
    special_tag: bool = False

    @staticmethod
    def of(tokenizer: Any, override: str | None = None) -> ToolFormat:
        """The format of a tokenizer's chat template; `override` (one of FORMATS) names it instead."""
        template = getattr(tokenizer, "chat_template", None) or ""
        if isinstance(template, dict):           # named templates: "default", "tool_use", ...
            template = " ".join(str(t) for t in template.values())
        native = _renders_tools(tokenizer)
        if override is not None and override not in FORMATS:
            raise ValueError(f"tool_call_parser must be one of {FORMATS}; got {override!r}")
        name = override or "hermes"
        if override is None and native and _HERMES_BEGIN not in template:
            if _MISTRAL_BEGIN in template:
                name = "mistral"
            elif _PYTHON_TAG in template or "ipython" in template:
                name = "llama3_json"
        special = name in _BEGIN and _BEGIN[name] in (getattr(tokenizer, "all_special_tokens", None) or ())
        return ToolFormat(name, native, special)

    # --- prompt ------------------------------------------------------------------------------------
    def template_inputs(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) for the chat template. A native template gets the tools and the calls'
        arguments as objects (what the templates index into); any other gets the tools in a system
        message and the calls and results as text in this format (results in Hermes'
        `<tool_response>` tags)."""
        if self.native:
            return [_arguments_as_objects(m) for m in messages], tools or None
        out: list[dict[str, Any]] = []
        for m in messages:
            role, content = m.get("role"), m.get("content") or ""
            if role == "assistant" and m.get("tool_calls"):
                calls = self._calls_text(m["tool_calls"])
                out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
            elif role == "tool":
                response = f"<tool_response>\n{content}\n</tool_response>"
                if out and out[-1].get("tool_results"):      # consecutive results: one user turn
                    out[-1]["content"] += "\n" + response
                else:
                    out.append({"role": "user", "content": response, "tool_results": True})
            else:
                out.append({"role": role, "content": content})
        for m in out:
            m.pop("tool_results", None)
        if tools:
            system = _SYSTEM[self.name].format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
            if out and out[0]["role"] in ("system", "developer"):
                out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{system}"}
            else:
                out.insert(0, {"role": "system", "content": system})
        return out, None

    def _calls_text(self, calls: list[dict[str, Any]]) -> str:
        """Earlier calls as the model would have written them."""
        objects = [_call_object(c) for c in calls]
        if self.name == "hermes":
            return "\n".join(f"{_HERMES_BEGIN}\n{json.dumps(o, ensure_ascii=False)}\n{_HERMES_END}" for o in objects)
        if self.name == "mistral":
            return _MISTRAL_BEGIN + json.dumps(objects, ensure_ascii=False)
        return "; ".join(json.dumps({"name": o["name"], "parameters": o["arguments"]}, ensure_ascii=False)
                         for o in objects)

    # --- grammar -----------------------------------------------------------------------------------
    def constraint(self, tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool
                   ) -> str | None:
        """The xgrammar structural tag (JSON text) that enforces `tool_choice` over `tools`: None
        when nothing is enforced ("none", or "auto" without a strict tool). ValueError when
        tool_choice names no offered tool."""
        from xgrammar.builtin_structural_tag import get_model_structural_tag  # noqa: PLC0415
        from xgrammar.structural_tag import TagsWithSeparatorFormat, TriggeredTagsFormat  # noqa: PLC0415

        if tool_choice == "none" or not tools:
            return None
        if tool_choice in (None, "auto") and not any(t["function"].get("strict") for t in tools):
            return None
        if self.name == "mistral":
            return _mistral_tag(tools, tool_choice or "auto", parallel_tool_calls)
        tag = get_model_structural_tag(_XGRAMMAR_MODEL[self.name], tools, tool_choice or "auto",
                                       reasoning="disabled", max_whitespace_cnt=_MAX_WHITESPACE,
                                       parallel_tool_calls=parallel_tool_calls)
        if tool_choice == "required" and isinstance(tag.format, TriggeredTagsFormat):
            # xgrammar's "required" lets text follow the calls; OpenAI's answers with calls only
            # (content null), so only calls and the format's separator between them here.
            tag.format = TagsWithSeparatorFormat(tags=tag.format.tags, separator=_SEPARATOR[self.name],
                                                 at_least_one=True, stop_after_first=not parallel_tool_calls)
        return tag.model_dump_json()

    # --- parsing -----------------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output, read as the stream reads it: a block that does not
        hold a call is content, as vLLM's parsers leave it."""
        stream = ToolCallStream(self.name)
        content, deltas = stream.feed(text)
        more_content, more_deltas = stream.finish()
        content += more_content
        calls: list[ToolCall] = []
        for d in deltas + more_deltas:
            if d.id is not None:
                calls.append(ToolCall(d.name or "", d.arguments, d.id))
            else:
                calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + d.arguments, calls[-1].id)
        return (content if content else None), calls


def _mistral_tag(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> str:
    """The structural tag for Mistral's `[TOOL_CALLS][{"name", "arguments"}, ...]` (xgrammar has
    none built in): the list's items are calls to the offered tools (to the named one only when
    forced), at most one with parallel_tool_calls off."""
    from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat, TriggeredTagsFormat  # noqa: PLC0415

    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    items = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        "arguments": f["parameters"] if f.get("parameters") is not None and f.get("strict") is not False
        else {"type": "object"}}, "required": ["name", "arguments"], "additionalProperties": False}
        for f in functions]
    calls: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel or isinstance(tool_choice, dict):
        calls["maxItems"] = 1
    content = JSONSchemaFormat(json_schema=calls, max_whitespace_cnt=_MAX_WHITESPACE)
    tag = TagFormat(begin=_MISTRAL_BEGIN, content=content, end="")
    if tool_choice == "auto":
        return StructuralTag(format=TriggeredTagsFormat(triggers=[_MISTRAL_BEGIN], tags=[tag])).model_dump_json()
    return StructuralTag(format=tag).model_dump_json()


def _renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template puts `tools` in the prompt (it renders differently with one)."""
    probe = [{"type": "function", "function": {"name": "probe_tool_x", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(messages, tools=probe, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        return False
    return plain != with_tools


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose tool calls' `arguments` (JSON text in OpenAI's shape) are objects: the
    templates render them with `tojson` or iterate over them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for c in calls:
        function = dict(c.get("function") or {})
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                function["arguments"] = json.loads(args)
            except ValueError:
                pass                         # left as the text it is
        converted.append({**c, "function": function})
    return {**message, "tool_calls": converted}


def _call_object(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"name": function.get("name"), "arguments": args}


def _as_call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A decoded {"name": ..., "arguments"/"parameters": {...}} as a ToolCall, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):                    # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_DECODER = json.JSONDecoder()
_SEPARATORS = re.compile(r"[\s;]*")
# A Hermes call's beginning up to its arguments object: from here its arguments stream as written.
_HERMES_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.:-]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class ToolCallStream:
    """Reads tool calls out of text as it streams: `feed` each text delta, then `finish` once; each
    returns (content delta, call deltas). Text that may begin a call is held back until it is known
    not to (a prefix of `<tool_call>`). A Hermes call that begins `{"name": ..., "arguments": {`
    goes out as soon as that is read, then its arguments as they are written (OpenAI's streaming);
    any other call goes out whole once complete (its closing tag, or its JSON in the Llama and
    Mistral formats). A block that does not hold a call goes out as content. The arguments are the
    model's own text: a call cut off by max_tokens keeps what it had."""

    def __init__(self, fmt: str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"tool call format must be one of {FORMATS}; got {fmt!r}")
        self.fmt = fmt
        self.buffer = ""          # text not yet given out
        self.in_call = False      # hermes: inside a <tool_call> block; llama3_json: the answer is calls
        self.decided = False      # llama3_json: whether the answer's first character was seen
        self.calls = 0            # calls begun: the next one's index
        self.args: _JsonScan | None = None   # hermes: the streaming call's arguments, once its header was read

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        return self._read(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self._read(final=True)

    def _whole(self, call: ToolCall) -> ToolCallDelta:
        self.calls += 1
        return ToolCallDelta(self.calls - 1, call.arguments, call.id, call.name)

    def _read(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if self.fmt == "hermes":
            return self._hermes(final)
        if self.fmt == "mistral":
            return self._mistral(final)
        return self._llama(final)

    def _content(self, text: str) -> str:
        # Whitespace around and between calls is the format's, not the answer's.
        return "" if self.calls and not text.strip() else text

    def _until(self, tag: str, final: bool) -> tuple[str, bool]:
        """(content before the call tag, whether the tag came: the buffer then holds what follows
        it). Text that may be the tag's beginning is held back unless `final`."""
        start = self.buffer.find(tag)
        if start < 0:
            keep = 0 if final else partial_suffix(self.buffer, tag)
            content = self._content(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return content, False
        content = self._content(self.buffer[:start])
        self.buffer = self.buffer[start + len(tag):]
        return content, True

    def _hermes(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, calls = "", []
        while True:
            if not self.in_call:
                text, self.in_call = self._until(_HERMES_BEGIN, final)
                content += text
                if not self.in_call:
                    return content, calls
            if self.args is None and (header := _HERMES_HEADER.match(self.buffer)) is not None:
                call = ToolCall(header.group(1), "")
                calls.append(self._whole(call))
                self.buffer, self.args = self.buffer[header.end():], _JsonScan()
            if self.args is not None:
                if not self.args.done:           # more of the arguments, as far as they go
                    n = self.args.advance(self.buffer)
                    if n:
                        calls.append(ToolCallDelta(self.calls - 1, self.buffer[:n]))
                        self.buffer = self.buffer[n:]
                end = self.buffer.find(_HERMES_END)
                if end < 0 and not final:
                    return content, calls
                # The block's end (what follows the arguments is the format's: "}\n").
                self.buffer = "" if end < 0 else self.buffer[end + len(_HERMES_END):]
                self.in_call, self.args = False, None
                if end < 0:
                    return content, calls
                continue
            end = self.buffer.find(_HERMES_END)
            if end < 0 and not final:
                return content, calls
            block = self.buffer if end < 0 else self.buffer[:end]
            self.buffer = "" if end < 0 else self.buffer[end + len(_HERMES_END):]
            self.in_call = False
            try:
                call = _as_call(json.loads(block), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                content += _HERMES_BEGIN + block + ("" if end < 0 else _HERMES_END)
            else:
                calls.append(self._whole(call))
            if end < 0:
                return content, calls

    def _mistral(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, calls = "", []
        while True:
            if not self.in_call:
                text, self.in_call = self._until(_MISTRAL_BEGIN, final)
                content += text
                if not self.in_call:
                    return content, calls
            body = self.buffer.lstrip()
            if not body and not final:
                return content, calls
            obj, end = None, 0
            if body[:1] in ("[", "{"):           # a list of calls (or one call)
                try:
                    obj, end = _DECODER.raw_decode(body)
                except ValueError:
                    if not final:
                        return content, calls
            items = obj if isinstance(obj, list) else [obj]
            parsed = [_as_call(item, ("arguments", "parameters")) for item in items]
            self.in_call = False
            if not parsed or None in parsed:       # not calls: the tag and the rest are text
                content += _MISTRAL_BEGIN + self.buffer
                self.buffer = ""
                return content, calls
            calls += [self._whole(c.with_short_id()) for c in parsed]   # type: ignore[union-attr]
            self.buffer = body[end:]

    def _llama(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if not self.decided:
            head = self.buffer.lstrip()
            if head.startswith(_PYTHON_TAG):
                head = head[len(_PYTHON_TAG):].lstrip()
            if not final and _PYTHON_TAG.startswith(head):     # nothing yet, or maybe the tag
                return "", []
            self.decided, self.in_call = True, head.startswith("{")
            if self.in_call:
                self.buffer = head
        if not self.in_call:
            content, self.buffer = self.buffer, ""
            return content, []
        calls = []
        while True:
            self.buffer = self.buffer[_SEPARATORS.match(self.buffer).end():]
            if not self.buffer:
                return "", calls
            try:
                obj, end = _DECODER.raw_decode(self.buffer)
            except ValueError:
                if not final:
                    return "", calls
                obj, end = None, 0
            call = _as_call(obj, ("parameters", "arguments"))
            if call is None:              # not a call: the rest is the answer's text
                self.in_call = False
                content, self.buffer = self.buffer, ""
                return content, calls
            calls.append(self._whole(call))
            self.buffer = self.buffer[end:]


class _JsonScan:
    """Follows a JSON object as its text arrives: where it ends (its closing brace at depth 0), or
    where it stops being JSON, at a `<` outside any string (a closing tag before the object closed)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False
        self.done = False

    def advance(self, text: str) -> int:
        """How many characters of `text` (what follows the part already scanned) belong to the object."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
            elif ch == "<":
                self.done = True
                return i
        return len(text)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def read_through(stream: Any, text: str, final: bool) -> tuple[Any, Any]:
    """`stream.feed(text)` (a ToolCallStream or a ReasoningStream: two parts back), and when `final`
    its `finish()` too, each part of the two joined."""
    first, second = stream.feed(text)
    if not final:
        return first, second
    more_first, more_second = stream.finish()
    return first + more_first, second + more_second
