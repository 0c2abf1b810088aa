"""`TrainingGate`: while users are on the replica, at most `limit` training prompts run in the
engine at once; with none, any number (plain asyncio, no engine: the count is the behaviour)."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.core import TrainingGate, UserLoad


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_without_users_a_training_batch_enters_whole():
    gate = TrainingGate(UserLoad(), limit=2)
    for _ in range(8):
        await asyncio.wait_for(gate.enter(), 1)
    assert gate.running == 8


async def test_beside_users_at_most_limit_run_and_the_next_enters_when_one_ends():
    users = UserLoad()
    users.begin()
    gate = TrainingGate(users, limit=2)
    await gate.enter()
    await gate.enter()
    third = asyncio.create_task(gate.enter())
    await settle()
    assert not third.done() and gate.running == 2
    gate.leave()
    await asyncio.wait_for(third, 1)
    assert gate.running == 2


async def test_prompts_waiting_beside_users_go_in_when_the_users_leave():
    users = UserLoad()
    users.begin()
    gate = TrainingGate(users, limit=1)
    await gate.enter()
    waiting = [asyncio.create_task(gate.enter()) for _ in range(3)]
    await settle()
    assert not any(t.done() for t in waiting)
    users.first_token()  # still in flight: still beside a user
    await settle()
    assert not any(t.done() for t in waiting)
    users.end(True)  # the last user is gone
    await asyncio.wait_for(asyncio.gather(*waiting), 1)
    assert gate.running == 4


async def test_a_cancelled_wait_takes_no_room():
    users = UserLoad()
    users.begin()
    gate = TrainingGate(users, limit=1)
    await gate.enter()
    waiting = asyncio.create_task(gate.enter())
    await settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert gate.running == 1 and not gate._wakes and not users.watchers
    gate.leave()
    await asyncio.wait_for(gate.enter(), 1)
