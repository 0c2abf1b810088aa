"""When a batch job (GRPO, asynchronous GRPO, PPO) stops taking steps.

Two bounds, either optional:
- `train_budget_s`: seconds of training;
- `run_budget_s`: the whole run, from the recipe's start. Training then also ends early enough
  for the final evaluation, which is predicted from the base evaluation's time (the same
  tasks, the same sampling).

The second is how `make demo` keeps its 15 minutes on a CPU several times slower than this
one: there the evaluations take a larger share, and training gives way to them instead of
pushing the run over. Training always gets its first step, or there is nothing to evaluate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

FINAL_EVAL_MARGIN = 1.25
"""The final evaluation's predicted time, as a multiple of the base one's: completions change
length with training (shorter here, as the model learns to stop; not everywhere)."""


class StepBudget:
    """Started when training starts; `spent(steps)` after each step says whether to stop."""

    def __init__(self, train_budget_s: float, run_budget_s: float, run_started: float,
                 base_eval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.limit = train_budget_s or math.inf
        self.why = f"training budget of {train_budget_s:.0f} s"
        if run_budget_s:
            final = FINAL_EVAL_MARGIN * base_eval_s
            left = run_budget_s - (self.started - run_started) - final
            if left < self.limit:
                self.limit = left
                self.why = f"run budget of {run_budget_s:.0f} s (leaving ~{final:.0f} s for the final evaluation)"

    def took(self) -> float:
        """Seconds since training started."""
        return self.clock() - self.started

    def spent(self, steps: int) -> bool:
        """Whether another step, as long as this run's mean step, would end past the limit."""
        took = self.took()
        return took + took / max(steps, 1) > self.limit
