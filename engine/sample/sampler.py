"""Sampler: logits of the rows that sample this step -> one token each, plus logprobs.

Per row, in order: penalties (repetition over prompt + output, presence/frequency over output),
logit_bias, allowed_token_ids, bad_words, min_tokens (EOS and stop tokens masked), then greedy argmax, or
temperature -> top_k -> top_p -> min_p -> a draw among the kept tokens (engine/sample/nucleus.py:
no sort of the whole vocabulary; one uniform number per row). A row with a
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

from engine.sample.nucleus import candidates, draw_wide, select_rows
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
        scaled = select_rows(logits, idx)
        cands = candidates(scaled.div_(temps[:, None]), [rows[i].params for i in random_idx])
        # One uniform draw per row, from the row's own generator, inverted through its candidates'
        # cumulative mass (a draw of exponential noise per vocabulary entry cost 0.8 ms a row).
        uniform = _uniforms([rows[i] for i in random_idx], random_idx, failed, device)
        cdf = cands.vals.cumsum(dim=-1, dtype=torch.float64)
        target = (uniform * cdf[:, -1])[:, None]
        chosen = torch.minimum(torch.searchsorted(cdf, target, right=True).squeeze(1), cands.sizes - 1)
        drawn = cands.ids.gather(1, chosen.clamp(min=0)[:, None]).squeeze(1)
        # A row with no candidate or no finite mass has no distribution left (its scaled logits
        # overflowed: a tiny temperature or an extreme repetition penalty made them inf, the
        # softmax NaN): it keeps its most likely token, the limit of sampling as T goes to 0.
        mass = cdf[:, -1]
        drew = (cands.sizes > 0) & torch.isfinite(mass) & (mass > 0)
        if len(cands.wide):         # flat distributions: drawn by rejection (engine/sample/nucleus.py)
            wide_drawn = draw_wide(cands.wide_probs(),
                                   [rows[random_idx[j]].params for j in cands.wide.tolist()], uniform[cands.wide])
            drawn[cands.wide], drew[cands.wide] = wide_drawn, wide_drawn >= 0
        token_ids[idx] = torch.where(drew, drawn, token_ids[idx])

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


def _uniforms(rows: list[SamplingRow], positions: list[int], failed: dict[int, str], device: torch.device
              ) -> torch.Tensor:
    """One uniform number in [0, 1) per row (float64, on `device`), one a row: rows that share a
    generator (the runner's, for every unseeded request) draw theirs in one call, in row order (a
    call a row cost ~15 us of Python, ~0.5 ms a step at 32 rows); a seeded row from its own. A
    generator that fails marks its rows failed (at `positions`) and they draw 0."""
    uniform = torch.zeros(len(rows), dtype=torch.float64, device="cpu")
    groups: dict[int, list[int]] = {}
    for j, row in enumerate(rows):
        if positions[j] not in failed:
            groups.setdefault(id(row.generator), []).append(j)
    for members in groups.values():
        try:
            drawn = torch.rand(len(members), generator=rows[members[0]].generator, dtype=torch.float64, device="cpu")
        except Exception as e:  # noqa: BLE001 - reported per row, the batch goes on
            failed.update((positions[j], f"drawing a token failed: {e!r}") for j in members)
            continue
        uniform[members] = drawn
    return uniform.to(device)


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
        if (not penalties and not row.params.logit_bias and row.params.allowed_token_ids is None
                and not row.params.bad_words_token_ids and len(row.output_token_ids) >= row.params.min_tokens):
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
    if p.allowed_token_ids is not None:      # every other token out (vLLM's allowed_token_ids)
        keep = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long, device=device)
        kept = logits[i, keep]
        logits[i] = float("-inf")
        logits[i, keep] = kept
    if p.bad_words_token_ids:
        banned = [t for t in bad_word_ends(p.bad_words_token_ids, row.output_token_ids) if t < vocab]
        if banned:
            logits[i, banned] = float("-inf")
    if len(row.output_token_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(row.eos_token_ids))
        banned_ids = [t for t in banned if t < vocab]
        if banned_ids:
            logits[i, banned_ids] = float("-inf")


def bad_word_ends(words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word here: each word's last token where the output ends
    with the word's other tokens (vLLM's rule; a one-token word is always out)."""
    return [ids[-1] for ids in words
            if len(ids) - 1 <= len(output) and (len(ids) == 1 or output[len(output) - len(ids) + 1:] == ids[:-1])]
