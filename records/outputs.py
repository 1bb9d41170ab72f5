"""What an engine returns to its user (vLLM's shapes): `RequestOutput`, its `CompletionOutput`s (one
per choice) and their `Logprob`s."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from records.errors import RequestFailedError


# --- engine -> user (vLLM's shapes) ----------------------------------------------------------------
@dataclass(slots=True)
class Logprob:
    """One token's log probability. Wherever a dict {token id: Logprob} stands for one position's
    logprobs, it is ranked: most likely first (engine/output_processor.py builds every one), so
    that what serves it (the HTTP and gRPC APIs) takes its order as it comes."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # finish_reason "error": what failed, when the engine knows better than RequestFailedError
    # (a KV pull: KVTransferError); stop_reason then holds its message.
    error: Exception | None = None
    # The weights that produced its tokens: (first token index, version) per range (more than one
    # where a weight update came while it ran: engine/weight_updates.py)
    weight_versions: list[tuple[int, str]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    # Set on a prefill for a remote decode: what to pass the decode engine (kv_transfer/base.py).
    kv_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    embedding: list[float] | None = None       # an embedding request's pooled vector, once finished
    weight_version: str | None = None          # the weights that produced its latest tokens

    def error(self) -> RequestFailedError | None:
        """The error the request ended with, if one of its choices failed: the engine's own type when
        it gave one (KVTransferError for a pull), else RequestFailedError."""
        failed = next((c for c in self.outputs if c.finish_reason == "error"), None)
        if failed is None:
            return None
        error = type(failed.error) if isinstance(failed.error, RequestFailedError) else RequestFailedError
        return error(f"request {self.request_id!r} failed: {failed.stop_reason}")
