"""The update loop seen from outside (`measure.loop.LoopTracker`): pairing trained feedback
with the first token of a version trained on it, and how far behind training the served
versions were. Reading its metrics file against a real bus: tests/apps/test_online_demo.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from measure.loop import LoopTracker
from measure.users import Record, VersionClock


def test_loops_pair_feedback_with_the_first_token_of_a_version_trained_on_it():
    t = LoopTracker("nats://unused", Path("/nonexistent"))
    t.trained_in = {"a": 1, "b": 2, "c": 3}
    t.published_at = {2: 108.0}  # v1's announcement unheard
    clock = VersionClock()
    clock.saw(0, 100.0)
    clock.saw(2, 110.0)  # v1 never reached a user: v2 (trained on a's feedback too) did
    sent = {"a": 101.0, "b": 102.5, "c": 103.0, "never-trained": 99.0}
    loops = t.loops(sent, clock)
    assert [(e["response_id"], e["version"]) for e in loops] == [("a", 1), ("b", 2)]  # c: v3 unseen
    assert loops[0]["loop_ms"] == pytest.approx(9000) and loops[1]["loop_ms"] == pytest.approx(7500)
    assert (loops[0]["live"], loops[1]["live"]) == (None, 108.0)


def test_version_lag_in_versions_and_seconds():
    t = LoopTracker("nats://unused", Path("/nonexistent"))
    t.published_at = {1: 100.0, 2: 105.0}
    recs = [
        Record(ts=99.0, user=0, phase="training", prompt=0, version=0, ttft_ms=500),  # before v1
        Record(ts=106.0, user=0, phase="training", prompt=0, version=0, ttft_ms=1000),  # v2 live
        Record(ts=106.0, user=1, phase="training", prompt=0, version=2, ttft_ms=1000),
        Record(ts=106.0, user=1, phase="training", prompt=0, error="HTTP 503"),
    ]
    lag = t.lag(recs)
    assert lag["versions"]["p99"] == pytest.approx(1.96)  # [0, 2, 0]: 2 behind at most
    assert lag["versions"]["p50"] == 0
    assert lag["seconds"]["p50"] == 0 and lag["seconds"]["p99"] == pytest.approx(6.86)  # 107 - 100
