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

from collections import Counter
from dataclasses import replace
from typing import NamedTuple

import torch

from engine.sample.sampler import SamplingRow, sample
from records.step import SampledToken


class Verification(NamedTuple):
    """A request's proposals to verify: its sampling row, its k proposals (its k + 1 logit rows
    follow from them), and how many of them may be accepted (fewer where a grammar allows fewer)."""
    row: SamplingRow
    proposals: list[int]
    allowed: int


def verify(logits: torch.Tensor, requests: list[Verification]) -> list[list[SampledToken] | str]:
    """logits: [sum of (k + 1), vocab] float32 (modified in place), each request's k + 1 rows in
    turn. Returns per request the 1 to allowed + 1 tokens to emit (their logprobs, if asked, the
    target's raw ones), or why it failed (that request only). Every row of every request is drawn
    in one `sample` call (one call a request cost ~1.2 ms at k = 4: 38 ms a step at 32 requests)."""
    rows: list[SamplingRow] = []
    for request in requests:
        row, proposals = request.row, request.proposals
        rows += [replace(row, output_token_ids=row.output_token_ids + proposals[:j]) for j in range(len(proposals) + 1)]
    assert logits.shape[0] == len(rows)
    # A generator only one request draws from (a seeded one's) is rewound afterwards to one number
    # per emitted token; one they share (the runner's, unseeded) has no stream to keep.
    owners = Counter(id(r.row.generator) for r in requests if not r.row.params.is_greedy)
    own = {i: r.row.generator.get_state() for i, r in enumerate(requests)
           if r.row.generator is not None and owners[id(r.row.generator)] == 1 and not r.row.params.is_greedy}
    drawn, failed = sample(logits, rows)
    out: list[list[SampledToken] | str] = []
    first = 0
    for i, request in enumerate(requests):
        span = range(first, first + len(request.proposals) + 1)
        first = span.stop
        why = next((failed[j] for j in span if j in failed), None)
        if why is not None:
            out.append(why)
            continue
        allowed = request.proposals[:request.allowed]
        emitted = len(accept_greedy([drawn[j].token_id for j in span[:len(allowed) + 1]], allowed))
        if i in own:                # one number a token emitted, as without speculation
            request.row.generator.set_state(own[i])
            torch.rand(emitted, generator=request.row.generator, dtype=torch.float64, device="cpu")
        out.append([drawn[j] for j in span[:emitted]])
    return out


def accept_greedy(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The target's tokens (its argmax, or its draws) up to and including its first disagreement
    with the proposals."""
    num_accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids):
        if draft != target:
            break
        num_accepted += 1
    return target_token_ids[:num_accepted + 1]
