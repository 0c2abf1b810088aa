"""The hung-engine rule (services/rollout/heartbeat.py) on a controlled clock."""

from __future__ import annotations

import pytest

from services.rollout.heartbeat import Heartbeat
from tests.clock import Clock


def test_an_idle_engine_is_never_stalled_however_long_since_its_last_step():
    clock = Clock(1000.0)
    hb = Heartbeat(5.0, clock)
    assert hb.stalled() is None
    hb.step()
    clock.now += 3600
    assert hb.stalled() is None


def test_busy_without_a_step_counts_from_when_it_became_busy_not_from_the_last_step():
    clock = Clock(1000.0)
    hb = Heartbeat(5.0, clock)
    hb.step()
    clock.now += 100  # idle for long: no debt carried into the next request
    hb.begin()
    clock.now += 5.0
    assert hb.stalled() is None  # exactly the bound is not past it
    clock.now += 0.5
    assert hb.stalled() == pytest.approx(5.5)


def test_steps_keep_a_busy_engine_alive_and_the_quiet_is_counted_from_the_last():
    clock = Clock(1000.0)
    hb = Heartbeat(5.0, clock)
    with hb.working():
        for _ in range(10):
            clock.now += 4.0
            hb.step()
            assert hb.stalled() is None
        clock.now += 6.0
        assert hb.stalled() == pytest.approx(6.0)
    assert hb.busy == 0 and hb.stalled() is None  # the work ended: nothing is waiting on it
    assert hb.steps == 10


def test_a_second_request_does_not_restart_the_clock_of_a_busy_engine():
    clock = Clock(1000.0)
    hb = Heartbeat(5.0, clock)
    hb.begin()
    clock.now += 4.0
    hb.begin()  # arrives while the first still waits: the engine has been quiet 4 s already
    clock.now += 2.0
    assert hb.stalled() == pytest.approx(6.0)
    hb.end()
    assert hb.stalled() == pytest.approx(6.0)  # one still in it
    hb.end()
    hb.end()  # an extra end never makes the count negative
    assert hb.busy == 0 and hb.stalled() is None


def test_zero_never_calls_an_engine_stalled():
    clock = Clock(1000.0)
    hb = Heartbeat(0.0, clock)
    hb.begin()
    clock.now += 1e6
    assert hb.stalled() is None
