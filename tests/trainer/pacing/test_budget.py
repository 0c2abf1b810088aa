"""`StepBudget`: when a batch job stops taking steps (a clock under the test's control)."""

from __future__ import annotations

import math

from services.trainer.pacing.budget import FINAL_EVAL_MARGIN, StepBudget
from tests.clock import Clock


def steps_taken(budget: StepBudget, clock: Clock, step_s: float, most: int = 100) -> int:
    """Steps of `step_s` each until the budget says stop (at least one, as the recipes do)."""
    for n in range(1, most + 1):
        clock.now += step_s
        if budget.spent(n):
            return n
    return most


def test_the_training_budget_alone_stops_before_a_step_would_overrun_it() -> None:
    clock = Clock()
    budget = StepBudget(330, 0, run_started=0.0, base_eval_s=1e6, clock=clock)
    assert budget.limit == 330 and "training budget" in budget.why
    assert steps_taken(budget, clock, 60) == 5  # 5 x 60 = 300; a sixth would end at 360


def test_no_budget_never_stops() -> None:
    clock = Clock()
    budget = StepBudget(0, 0, run_started=0.0, base_eval_s=50, clock=clock)
    assert budget.limit == math.inf and steps_taken(budget, clock, 60) == 100


def test_the_run_budget_leaves_the_final_evaluation_its_time_on_a_slow_cpu() -> None:
    # a CPU 3x slower: setup and the base evaluation took 300 s of a 780 s run
    clock = Clock(now=300.0)
    budget = StepBudget(330, 780, run_started=0.0, base_eval_s=270, clock=clock)
    assert budget.limit == 780 - 300 - FINAL_EVAL_MARGIN * 270 and "run budget" in budget.why
    n = steps_taken(budget, clock, 105)
    assert n == 1  # a second step would end at 510 s, past 780 - 1.25 x 270 = 442.5
    assert clock.now + FINAL_EVAL_MARGIN * 270 <= 780


def test_on_a_fast_cpu_the_training_budget_binds_and_the_run_budget_does_not() -> None:
    clock = Clock(now=100.0)
    budget = StepBudget(330, 780, run_started=0.0, base_eval_s=80, clock=clock)
    assert budget.limit == 330 and "training budget" in budget.why


def test_a_run_budget_already_spent_still_trains_one_step() -> None:
    clock = Clock(now=900.0)
    budget = StepBudget(330, 780, run_started=0.0, base_eval_s=400, clock=clock)
    assert budget.limit < 0 and steps_taken(budget, clock, 10) == 1
