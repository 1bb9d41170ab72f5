"""The tokens a sampling row keeps (top_k, then top_p on the distribution renormalized over the top
k, then min_p: vLLM's order) and the draw among them, without sorting the vocabulary.

Two paths, chosen per row by its own distribution (so a seeded row draws the same token whatever
else is in the batch):
- a narrow nucleus (the usual row: its cut inside its `widest` most likely tokens, 64 by default)
  is found with one `topk`, and `sample` draws among those candidates with one uniform number,
  inverted through their cumulative mass (`candidates`);
- a wide one (a flat distribution: a high temperature, a model with random weights, a large
  top_k; or no filter at all) is drawn by rejection (`draw_wide`): a token drawn from the
  distribution cut below by top_k and min_p is kept if top_p keeps it, and otherwise every token
  no more likely than it is excluded and the row draws again. Exact in distribution; one round
  for most rows, since the first draw lands in the nucleus with probability at least top_p.
  Before it, such rows went on to topk with k = 512, 4,096, 32,768 and the whole vocabulary:
  121 ms for 32 rows of a 49k vocabulary at top_p 0.95 on 2 threads, where the decode step takes
  20 ms (docs/perf/journal.md §65).

Tie rule: the narrow path keeps the smallest prefix of the sorted tokens whose mass reaches top_p
(`filtered_probs`, the reference, as vLLM); the wide path keeps a token when the tokens strictly
more likely than it hold less than top_p, so tokens tied with the last one kept are kept too (bf16
logits tie often in a flat tail). Both keep exactly top_k tokens.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.dispatch import kernels_for
from records.sampling_params import SamplingParams


class Candidates(NamedTuple):
    """Each narrow row's most likely tokens in descending order: probabilities [R, k], zero where
    not kept (not renormalized: the draw scales by their sum); token ids [R, k]; how many of its
    first k are kept [R] (0 for a wide row). `wide`: the rows left to `draw_wide`, ascending, and
    `logits`: every row's scaled logits, whose softmax `wide_probs` makes for the wide rows."""
    vals: torch.Tensor
    ids: torch.Tensor
    sizes: torch.Tensor
    wide: torch.Tensor
    logits: torch.Tensor

    def wide_probs(self) -> torch.Tensor:
        """The wide rows' softmax [W, vocab] (no narrow row's is ever made)."""
        return select_rows(self.logits, self.wide).softmax(dim=-1)


