"""The records of one engine step: what the scheduler hands the model runner (`SchedulerOutput`,
a `ScheduledRequest` per request) and what the runner hands back (`ModelRunnerOutput`, a
`SampledToken` per request)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from records.sampling_params import SamplingParams


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
    # The prompt's images (records/multimodal.py): the runner puts their embeddings in place of the
    # placeholder tokens this chunk computes (engine/worker/encoder_cache.py).
    images: tuple[Any, ...] = ()


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
