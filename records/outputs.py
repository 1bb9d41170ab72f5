"""Records that cross boundaries: scheduler -> runner, runner -> engine, engine -> user, KV events,
and the per-step deltas a replica sends an ingress."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from records.hashing import BlockHash

if TYPE_CHECKING:
    from records.sampling_params import SamplingParams


# --- KV events (engine -> router) ------------------------------------------------------------------
# Where a cached block lives: the engine's block pool, or a copy in its offload tier (host memory,
# local disk: engine/core/kv_tier.py). A router scores a tier hit below a pool hit (a load, not a
# lookup) and above a miss (a load, not a computation).
MEDIA = ("pool", "host", "disk")


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    medium: str = "pool"


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str = "pool"


@dataclass(slots=True)
class AllCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllCleared


# --- scheduler -> model runner ---------------------------------------------------------------------
@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_tokens) get their KV computed."""
    request_id: str
    token_ids: list[int]            # the tokens computed this step
    start: int                      # position of token_ids[0] (= num_computed_tokens before the step)
    block_ids: list[int]            # the request's whole block table
    do_sample: bool                 # this chunk ends at the sequence's last token: sample one
    # Proposed tokens to verify: the last len(spec_token_ids) entries of token_ids (do_sample only).
    spec_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs_from: int | None = None   # compute prompt logprobs for positions >= this
    # The request's sampling state (read by the runner for rows that sample or score the prompt).
    sampling_params: SamplingParams | None = None
    seed: int | None = None         # the request's own random stream (the runner keeps its generator)
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    # Block copies to run before the forward pass, in this order: swap-out (device -> CPU),
    # swap-in (CPU -> device), copy-on-write (device -> device).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)   # freed since the last step
    # The offload tier's orders (engine/core/kv_tier.py): saves of evicted blocks and demotions of
    # host copies to disk run first, in this order (before anything writes a block); loads of tier
    # hits into new blocks run last, after the swaps and copies.
    tier_saves: list[tuple] = field(default_factory=list)
    tier_loads: list[tuple] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_out or self.swap_in or self.copy_blocks or self.tier_saves
                    or self.tier_loads)


# --- model runner -> engine ------------------------------------------------------------------------
@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[str, SampledToken]                                  # request id -> its new token
    # Requests that verified proposed tokens: the tokens they emit, in order (the accepted proposals,
    # then the target's own token at the first rejection or after the last proposal).
    spec_sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # Embedding requests: request id -> (the sum of this step's pooled rows of final hidden states,
    # in float32, on the CPU; how many rows). The scheduler adds them up over the prompt's chunks.
    pooled: dict[str, tuple[Any, int]] = field(default_factory=dict)
    # Requests this step could not serve (their sampling raised, or the whole step did): request id
    # -> why. The scheduler ends them with an error; the other requests of the step go on.
    failed: dict[str, str] = field(default_factory=dict)
    step_error: str | None = None          # set when the whole step raised (every request failed)
    # Offload-tier orders of the step that failed on some rank (SchedulerOutput.tier_saves/loads,
    # as sent): a request whose tier load failed starts over; a failed save's copy is forgotten.
    tier_failed: list[tuple] = field(default_factory=list)

    @classmethod
    def for_failed_step(cls, sched: SchedulerOutput, error: BaseException) -> ModelRunnerOutput:
        """The output of a step that raised: each of its requests failed with the error."""
        reason = f"the engine step failed: {error!r}"
        return cls(sampled={}, failed={s.request_id: reason for s in sched.scheduled}, step_error=reason)


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
                   dict(out.metrics), out.kv_transfer_params, error, out.prompt_logprobs or None, out.embedding)


@dataclass(slots=True)
class ChannelMessage:
    """One message on a replica's output channel to an ingress (cluster/replica.py): the deltas of
    that ingress's requests an engine step produced, and, for an ingress that follows the replica's
    KV events, those since the last message (a protobuf `KVEventBatch`: its end cursor and events;
    None when there are none)."""
    deltas: list[StepDelta]
    kv_events: bytes | None = None
