"""Sampler: logits of the rows that sample this step -> one token each, plus logprobs.

Per row, in order: penalties (repetition over prompt + output, presence/frequency over output),
logit_bias, min_tokens (EOS and stop tokens masked), then greedy argmax, or temperature -> top_k
-> top_p -> min_p -> a draw among the kept candidates (`candidates`: no sort of the whole
vocabulary; one uniform number per row, inverted through their cumulative mass). A row with a
seed draws from its own torch.Generator, so its tokens do not depend on what else is in the batch.
Logprobs are the model's raw log-softmax (before penalties and temperature), as vLLM reports them.

Device: everything runs where the logits are (a GPU's logits are never copied whole to the host:
on an H200, an 8B model's sampled step at batch 32 took 133 ms with the softmax and top-k on the
host against 8.5 ms greedy, journal §62); only the seeded draws (one number per row, from the
row's CPU generator) are made on the host and moved.

Isolation: the steps that read one row's own data (min_tokens masks, its draw) run row by row, and
a row whose step raises is reported failed (`sample`'s second result) without touching the others'
logits or generators, so one request's bad state never costs its neighbours a token or changes
their seeded draws. Penalties (engine/sample/penalties.py) and logprob records are computed for the
batch at once; if that raises, they are redone row by row, which isolates the failing row the same
way. SamplingParams' validation makes this a last line of defence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.penalties import TokenCounts, apply_penalties
from kernels.dispatch import kernels_for
from records.sampling_params import SamplingParams
from records.step import SampledToken


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    key: str = ""               # the request's id: its entry in TokenCounts


def sample(logits: torch.Tensor, rows: list[SamplingRow], counts: TokenCounts | None = None
           ) -> tuple[list[SampledToken | None], dict[int, str]]:
    """logits: [num_rows, vocab] float32 (modified in place). Returns one token per row (None for a
    failed row) and the failed rows: row index -> why. With `counts` (kept by the caller across
    steps, rows keyed by request), penalties are applied to the batch at once."""
    failed: dict[int, str] = {}
    # The model's own log-softmax (before penalties and temperature), only for rows that ask.
    device = logits.device
    lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits[torch.tensor(lp_rows, device=device)], dim=-1) if lp_rows else None
    batched = _batched_penalties(logits, rows, counts) if counts is not None else set()
    apply_penalties_and_masks(logits, rows, failed, skip_penalties=batched)

    token_ids = greedy_ids(logits)
    random_idx = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if random_idx:
        idx = torch.tensor(random_idx, device=device)
        temps = torch.tensor([rows[i].params.temperature for i in random_idx], dtype=logits.dtype, device=device)
        # Every row sampling (the usual batch): scaled in place, without a [rows, vocab] gather (one
        # cost ~0.7 ms at 32 rows of a 49k vocabulary on 2 threads).
        scaled = _rows(logits, idx)
        probs, cand_ids, size_t = candidates(scaled.div_(temps[:, None]), [rows[i].params for i in random_idx])
        # One uniform draw per row, from the row's own generator, inverted through its candidates'
        # cumulative mass (a draw of exponential noise per vocabulary entry cost 0.8 ms a row).
        uniform = torch.zeros(len(random_idx), dtype=torch.float64, device="cpu")
        for j, i in enumerate(random_idx):
            if i not in failed:
                _guard(failed, i, "drawing a token",
                       lambda: uniform.__setitem__(j, torch.rand((), generator=rows[i].generator, dtype=torch.float64,
                                                                  device="cpu")))
        uniform = uniform.to(device)
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        target = (uniform * cdf[:, -1])[:, None]
        chosen = torch.minimum(torch.searchsorted(cdf, target, right=True).squeeze(1), size_t - 1)
        drawn = cand_ids.gather(1, chosen.clamp(min=0)[:, None]).squeeze(1)
        # A row with no candidate or no finite mass has no distribution left (its scaled logits
        # overflowed: a tiny temperature or an extreme repetition penalty made them inf, the
        # softmax NaN): it keeps its most likely token, the limit of sampling as T goes to 0.
        mass = cdf[:, -1]
        token_ids[idx] = torch.where((size_t > 0) & torch.isfinite(mass) & (mass > 0), drawn, token_ids[idx])

    token_list = token_ids.tolist()
    records = {} if raw_logprobs is None else _logprob_records(raw_logprobs, lp_rows, token_list, rows, failed)
    out: list[SampledToken | None] = []
    for i, token_id in enumerate(token_list):
        out.append(None if i in failed else records.get(i) or SampledToken(token_id))
    return out, failed


def _logprob_records(raw: torch.Tensor, lp_rows: list[int], token_list: list[int], rows: list[SamplingRow],
                     failed: dict[int, str]) -> dict[int, SampledToken]:
    """The sampled tokens of the rows that want logprobs (`raw`: their log-softmax rows), with the
    token's logprob, its rank and the top-N, for all of them at once (per row, a rank and a top-k
    over the vocabulary cost about 0.1 ms each). If that raises, row by row, isolating the failure."""
    try:
        chosen_ids = torch.tensor([token_list[i] for i in lp_rows], device=raw.device)[:, None]
        chosen = raw.gather(1, chosen_ids)
        ranks = ((raw > chosen).sum(dim=1) + 1).tolist()
        k = max(rows[i].params.logprobs for i in lp_rows)
        top_v, top_i = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
        top_v, top_i, chosen_list = top_v.tolist(), top_i.tolist(), chosen.squeeze(1).tolist()
    except Exception:  # noqa: BLE001 - the per-row path reports the row that fails
        return {i: r for j, i in enumerate(lp_rows) if i not in failed and (r := _guard(
            failed, i, "computing logprobs", lambda: to_sampled(token_list[i], rows[i].params, raw[j])))}
    records = {}
    for j, i in enumerate(lp_rows):
        num = rows[i].params.logprobs
        top = dict(zip(top_i[j][:num], top_v[j][:num]))
        top[token_list[i]] = chosen_list[j]
        records[i] = SampledToken(token_list[i], chosen_list[j], ranks[j], top)
    return records


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (its first maximum, as `argmax`), by the kernel set's `argmax_rows`
    (torch's `argmax` on CPU: 16.6 ms for [256, 49k] float32 on 2 threads; `max(dim)` 4.2 ms)."""
    return kernels_for(logits).argmax_rows(logits)


