"""OpenAI request models (pydantic) and the conversion to SamplingParams; response shapes as dicts.

Unknown fields are rejected (400 naming the field) rather than silently ignored, except the few that
OpenAI clients send and that change nothing here (`user`, `stream_options` without usage, ...).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    # extras (vLLM's names)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    priority: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def sampling_kwargs(self) -> dict[str, Any]:
        return dict(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    min_p=self.min_p, seed=self.seed, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                    max_tokens=self.max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                    stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, priority=self.priority,
                    skip_special_tokens=self.skip_special_tokens,
                    include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    max_tokens: int | None = Field(16, ge=1)

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling_kwargs(), logprobs=self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)

    def to_sampling_params(self) -> SamplingParams:
        kwargs = self.sampling_kwargs()
        if self.max_completion_tokens is not None:
            kwargs["max_tokens"] = self.max_completion_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return SamplingParams(**kwargs, logprobs=logprobs)

    def plain_messages(self) -> list[dict[str, str]]:
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):      # [{"type": "text", "text": ...}, ...]
                parts = []
                for part in content:
                    if part.get("type") != "text":
                        raise ValueError(f"messages content part type must be 'text'; got {part.get('type')!r}")
                    parts.append(str(part.get("text", "")))
                content = "".join(parts)
            out.append({"role": m.role, "content": content or ""})
        return out


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """(message naming the field and what is allowed, the field's dotted path) for a 400."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if not isinstance(p, int)) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = "unknown field"
    got = first.get("input")
    shown = "" if first.get("type") in ("missing", "extra_forbidden") else f"; got {got!r}"
    return f"{loc}: {msg}{shown}", loc


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
