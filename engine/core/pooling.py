"""Embedding requests (SamplingParams.pooling): the rows of final hidden states each step pooled
(ModelRunnerOutput.pooled: their sum and count, per request), added up over the prompt's chunks,
and the request's vector once its whole prompt is computed."""
from __future__ import annotations

from typing import Any

from records.request import Request


def add_rows(request: Request, part: tuple[Any, int] | None) -> bool:
    """Add a step's pooled rows to `request`'s; True once its whole prompt is computed, with its
    `embedding` set (the mean or the single row, L2-normalized when its params ask)."""
    if part is not None:
        total, rows = part
        request.pooled = total if request.pooled is None else request.pooled + total
        request.pooled_rows += rows
    if request.num_computed_tokens < request.num_prompt_tokens:
        return False
    vector = request.pooled / max(1, request.pooled_rows)
    if request.sampling_params.normalize:
        vector = vector / vector.norm().clamp_min(1e-12)
    request.embedding, request.pooled = vector.tolist(), None
    return True