def candidates(logits: torch.Tensor, params: list[SamplingParams], widest: int = 64) -> Candidates:
    """What `filtered_probs` keeps, for the rows whose cut is known to fall within their `widest`
    most likely tokens (one topk); the others, and rows without any filter, are left `wide`. A
    row's order and count depend on the row alone."""
    (rows, vocab), device = logits.shape, logits.device
    top_k, top_p, min_p = filters(params, vocab, logits.dtype, device)
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, vals, ids, kept)
    # Rows without a filter keep every token: drawn as wide ones, in one round (a [rows, vocab]
    # float64 cumsum for them cost ~1.2 ms at 32 rows of 49k, and widened every row's candidates).
    # (Decided from the params, on the host: no device sync.)
    unfiltered = [not _filters_any(p, vocab) for p in params]
    pending = torch.tensor([i for i, u in enumerate(unfiltered) if not u], dtype=torch.long, device=device)
    wide = [torch.tensor([i for i, u in enumerate(unfiltered) if u], dtype=torch.long, device=device)]
    if len(pending):
        k = min(widest, vocab)
        # The k most likely as probabilities, descending; the C++ kernel set makes no [rows, vocab]
        # softmax for them (kernels/csrc/sampling.cpp: 0.6 against 1.2-1.4 ms at 32 x 49k).
        vals, ids = kernels_for(logits).softmax_topk(select_rows(logits, pending), k)
        tk, tp, mp = top_k[pending], top_p[pending], min_p[pending]
        in_k = torch.arange(k, device=device)[None, :] < tk[:, None]
        # The top-k mass, for top_p's renormalization: exact once top_k <= k; 1 without a top_k.
        mass_k = torch.where(tk <= k, (vals * in_k).sum(dim=-1), 1.0)
        mass_before = vals.cumsum(dim=-1) - vals
        keep = (in_k & ((mass_before < (tp * mass_k)[:, None]) | (tp >= 1)[:, None])
                & (vals >= (mp * vals[:, 0])[:, None]))
        # Known to end inside the first k: within its top_k; or, with no top_k, past top_p's mass;
        # or below min_p's threshold at the k-th token, where no top_p needs a larger top_k's mass.
        no_top_k = tk == vocab
        ends = ((tk <= k) | (no_top_k & (tp < 1) & (vals.sum(dim=-1) >= tp))
                | ((vals[:, -1] < mp * vals[:, 0]) & (no_top_k | (tp >= 1))) | (k == vocab))
        found.append((pending[ends], vals[ends] * keep[ends], ids[ends], keep[ends].sum(dim=-1)))
        wide.append(pending[~ends])
    wide_rows = torch.cat(wide).sort().values if len(wide) > 1 else wide[0]
    if not len(wide_rows) and len(found[0][0]) == rows:    # every row found at once (the usual batch)
        return Candidates(found[0][1], found[0][2], found[0][3], wide_rows, logits)
    width = max([1] + [v.shape[1] for _, v, _, _ in found])
    out_vals = torch.zeros(rows, width, dtype=logits.dtype, device=device)
    out_ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    sizes = torch.zeros(rows, dtype=torch.long, device=device)
    for where, vals, ids, kept in found:
        out_vals[where, :vals.shape[1]] = vals
        out_ids[where, :ids.shape[1]] = ids
        sizes[where] = kept
    return Candidates(out_vals, out_ids, sizes, wide_rows, logits)


def draw_wide(probs: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor) -> torch.Tensor:
    """A token id for each row of `probs` ([W, vocab], rows that sum to 1, each with its params)
    within its nucleus, distributed as the nucleus' renormalized probabilities. `uniform` [W]
    (float64, in [0, 1)) is each row's draw, its only one: a row drawn again reuses where its
    number fell inside the rejected token's share of the mass, itself uniform and independent of
    which token it fell on (so a seeded request still takes one number a token from its generator,
    what a resumed stream counts on: model_runner._sampling_row).

    A draw is among the row's k most likely tokens (top_k) at least as likely as min_p * its most
    likely; top_p keeps it when the tokens strictly more likely hold less than top_p of the top k's
    mass. A rejected token and every token no more likely leave the row's draws; the most likely
    token is always kept, so each row ends. A row with no finite mass (its scaled logits
    overflowed) gets -1."""
    (width, vocab), device = probs.shape, probs.device
    _, top_p, min_p = filters(params, vocab, probs.dtype, device)
    # Drawn from: tokens with p >= low (0: every token, no mask to make) within the top k. (What
    # each row asks is read from its params on the host: no device sync for it.)
    low = min_p * probs.amax(dim=-1) if any(p.min_p > 0 for p in params) else torch.zeros_like(min_p)
    mass_k = torch.ones(width, dtype=probs.dtype, device=device)
    by_k: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        if 0 < p.top_k < vocab:
            by_k.setdefault(p.top_k, []).append(i)
    if by_k:
        probs = probs.clone()       # the rows with a top_k: zero outside it
    for k, members in by_k.items():
        # Exactly k tokens, as the sort keeps them (tied ones as topk picks them): an unsorted topk
        # from the nearer end (kthvalue: ~7 ms at 32 x 49k, whatever k).
        where = torch.tensor(members, dtype=torch.long, device=device)
        sub = probs[where]
        if 2 * k <= vocab:
            vals, ids = sub.topk(k, dim=-1, sorted=False)
            probs[where] = torch.zeros_like(sub).scatter_(1, ids, vals)
            mass_k[where] = vals.sum(dim=-1)
        else:
            ids = sub.topk(vocab - k, dim=-1, largest=False, sorted=False).indices
            probs[where] = sub.scatter_(1, ids, 0.0)
            mass_k[where] = sub.sum(dim=-1)
    out = torch.empty(width, dtype=torch.long, device=device)
    pending = torch.arange(width, device=device)
    while len(pending):
        p, lows = select_rows(probs, pending), low[pending]
        token, total, uniform = _inverse_cdf(p * (p >= lows[:, None]) if bool((lows > 0).any()) else p, uniform)
        p_token = p.gather(1, token[:, None]).squeeze(1)
        tp = top_p[pending]
        kept = tp >= 1
        if not bool(kept.all()):
            kept |= (p * (p > p_token[:, None])).sum(dim=-1) < tp * mass_k[pending]
        lost = ~(torch.isfinite(total) & (total > 0))   # overflowed logits: no distribution to draw from
        done = kept | lost
        out[pending[done]] = torch.where(lost, -1, token)[done]
        # Rejected: the token and all no more likely are outside the nucleus (its cut is monotone).
        low[pending[~done]] = torch.nextafter(p_token[~done], torch.tensor(float("inf"), dtype=p.dtype,
                                                                          device=device))
        pending, uniform = pending[~done], uniform[~done]
    return out


