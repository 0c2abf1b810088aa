"""Paired before/after comparison on the same tasks."""

from __future__ import annotations

import random

import pytest

from services.trainer.learner.stats import paired_bootstrap, verdict


def test_a_consistent_gain_is_resolved_where_independent_cis_overlap() -> None:
    rng = random.Random(0)
    # tasks of very different difficulty; training adds 0.1 to most of them
    base = [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) for _ in range(128)]
    final = [min(1.0, b + (0.25 if rng.random() < 0.5 else 0.0)) for b in base]
    p = paired_bootstrap(base, final)
    assert p["diff"] == pytest.approx(sum(final) / 128 - sum(base) / 128)
    assert p["significant"] and p["ci95"][0] > 0
    assert "significantly better" in verdict(p, "x")


def test_noise_is_not_called_a_gain() -> None:
    rng = random.Random(1)
    base = [float(rng.random() < 0.6) for _ in range(64)]
    final = [float(rng.random() < 0.6) for _ in range(64)]  # same policy, fresh luck
    p = paired_bootstrap(base, final)
    lo, hi = p["ci95"]
    assert lo < 0 < hi and not p["significant"]
    assert "not significant" in verdict(p, "x")


def test_pairs_must_match_and_be_nonempty() -> None:
    with pytest.raises(ValueError, match="same tasks"):
        paired_bootstrap([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="no tasks"):
        paired_bootstrap([], [])


def test_same_seed_same_interval() -> None:
    base, final = [0.0, 1.0, 0.5, 0.0] * 8, [1.0, 1.0, 0.5, 0.0] * 8
    assert paired_bootstrap(base, final)["ci95"] == paired_bootstrap(base, final)["ci95"]
