"""Reasoning text: the part of a thinking model's answer between `<think>` and `</think>` (Qwen3,
DeepSeek-R1 and their distills), returned apart from the content as vLLM's reasoning parsers do
(`--reasoning-parser qwen3 | deepseek_r1`: the chat message's `reasoning` field).

Both read the text the same way (vLLM's base rule): a leading `<think>` is dropped; what comes
before `</think>` is reasoning and what follows is content; an answer with no `</think>` is all
reasoning (cut off while thinking), except that "qwen3" with thinking turned off
(`chat_template_kwargs: {"enable_thinking": false}`, which makes Qwen3's template close the
thinking block in the prompt) is all content. `ReasoningStream` does the same on streamed text,
holding back what may be the start of a tag, so a stream and a whole answer split alike.
"""
from __future__ import annotations

from typing import Any

from engine.text.tool_parser import partial_suffix, read_through

PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def thinks(parser: str, template_kwargs: dict[str, Any] | None) -> bool:
    """Whether the answer starts in reasoning: always for DeepSeek-R1; for Qwen3 unless the request
    turned thinking off in its template."""
    if parser not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {PARSERS}; got {parser!r}")
    return parser == "deepseek_r1" or (template_kwargs or {}).get("enable_thinking", True) is not False


class ReasoningStream:
    """Splits streamed text into (reasoning delta, content delta): `feed` each text delta, then
    `finish` once."""

    def __init__(self, thinking: bool = True) -> None:
        self.in_reasoning = thinking
        self.started = False        # past the leading `<think>` (or its absence)
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        return self._read(final=False)

    def finish(self) -> tuple[str, str]:
        return self._read(final=True)

    def _read(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self.in_reasoning and not self.started:
            stripped = self.buffer.lstrip()
            if stripped.startswith(THINK_START):
                self.buffer, self.started = stripped[len(THINK_START):], True
            elif final or not THINK_START.startswith(stripped):
                self.started = True
            else:
                return "", ""       # may still become `<think>`
        if self.in_reasoning:
            end = self.buffer.find(THINK_END)
            if end < 0:
                keep = 0 if final else partial_suffix(self.buffer, THINK_END)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer, self.in_reasoning = self.buffer[:end], self.buffer[end + len(THINK_END):], False
        content, self.buffer = self.buffer, ""
        return reasoning, content


def split_reasoning(text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer, read as the stream reads it; None for an empty part."""
    reasoning, content = read_through(ReasoningStream(thinking), text, final=True)
    return reasoning or None, content or None
