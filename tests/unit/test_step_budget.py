"""The step budget and its pacer (engine/core/step_budget.py): what a step may still take, and a
prompt-token cap that follows the steps' times to an ITL target."""
from __future__ import annotations

import pytest

from engine.core.step_budget import MIN_PROMPT_TOKENS, StepBudget, StepPacer
from records.engine_args import EngineArgs


def settle(pacer: StepPacer, fixed_s: float, per_token_s: float, steps: int = 40) -> int:
    """Steps of the decodes alone (`fixed_s`), each followed by one that carries as many prompt
    tokens as the cap allows, each prompt token `per_token_s` more; returns the cap after them."""
    for _ in range(steps):
        pacer.observe(fixed_s, 0, capped=False)
        pacer.observe(fixed_s + per_token_s * pacer.cap, pacer.cap, capped=True)
    return pacer.cap


def test_the_cap_settles_where_a_step_takes_the_target_and_follows_the_machine():
    """Steps of 20 ms plus 0.1 ms a prompt token: 800 tokens take the 100 ms target."""
    pacer = StepPacer(0.1, 8192)
    assert pacer.cap == 8192                                 # the whole budget until a step is seen
    assert settle(pacer, 0.02, 1e-4) == pytest.approx(800, abs=2)
    assert settle(pacer, 0.02, 2e-4) == pytest.approx(400, abs=2)      # a slower machine (or a busy one)
    assert settle(pacer, 0.02, 2e-5) == pytest.approx(4000, abs=4)     # faster again: the cap rises
    assert settle(pacer, 0.06, 1e-4) == pytest.approx(400, abs=2)      # more decodes: fewer prompt tokens
    assert settle(pacer, 0.02, 1e-6) == 8192                           # never past the step budget
    assert settle(pacer, 0.15, 1e-4) == MIN_PROMPT_TOKENS              # decodes alone past the target
    assert StepPacer(0.1, 32).cap == 32 and StepPacer(0.1, 32).floor == 32


def test_the_cap_moves_only_on_what_a_step_says_and_little_on_one_step():
    pacer = StepPacer(0.1, 8192)
    settle(pacer, 0.02, 1e-4)
    cap = pacer.cap
    pacer.observe(0.05, cap // 2, capped=False)      # fast, but fewer prompts than the cap: no news
    assert pacer.cap == cap
    pacer.observe(0.3, cap, capped=True)             # one slow step (a busy core): down, by half at most
    assert cap // 2 <= pacer.cap < cap
    slowed = pacer.cap
    settle(pacer, 0.02, 1e-4, steps=1)               # the machine as before: back up, halfway
    assert slowed < pacer.cap < cap
    assert settle(pacer, 0.02, 1e-4) == pytest.approx(800, abs=2)
    noisy = StepPacer(0.1, 8192)                     # steps 20% off either way, alternately
    for i in range(60):
        noisy.observe(0.02 * (1.2 if i % 2 else 0.8), 0, capped=False)
        noisy.observe((0.02 + 1e-4 * noisy.cap) * (0.8 if i % 3 else 1.2), noisy.cap, capped=True)
        if i >= 20:
            assert 500 <= noisy.cap <= 1100, (i, noisy.cap)


def test_a_step_budget_caps_prompt_chunks_but_never_decodes():
    budget = StepBudget(2048, prompt_cap=300)
    assert budget.room(prompt=False) == 2048 and budget.room(prompt=True) == 300
    assert budget.may_pass_cap(prompt=True) and not budget.may_pass_cap(prompt=False)
    budget.take(16, prompt=False)                    # sixteen decodes
    budget.take(250, prompt=True)
    assert (budget.left, budget.room(prompt=True), budget.room(prompt=False)) == (1782, 50, 1782)
    assert not budget.may_pass_cap(prompt=True)      # only a step's first prompt chunk passes the cap
    budget.take(50, prompt=True)
    assert budget.room(prompt=True) == 0
    unpaced = StepBudget(100)
    assert unpaced.room(prompt=True) == 100 and not unpaced.may_pass_cap(prompt=True)


@pytest.mark.parametrize("bad", [0, -5.0, True, "50"])
def test_a_bad_itl_target_is_refused_by_name(bad):
    with pytest.raises((ValueError, TypeError), match="itl_target_ms"):
        EngineArgs(itl_target_ms=bad)


def test_an_itl_target_needs_chunked_prefill():
    with pytest.raises(ValueError, match="itl_target_ms .* enable_chunked_prefill"):
        EngineArgs(itl_target_ms=50, enable_chunked_prefill=False)
    assert EngineArgs(itl_target_ms=50).itl_target_ms == 50
    with pytest.raises(ValueError, match="itl_target_ms must be > 0"):
        StepPacer(0, 2048)
