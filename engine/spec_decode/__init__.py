"""Speculative decoding: proposers (n-gram lookup, draft model), verification, and its counters.

The flow of one speculative step (vLLM v1's design):

1. After a step, the engine asks the proposer for up to k tokens to follow each running decode
   (`Request.spec_token_ids`; see `max_proposals` for who speculates).
2. The scheduler schedules such a request for 1 + k tokens (its last token and the proposals), all
   counted against the token budget, and allocates their slots. Proposals that do not fit the
   budget, max_model_len or the free blocks are dropped (speculation never preempts).
3. The runner computes logits at all 1 + k positions and `engine.sample.rejection_sampler.verify` emits the
   accepted proposals plus one target token (ModelRunnerOutput.spec_sampled).
4. The scheduler appends the emitted tokens one by one, applying stop tokens, min/max_tokens and
   max_model_len to each, and sets num_computed_tokens back past the rejected proposals: their KV
   sits in slots beyond the computed length, never read, and overwritten when those positions are
   computed again. Blocks are hashed for the prefix cache only over verified tokens (the hashes
   cover `all_token_ids`, which never holds proposals), so no cached block holds a rejected token.
"""
from __future__ import annotations

from collections.abc import Container
from typing import Protocol

from engine.spec_decode.ngram import NgramProposer
from records.config import EngineConfig
from records.request import Request, RequestStatus


class Proposer(Protocol):
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to num_tokens[i] tokens to follow requests[i]'s tokens (possibly none)."""

    def retain(self, request_ids: Container[str]) -> None:
        """Forget the state (and free the KV) of requests not in `request_ids`."""

    def check_no_leaks(self) -> None:
        """AssertionError unless no state is held (once every request is gone)."""


def make_proposer(config: EngineConfig, num_blocks: int) -> Proposer | None:
    """The configured proposer; a draft model gets a KV cache of `num_blocks` blocks. The draft
    model's module is imported only where configured: it needs torch, which a simulated engine's
    process never imports."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    from engine.spec_decode.draft_model import DraftModelProposer  # noqa: PLC0415

    return DraftModelProposer(config, num_blocks)


def max_proposals(request: Request, k: int, max_model_len: int) -> int:
    """How many tokens to propose for `request` now: 0 unless it is a running decode (its next step
    computes exactly its last token); never past max_tokens (the target adds one token of its own)
    or max_model_len. Requests with n > 1 do not speculate (their forked blocks are shared
    copy-on-write; kept simple), nor prefills for a remote decode (max_tokens is 1)."""
    if (request.status != RequestStatus.RUNNING or request.num_tokens_to_compute != 1
            or request.sampling_params.n > 1):
        return 0
    return max(0, min(k, request.max_tokens - request.num_output_tokens - 1,
                      max_model_len - request.num_tokens))
