"""N-gram (prompt lookup) proposer: no model, only the request's own tokens.

For n from prompt_lookup_max down to prompt_lookup_min, find the latest earlier occurrence of the
sequence's last n tokens (prompt and output so far) and propose the tokens that followed it. Strong
when the output copies spans of the prompt (summarization, editing, extraction, RAG), idle otherwise.
"""
from __future__ import annotations

from collections.abc import Container

import numpy as np

from records.config import SpeculativeConfig
from records.request import Request


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        """Up to num_tokens[i] proposals to follow requests[i]'s tokens (possibly none)."""
        return [self.lookup(r.all_token_ids, k) for r, k in zip(requests, num_tokens)]

    def lookup(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """The up to `num_tokens` tokens after the latest earlier match of the longest suffix
        n-gram (n in [min_n, max_n]); [] when no suffix of that length occurs before."""
        length = len(token_ids)
        if num_tokens <= 0 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length - n - 1 (the suffix itself excluded).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(starts):
                follow = int(starts[-1]) + n
                return token_ids[follow:follow + num_tokens]
        return []

    def retain(self, request_ids: Container[str]) -> None:
        """Nothing to forget: this proposer keeps no per-request state."""

    def check_no_leaks(self) -> None:
        """Nothing held."""
