"""The tokens one step may take: `StepBudget`, what is left of `max_num_batched_tokens` as the
scheduler fills a step, and `StepPacer`, how many of them may be prompt tokens while decodes run,
so that a step (the gap between two of a stream's tokens) stays near an ITL target.

With chunked prefill a step holds every running decode and as many prompt tokens as
`max_num_batched_tokens` leaves (vLLM's semantics): on a CPU a 2,048-token step of prompts takes
seconds, and every stream waits that long for its next token. Given a target (`itl_target_ms`),
the scheduler caps the prompt tokens of a step that carries decodes at `cap`, and the engine
reports the time of each step that carried decodes (`observe`). A step's time is about linear in
its prompt tokens (their GEMM rows and attention) over a fixed part, the decodes' (and the weights
read once): the fixed part is what steps of decodes alone take, and a prompt token's cost is what a
paced step took beyond it, each a running average over the recent steps (one noisy step, a busy
core's, moves them little; the cost follows the context's growth). The cap is the prompt tokens that
take the target at that cost. The first paced step sets it; after it the cap falls to what fits at
once but at most by half, and rises halfway to it. It never falls below `floor` (prompts keep moving
when the decodes alone take the target: TTFT stays bounded) nor rises above `ceiling` (the step
budget). Steps without decodes take the whole budget: no stream waits on them. Pacing needs no model
of the hardware: it follows what the steps take, on any machine and under any load, simulated
engines included (their step times are the profile's).
"""
from __future__ import annotations

from dataclasses import dataclass

# The least prompt tokens a paced step takes: with fewer, a step's fixed cost (the decodes, the
# weights read once) would dominate it and prompts would crawl.
MIN_PROMPT_TOKENS = 64
# The weight of the newest step in the running averages of a step's fixed part and a prompt token's cost.
SMOOTHING = 0.5


@dataclass(slots=True)
class StepBudget:
    """What one step may still take: `left` tokens, and of them, when `prompt_cap` is set (a paced
    step), at most `prompt_cap` prompt tokens in all (`prompt_taken` so far)."""
    left: int
    prompt_cap: int | None = None
    prompt_taken: int = 0

    def room(self, prompt: bool) -> int:
        """Tokens a request may take now: a prompt chunk's also within the cap."""
        if not prompt or self.prompt_cap is None:
            return self.left
        return max(0, min(self.left, self.prompt_cap - self.prompt_taken))

    def may_pass_cap(self, prompt: bool) -> bool:
        """Whether a prompt chunk that the cap leaves no room may take what is left: the step's first
        (a model whose images attend both ways computes an image in one step, whatever its size)."""
        return prompt and self.prompt_cap is not None and self.prompt_taken == 0

    def take(self, n: int, prompt: bool) -> None:
        self.left -= n
        self.prompt_taken += n if prompt else 0


class StepPacer:
    """Caps a step's prompt tokens while decodes run, from the times of the steps before."""

    def __init__(self, target_s: float, ceiling: int, floor: int = MIN_PROMPT_TOKENS) -> None:
        if target_s <= 0:
            raise ValueError(f"itl_target_ms must be > 0; got {target_s * 1e3:g}")
        self.target_s = target_s
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self.cap = ceiling              # until a step says otherwise
        self.fixed_s: float | None = None        # a step of the decodes alone (running average)
        self.per_token: float | None = None      # seconds a prompt token adds to a step (running average)

    def observe(self, seconds: float, prompt_tokens: int, capped: bool) -> None:
        """A step that carried decodes took `seconds` with `prompt_tokens` prompt tokens (0: decodes
        alone); `capped`: the cap held it back (more prompt tokens were waiting). A step under the
        target that the cap did not hold back says nothing about more tokens."""
        if seconds <= 0:
            return
        if prompt_tokens <= 0:
            self.fixed_s = seconds if self.fixed_s is None else (1 - SMOOTHING) * self.fixed_s + SMOOTHING * seconds
            return
        if seconds < self.target_s and not capped:
            return
        fixed = min(self.fixed_s or 0.0, seconds / 2)      # (a step takes longer than its decodes alone)
        cost = (seconds - fixed) / prompt_tokens
        first = self.per_token is None
        self.per_token = cost if first else (1 - SMOOTHING) * self.per_token + SMOOTHING * cost
        fit = (self.target_s - fixed) / self.per_token
        if not first:
            fit = max(fit, self.cap / 2) if fit < self.cap else (self.cap + fit) / 2
        self.cap = int(min(self.ceiling, max(self.floor, fit)))