def _guard(failed: dict[int, str], row: int, what: str, fn):
    """fn() for one row; an exception marks the row failed (None) instead of failing the batch."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported per row, the batch goes on
        failed[row] = f"{what} failed: {e!r}"
        return None


def to_sampled(token_id: int, params: SamplingParams, raw_logprobs: torch.Tensor | None) -> SampledToken:
    """The record of one chosen token, with its logprob, rank and top-N if the request wants them
    (`raw_logprobs`: [vocab], the model's log-softmax at that position)."""
    sampled = SampledToken(token_id)
    if params.logprobs is not None and raw_logprobs is not None:
        lp = raw_logprobs
        sampled.logprob = lp[token_id].item()
        sampled.rank = int((lp > lp[token_id]).sum().item()) + 1
        sampled.top_logprobs = top_logprobs(lp, params.logprobs)
        sampled.top_logprobs[token_id] = sampled.logprob
    return sampled


def top_logprobs(logprobs: torch.Tensor, num: int) -> dict[int, float]:
    if num == 0:
        return {}
    values, ids = logprobs.topk(num)
    return dict(zip(ids.tolist(), values.tolist()))


def _batched_penalties(logits: torch.Tensor, rows: list[SamplingRow], counts: TokenCounts) -> set[int]:
    """Penalize the rows that need it in one go (engine/sample/penalties.py); the rows done. If that
    raises, none are, and the row-by-row path (which isolates a failing row) does them all."""
    which = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not which:
        return set()
    try:
        chosen = [rows[i] for i in which]
        stats = [counts.update(r.key, r.prompt_token_ids, r.output_token_ids) for r in chosen]
        apply_penalties(logits, which, [r.params for r in chosen], stats)
    except Exception:  # noqa: BLE001 - the per-row path reports the row that fails
        for r in chosen:
            counts.release(r.key)          # recounted from scratch when next seen
        return set()
    return set(which)


def apply_penalties_and_masks(logits: torch.Tensor, rows: list[SamplingRow],
                              failed: dict[int, str] | None = None, skip_penalties: set[int] = frozenset()) -> None:
    """Penalties (except for rows in `skip_penalties`, done already), logit biases and min_tokens
    masks, row by row; a row that raises is recorded in `failed` (and sampled from anyway: its token
    is dropped) when given, else the error propagates."""
    for i, row in enumerate(rows):
        penalties = row.params.needs_penalties and i not in skip_penalties
        if not penalties and not row.params.logit_bias and len(row.output_token_ids) >= row.params.min_tokens:
            continue
        if failed is None:
            _penalize_row(logits, i, row, penalties)
        else:
            _guard(failed, i, "applying penalties", lambda: _penalize_row(logits, i, row, penalties))


def _penalize_row(logits: torch.Tensor, i: int, row: SamplingRow, penalties: bool = True) -> None:
    """The per-row reference for penalties (engine/sample/penalties.py batches them), the logit
    bias and the min_tokens mask."""
    vocab, device = logits.shape[-1], logits.device
    p = row.params
    if penalties and p.needs_penalties:
        out_ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                                dtype=torch.long, device=device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                          vals * p.repetition_penalty)
        if len(out_ids) and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.logit_bias:
        ids = [t for t in p.logit_bias if t < vocab]
        logits[i, ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=logits.dtype, device=device)
    if len(row.output_token_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(row.eos_token_ids))
        banned_ids = [t for t in banned if t < vocab]
        if banned_ids:
            logits[i, banned_ids] = float("-inf")


