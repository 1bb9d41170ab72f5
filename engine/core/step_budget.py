"""The tokens one step may take: `StepBudget`, what is left of `max_num_batched_tokens` as the
scheduler fills a step, and `StepPacer`, how many of them may be prompt tokens while decodes run,
so that a step (the gap between two of a stream's tokens) stays near an ITL target.

With chunked prefill a step holds every running decode and as many prompt tokens as
`max_num_batched_tokens` leaves (vLLM's semantics): on a CPU a 2,048-token step of prompts takes
seconds, and every stream waits that long for its next token. Given a target (`itl_target_ms`),
the scheduler caps the prompt tokens of a step that carries decodes at `cap`, and the engine
reports each such step's time (`observe`). A step's time is about linear in its prompt tokens (their
GEMM rows and attention) over a fixed part (the decodes, the weights read once): the cost of a
prompt token is the slope between two paced steps of different sizes (the last such pair's), and
the cap the tokens that take the target at that cost from where the last step was; before any
slope, a step's time is taken as all its prompts' (which errs low where the fixed part is large).
The first paced step sets the cap; after it, the cap falls to what fits at once but at most by
half (a stream is waiting; one slow step, a busy core's, cannot take it to nothing) and rises
halfway to it (one fast step does not undo it). It
never falls below `floor` (prompts keep moving when the decodes alone take the target: TTFT stays
bounded) nor rises above `ceiling` (the step budget). Steps without decodes take the whole budget:
no stream waits on them. Pacing needs no model of the hardware: it follows what the steps take, on
any machine and under any load, simulated engines included (their step times are the profile's).
"""
from __future__ import annotations

from dataclasses import dataclass

# The least prompt tokens a paced step takes: with fewer, a step's fixed cost (the decodes, the
# weights read once) would dominate it and prompts would crawl.
MIN_PROMPT_TOKENS = 64


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
        self.last: tuple[int, float] | None = None      # the last paced step: prompt tokens, seconds
        self.per_token: float | None = None             # seconds a prompt token adds to a step

    def observe(self, seconds: float, prompt_tokens: int, capped: bool) -> None:
        """A step that carried decodes took `seconds` with `prompt_tokens` prompt tokens; `capped`:
        the cap held it back (more prompt tokens were waiting). A step under the target that the cap
        did not hold back says nothing about more tokens, and one without prompt tokens nothing at all."""
        if prompt_tokens <= 0 or seconds <= 0 or (seconds < self.target_s and not capped):
            return
        last, self.last = self.last, (prompt_tokens, seconds)
        if last is not None and abs(prompt_tokens - last[0]) * 8 >= prompt_tokens:
            slope = (seconds - last[1]) / (prompt_tokens - last[0])
            self.per_token = slope if slope > 0 else self.per_token
        if self.per_token is None:
            fit = prompt_tokens * self.target_s / seconds
        else:
            fit = prompt_tokens + (self.target_s - seconds) / self.per_token
        if last is not None:        # the first paced step sets the cap; later ones move it
            fit = max(fit, self.cap / 2) if fit < self.cap else (self.cap + fit) / 2
        self.cap = int(min(self.ceiling, max(self.floor, fit)))