_BLOCK = 256        # the inverse CDF's two levels: block sums, then one block's running sum


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(for each row of `weights` [R, V] >= 0, the first index where its running sum passes uniform *
    its total; that total (float64); where the target fell inside that index's weight, in [0, 1)):
    the draw that a float64 cumsum of the whole row would give, from the sums of blocks of _BLOCK
    entries and the running sum of one block (a whole row's float64 cumsum cost 1.6 ms at 32 rows
    of 49k, with its cast, against ~0.3)."""
    (rows, vocab), device = weights.shape, weights.device
    whole = vocab // _BLOCK * _BLOCK
    sums = weights[:, :whole].reshape(rows, -1, _BLOCK).sum(dim=-1, dtype=torch.float64)
    if whole < vocab:
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True, dtype=torch.float64)], dim=1)
    running = sums.cumsum(dim=-1)
    total = running[:, -1]
    target = (uniform * total)[:, None]
    block = torch.searchsorted(running, target, right=True).clamp(max=sums.shape[1] - 1)
    before = torch.where(block > 0, running.gather(1, (block - 1).clamp(min=0)), 0.0)
    index = (block * _BLOCK + torch.arange(_BLOCK, device=device)[None, :]).clamp(max=vocab - 1)
    inside = weights.gather(1, index)
    inside = torch.where(index >= block * _BLOCK + (vocab - block * _BLOCK).clamp(max=_BLOCK), 0.0, inside)
    running_inside = inside.cumsum(dim=-1, dtype=torch.float64)
    steps = torch.searchsorted(running_inside, target - before, right=True)
    # Rounding may put the target past the block's own running sum: its last entry with weight.
    last = _BLOCK - 1 - (inside > 0).flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)
    step = torch.minimum(steps, last)
    weight = inside.gather(1, step).double()
    fraction = (target - before - running_inside.gather(1, step) + weight) / weight
    return index.gather(1, step).squeeze(1), total, fraction.squeeze(1).clamp(0.0, 1.0 - 2.0 ** -53)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after top_k, top_p and min_p filtering (rows without them pass through): the
    reference, by a sort of the whole vocabulary."""
    vocab, device = logits.shape[-1], logits.device
    top_k, top_p, min_p = filters(params, vocab, logits.dtype, device)
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if bool((min_p > 0).any()):
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def filters(params: list[SamplingParams], vocab: int, dtype: torch.dtype, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's (top_k, with `vocab` for none; top_p; min_p) as tensors on `device`."""
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=dtype, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=dtype, device=device)
    return top_k, top_p, min_p


def _filters_any(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0


def select_rows(x: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """x[which], without the copy where `which` (ascending, as nonzero() gives) is every row."""
    return x if len(which) == x.shape[0] else x[which]
