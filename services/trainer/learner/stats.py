"""Paired comparisons of a policy before and after training, on the same held-out tasks.

Owns: the paired difference of per-task scores and its bootstrap CI. Why paired: tasks differ
far more in difficulty than training moves any one of them, so two independent CIs (one per
evaluation) hide a real gain in between-task variance; the per-task difference cancels it.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence


def paired_bootstrap(base: Sequence[float], final: Sequence[float], iters: int = 4000,
                     seed: int = 0) -> dict:
    """Mean per-task scores before and after, their mean difference, and a 95% percentile
    bootstrap CI of that difference, resampling tasks (the unit that was sampled).

    `significant` is True when the CI excludes zero. base[i] and final[i] must score the
    same task i."""
    if len(base) != len(final):
        raise ValueError(f"paired scores need the same tasks: {len(base)} vs {len(final)}")
    if not base:
        raise ValueError("no tasks to compare")
    diffs = [f - b for b, f in zip(base, final)]
    n = len(diffs)
    rng = random.Random(seed)
    means = sorted(statistics.fmean(diffs[rng.randrange(n)] for _ in range(n)) for _ in range(iters))
    lo, hi = means[int(0.025 * iters)], means[min(iters - 1, int(0.975 * iters))]
    return {
        "base": statistics.fmean(base),
        "final": statistics.fmean(final),
        "diff": statistics.fmean(diffs),
        "ci95": [lo, hi],
        "significant": lo > 0 or hi < 0,
        "tasks_improved": sum(d > 0 for d in diffs),
        "tasks_worse": sum(d < 0 for d in diffs),
    }


def verdict(p: dict, what: str) -> str:
    """One plain sentence on whether a paired change is resolved."""
    d, (lo, hi) = p["diff"] * 100, (x * 100 for x in p["ci95"])
    if not p["significant"]:
        return (f"{what}: {d:+.1f} points, 95% CI [{lo:+.1f}, {hi:+.1f}]: not significant "
                f"(the CI includes zero)")
    word = "better" if d > 0 else "worse"
    return f"{what}: {d:+.1f} points, 95% CI [{lo:+.1f}, {hi:+.1f}]: significantly {word}"
