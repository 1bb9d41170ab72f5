"""SamplingParams: what to generate and how to pick each token (vLLM-compatible names).

Validation happens in `__post_init__`: bad values raise ValueError naming the field and the
allowed range, before anything reaches the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16          # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None          # top-N logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    detokenize: bool = True
    priority: int = 0                    # lower runs first under scheduling_policy="priority"
    extra_keys: tuple = field(default_factory=tuple)  # e.g. a cache salt: part of the block hash

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1), "top_k",
               "-1 (disabled) or >= 1", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _check(0 < self.repetition_penalty <= 2, "repetition_penalty", "in (0, 2]", self.repetition_penalty)
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", "an integer >= 1 (or None)", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", ">= 0", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "in [0, 20] (or None)", self.logprobs)
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
               "in [0, 20] (or None)", self.prompt_logprobs)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "non-negative token ids", self.stop_token_ids)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "an integer (or None)", self.seed)
        _check(isinstance(self.priority, int), "priority", "an integer", self.priority)
        self.extra_keys = tuple(self.extra_keys)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def clone(self) -> SamplingParams:
        return SamplingParams(**{f: getattr(self, f) for f in self.__dataclass_fields__})


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}; got {value!r}")
