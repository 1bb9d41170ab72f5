"""Verification of proposed tokens against the target's logits, exact by construction.

A request that verifies k proposals gets k + 1 logit rows in one target forward pass: row j scores
the token after proposal j - 1 (row 0 follows the last verified token). Row j is sampled exactly as
the plain sampler would after the output plus proposals[:j] (penalties, min_tokens, temperature,
top_k/top_p/min_p), so the emitted tokens follow the target's distribution:

- greedy: the longest prefix of proposals equal to the target's argmax, then the target's own token;
- random: proposals are deterministic (n-gram lookup, greedy draft), i.e. q is a point mass on d_j,
  so the standard rule min(1, p/q) accepts d_j with probability p_j(d_j); on a rejection the token is
  drawn from p_j with d_j removed and renormalized (the residual max(0, p - q)); after k acceptances a
  bonus token is drawn from p_k. P(emit x) = p(x) for every x, for any proposal.

Draws use the request's own generator when it has a seed (else the runner's).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from engine.sample.nucleus import filtered_probs
from engine.sample.sampler import SamplingRow, apply_penalties_and_masks, greedy_ids, to_sampled
from records.step import SampledToken


def verify(logits: torch.Tensor, row: SamplingRow, draft_token_ids: list[int]) -> list[SampledToken]:
    """logits: [k + 1, vocab] float32 (modified in place) for `row`'s request at its k proposals.
    Returns the 1 to k + 1 tokens to emit; their logprobs (if asked) are the target's raw ones."""
    k = len(draft_token_ids)
    assert logits.shape[0] == k + 1
    params = row.params
    raw_logprobs = torch.log_softmax(logits, dim=-1) if params.logprobs is not None else None
    rows = [replace(row, output_token_ids=row.output_token_ids + draft_token_ids[:j]) for j in range(k + 1)]
    apply_penalties_and_masks(logits, rows)
    if params.is_greedy:
        emitted = accept_greedy(greedy_ids(logits).tolist(), draft_token_ids)
    else:
        probs = filtered_probs(logits / params.temperature, [params] * (k + 1))
        emitted = rejection_sample(probs, draft_token_ids, row.generator)
    return [to_sampled(t, params, None if raw_logprobs is None else raw_logprobs[j])
            for j, t in enumerate(emitted)]


def accept_greedy(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The target's tokens up to and including its first disagreement with the proposals."""
    num_accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids):
        if draft != target:
            break
        num_accepted += 1
    return target_token_ids[:num_accepted + 1]


def rejection_sample(probs: torch.Tensor, draft_token_ids: list[int],
                     generator: torch.Generator | None) -> list[int]:
    """probs: [k + 1, vocab], the target's (filtered) distributions at each position. Accepts
    proposal j with probability probs[j, d_j]; at the first rejection draws from probs[j] without
    d_j; after k acceptances draws a bonus token from probs[k]."""
    k = len(draft_token_ids)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    for j, (draft, u) in enumerate(zip(draft_token_ids, uniforms)):
        if u < probs[j, draft].item():
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0          # its mass is > 0: the proposal was rejected with p(d) < 1
        return draft_token_ids[:j] + [int(torch.multinomial(residual, 1, generator=generator))]
    return draft_token_ids + [int(torch.multinomial(probs[k], 1, generator=generator))]
