"""Repetition, frequency and presence penalties for a batch, from token counts kept across steps.

Applied row by row, penalties cost O(context) of Python per row per step (a set of the prompt and
output tokens, a tensor of them, a bincount): 7 ms of a 68 ms step at batch 64 with 1,000-token
prompts (benchmarks/step_overhead.py). `TokenCounts` keeps, per request, the prompt's distinct
tokens (once) and the output's token counts (incremented by the new tokens only), and a step
penalizes every row's seen tokens in one gather and one scatter, with the same arithmetic as the
per-row reference (`sampler._penalize_row`), so the logits come out equal. Only the seen tokens are
touched: a dense [rows, vocab] formulation made ten passes over 3 M floats and was slower than the
per-row loop.

It lives on the rank that samples (the driver) and forgets a request when the runner hears it was
freed.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from records.sampling_params import SamplingParams


class _Stats:
    """One request's tokens, as penalties read them."""
    __slots__ = ("prompt_set", "prompt_ids", "counts", "num_counted")

    def __init__(self, prompt: Sequence[int]) -> None:
        self.prompt_set = set(prompt)
        self.prompt_ids = torch.tensor(sorted(self.prompt_set), dtype=torch.long, device="cpu")   # (kept here)
        self.counts: dict[int, int] = {}         # output token -> times
        self.num_counted = 0


class TokenCounts:
    """Per-request token statistics, kept across steps: each prompt's distinct tokens (a tensor,
    made once) and each output's token counts (grown by the new tokens only)."""

    def __init__(self) -> None:
        self._stats: dict[str, _Stats] = {}

    def __len__(self) -> int:
        return len(self._stats)

    def release(self, key: str) -> None:
        self._stats.pop(key, None)

    def update(self, key: str, prompt: Sequence[int], output: Sequence[int]) -> _Stats:
        """This request's statistics with its output counted up to now (recounted if it shrank)."""
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = _Stats(prompt)
        if len(output) < stats.num_counted:
            stats.counts.clear()
            stats.num_counted = 0
        counts = stats.counts
        for token in output[stats.num_counted:]:
            counts[token] = counts.get(token, 0) + 1
        stats.num_counted = len(output)
        return stats


def apply_penalties(logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                    stats: Sequence[_Stats]) -> None:
    """Penalize these rows of `logits` [R, vocab] in place, touching only the tokens each has seen: repetition
    (tokens of the prompt or output: a positive logit divided by it, a negative one multiplied),
    then frequency (times each token's output count) and presence (once for any output token), as
    vLLM defines them."""
    dtype, device = logits.dtype, logits.device
    rep_rows, rep_cols, rep_vals = [], [], []
    out_rows, out_ids, out_counts, freq, pres = [], [], [], [], []
    for i, p, st in zip(rows, params, stats):
        if p.repetition_penalty != 1.0:
            extra = [t for t in st.counts if t not in st.prompt_set]
            cols = (torch.cat([st.prompt_ids, torch.tensor(extra, dtype=torch.long, device="cpu")]) if extra
                    else st.prompt_ids)
            rep_rows.append(torch.full((len(cols),), i, dtype=torch.long, device="cpu"))
            rep_cols.append(cols)
            rep_vals.append(p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and st.counts:
            out_rows.extend([i] * len(st.counts))
            out_ids.extend(st.counts)
            out_counts.extend(st.counts.values())
            freq.extend([p.frequency_penalty] * len(st.counts))
            pres.extend([p.presence_penalty] * len(st.counts))
    if rep_rows:
        # (The counts are built on the host, where they are kept; one copy of each to the logits.)
        at = (torch.cat(rep_rows).to(device), torch.cat(rep_cols).to(device))
        rep = torch.repeat_interleave(torch.tensor(rep_vals, dtype=dtype, device=device),
                                      torch.tensor([len(c) for c in rep_cols], device=device))
        vals = logits[at]
        logits[at] = torch.where(vals > 0, vals / rep, vals * rep)
    if out_rows:
        at = (torch.tensor(out_rows, device=device), torch.tensor(out_ids, device=device))
        counts = torch.tensor(out_counts, dtype=dtype, device=device)
        logits[at] -= (torch.tensor(freq, dtype=dtype, device=device) * counts
                       + torch.tensor(pres, dtype=dtype, device=device))
