"""The parts every response of the HTTP and gRPC APIs is built from: OpenAI's error body, ids and
timestamps, a choice's output accumulated from StepDeltas, and the usage block."""
from __future__ import annotations

import time
import uuid
from typing import Any

from records.deltas import ChoiceDelta, StepDelta
from records.outputs import Logprob


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ChoiceAccumulator:
    """One choice's accumulated output (non-streaming responses)."""

    def __init__(self) -> None:
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # (first token, weight version) per range: more than one where a weight update came mid-way
        self.weight_versions: list[tuple[int, str]] = []

    def add(self, c: ChoiceDelta, weight_version: str | None = None) -> None:
        if weight_version is not None and c.token_ids and (
                not self.weight_versions or self.weight_versions[-1][1] != weight_version):
            self.weight_versions.append((len(self.token_ids), weight_version))
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs or [])
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


class UsageCounter:
    """The usage block of a response, counted from its StepDeltas."""

    def __init__(self) -> None:
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.weight_version: str | None = None      # the weights of the latest tokens

    def add(self, delta: StepDelta) -> None:
        self.completion_tokens += sum(len(c.token_ids) for c in delta.choices)
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        self.weight_version = delta.weight_version or self.weight_version

    def body(self, prompt_tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