def candidates(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `filtered_probs` keeps, without sorting the vocabulary: each row's most likely tokens in
    descending order, (probabilities [R, k], zero where not kept; token ids [R, k]; how many of its
    first k are kept, [R]), on the logits' device.

    top_k, then top_p on the distribution renormalized over the top k, then min_p (as filtered_probs
    and vLLM). The kept tokens are a prefix of the sorted ones, so each row takes them from `topk`
    with k = 64, 512, 4096, ... until its cut is known to fall inside: a full sort of a 49k
    vocabulary took 89 ms for 64 rows on 2 threads, a topk of 512 a few. A row's k, order and count
    depend on the row alone (topk orders equal values differently for another k), so a seeded row
    draws the same token for the same draw whatever else is in the batch. Kept probabilities are not
    renormalized (the draw scales by their sum)."""
    (rows, vocab), device = logits.shape, logits.device
    probs = logits.softmax(dim=-1)
    top_k, top_p, min_p = _filters(params, vocab, probs.dtype, device)
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, vals, ids, kept)
    unfiltered = (top_k == vocab) & (top_p >= 1) & (min_p <= 0)        # every token, in vocabulary order
    if bool(unfiltered.any()):
        where = unfiltered.nonzero().flatten()
        found.append((where, _rows(probs, where), torch.arange(vocab, device=device).expand(len(where), vocab),
                      torch.full((len(where),), vocab, device=device)))
    pending = (~unfiltered).nonzero().flatten()
    k = min(64, vocab)
    while len(pending):
        vals, ids = _rows(probs, pending).topk(k, dim=-1)       # sorted, descending
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
        pending = pending[~ends]
        k = min(k * 8, vocab)
    if len(found) == 1 and len(found[0][0]) == rows:     # every row found at once (the usual batch)
        return found[0][1], found[0][2], found[0][3]
    width = max(v.shape[1] for _, v, _, _ in found)
    out_vals = torch.zeros(rows, width, dtype=probs.dtype, device=device)
    out_ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    sizes = torch.zeros(rows, dtype=torch.long, device=device)
    for where, vals, ids, kept in found:
        out_vals[where, :vals.shape[1]] = vals
        out_ids[where, :ids.shape[1]] = ids
        sizes[where] = kept
    return out_vals, out_ids, sizes


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after top_k, top_p and min_p filtering (rows without them pass through)."""
    vocab, device = logits.shape[-1], logits.device
    top_k, top_p, min_p = _filters(params, vocab, logits.dtype, device)
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


def _rows(x: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """x[which], without the copy where `which` (ascending, as nonzero() gives) is every row."""
    return x if len(which) == x.shape[0] else x[which]


def _filters(params: list[SamplingParams], vocab: int, dtype: torch.dtype, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's (top_k, with `vocab` for none; top_p; min_p) as tensors on `device`."""
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=dtype, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=dtype, device=device)
    return top_k, top_p, min_p
