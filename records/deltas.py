"""What a replica sends an ingress: per engine step, one `ChannelMessage` with a `StepDelta` for
each of that ingress's requests that advanced (each choice's `ChoiceDelta`: its new tokens, text
and logprobs)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from records.outputs import Logprob, RequestOutput


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice of a request gained in one engine step."""
    index: int
    token_ids: list[int]                      # produced this step
    text: str                                 # text added this step
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class StepDelta:
    """One request's part of an engine step's message to an ingress (cluster/replica.py's output
    channel): each advanced choice's new tokens, text and logprobs, or the error that ended it."""
    request_id: str
    choices: list[ChoiceDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None   # a prefill for a remote decode: pass these on
    error: BaseException | None = None       # the request ended with this (RequestFailedError, ...)
    # Prompt logprobs computed this step (those asked for; the first prompt token's entry is None).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None      # an embedding request's vector, on its last delta
    weight_version: str | None = None         # the weights that produced this step's tokens

    @classmethod
    def failure(cls, request_id: str, error: BaseException) -> StepDelta:
        return cls(request_id, [], True, 0, error=error)

    @classmethod
    def of_output(cls, out: RequestOutput, error: BaseException | None = None) -> StepDelta:
        """The wire form of an engine output of kind "delta" (the choices that advanced, each with
        only what is new); `error`: what ended the request, if it failed."""
        choices = [ChoiceDelta(c.index, c.token_ids, c.text, c.logprobs, c.finish_reason, c.stop_reason)
                   for c in out.outputs]
        return cls(out.request_id, choices, out.finished, len(out.prompt_token_ids), out.num_cached_tokens,
                   dict(out.metrics), out.kv_transfer_params, error, out.prompt_logprobs or None, out.embedding,
                   out.weight_version)


@dataclass(slots=True)
class ChannelMessage:
    """One message on a replica's output channel to an ingress (cluster/replica.py): the deltas of
    that ingress's requests an engine step produced, and, for an ingress that follows the replica's
    KV events, those since the last message (a protobuf `KVEventBatch`: its end cursor and events;
    None when there are none)."""
    deltas: list[StepDelta]
    kv_events: bytes | None = None
