"""Reading tool calls out of a model's text, whole (`parse_tool_calls`) or as it streams
(`ToolCallStream`), in the formats engine/text/tool_calls.py describes (`FORMATS`), and the records
of a call (`ToolCall`) and of a streamed piece of one (`ToolCallDelta`).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "llama3_json", "mistral")


HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"


PYTHON_TAG = "<|python_tag|>"


MISTRAL_BEGIN = "[TOOL_CALLS]"


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
                text, self.in_call = self._until(HERMES_BEGIN, final)
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
                end = self.buffer.find(HERMES_END)
                if end < 0 and not final:
                    return content, calls
                # The block's end (what follows the arguments is the format's: "}\n").
                self.buffer = "" if end < 0 else self.buffer[end + len(HERMES_END):]
                self.in_call, self.args = False, None
                if end < 0:
                    return content, calls
                continue
            end = self.buffer.find(HERMES_END)
            if end < 0 and not final:
                return content, calls
            block = self.buffer if end < 0 else self.buffer[:end]
            self.buffer = "" if end < 0 else self.buffer[end + len(HERMES_END):]
            self.in_call = False
            try:
                call = _as_call(json.loads(block), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                content += HERMES_BEGIN + block + ("" if end < 0 else HERMES_END)
            else:
                calls.append(self._whole(call))
            if end < 0:
                return content, calls

    def _mistral(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, calls = "", []
        while True:
            if not self.in_call:
                text, self.in_call = self._until(MISTRAL_BEGIN, final)
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
                content += MISTRAL_BEGIN + self.buffer
                self.buffer = ""
                return content, calls
            calls += [self._whole(c.with_short_id()) for c in parsed]   # type: ignore[union-attr]
            self.buffer = body[end:]

    def _llama(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if not self.decided:
            head = self.buffer.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG):].lstrip()
            if not final and PYTHON_TAG.startswith(head):     # nothing yet, or maybe the tag
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


def parse_tool_calls(fmt: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output in format `fmt`, read as the stream reads it: a block
    that does not hold a call is content, as vLLM's parsers leave it."""
    stream = ToolCallStream(fmt)
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
