"""Verification of proposed tokens against the target's logits, exact by construction.

A request that verifies k proposals gets k + 1 logit rows in one target forward pass: row j scores
the token after proposal j - 1 (row 0 follows the last verified token). Row j is sampled exactly as
the plain sampler would after the output plus proposals[:j] (penalties, min_tokens, temperature,
top_k/top_p/min_p), so the emitted tokens follow the target's distribution:

- greedy: the longest prefix of proposals equal to the target's argmax, then the target's own token;
- random: proposals are deterministic (n-gram lookup, greedy draft), i.e. q is a point mass on d_j,
  so the standard rule min(1, p/q) accepts d_j with probability p_j(d_j), and on a rejection draws
  from p_j with d_j removed and renormalized (the residual max(0, p - q)); after k acceptances a
  bonus token is drawn from p_k. Drawing x_j from p_j and accepting when x_j = d_j is that rule:
  it accepts with probability p_j(d_j), and a rejected draw is distributed as p_j without d_j,
  renormalized. So each position is sampled as the plain sampler samples it (`sample`, no sort of
  the vocabulary for top_p) and the emitted tokens are the drafts up to the first draw that
  differs, then that draw: `accept_greedy` over the draws. P(emit x) = p(x) for every x, for any
  proposal. (A sort of the vocabulary per request for top_p took ~7 ms at k = 4 and 49k tokens.)
  The generator is then rewound to one number per emitted token, so that token i takes the i-th
  number of the request's stream with speculation or without: a seeded request samples the same
  tokens either way (up to the verification's logits rounding apart from a decode step's), and a
  stream resumed on another replica (one number skipped per sent token) goes on where it was.

Draws use the request's own generator when it has a seed (else the runner's).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from engine.sample.sampler import SamplingRow, apply_penalties_and_masks, greedy_ids, sample, to_sampled
from records.step import SampledToken


def verify(logits: torch.Tensor, row: SamplingRow, draft_token_ids: list[int]) -> list[SampledToken]:
    """logits: [k + 1, vocab] float32 (modified in place) for `row`'s request at its k proposals.
    Returns the 1 to k + 1 tokens to emit; their logprobs (if asked) are the target's raw ones."""
    k = len(draft_token_ids)
    assert logits.shape[0] == k + 1
    params = row.params
    rows = [replace(row, output_token_ids=row.output_token_ids + draft_token_ids[:j]) for j in range(k + 1)]
    if not params.is_greedy:        # each position drawn in order from the request's generator
        generator = row.generator
        state = generator.get_state() if generator is not None else None
        drawn, failed = sample(logits, rows)
        if failed:
            raise RuntimeError(next(iter(failed.values())))
        emitted = accept_greedy([t.token_id for t in drawn], draft_token_ids)
        if generator is not None:   # one number a token emitted, as without speculation: rewound past the rest
            generator.set_state(state)
            torch.rand(len(emitted), generator=generator, dtype=torch.float64, device="cpu")
        return drawn[:len(emitted)]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if params.logprobs is not None else None
    apply_penalties_and_masks(logits, rows)
    emitted = accept_greedy(greedy_ids(logits).tolist(), draft_token_ids)
    return [to_sampled(t, params, None if raw_logprobs is None else raw_logprobs[j])
            for j, t in enumerate(emitted)]


def accept_greedy(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The target's tokens (its argmax, or its draws) up to and including its first disagreement
    with the proposals."""
    num_accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids):
        if draft != target:
            break
        num_accepted += 1
    return target_token_ids[:num_accepted + 1]
