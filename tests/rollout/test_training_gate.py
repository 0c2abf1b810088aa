"""`TrainingGate`: while users are on the replica, at most `limit` training prompts run in the
engine at once and one is prefilled at a time; with no user, any number enter (plain asyncio,
no engine: the counts are the behaviour; tests/rollout/test_rollout_stream.py has it on an
engine)."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.core import TrainingGate, UserLoad


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_without_users_a_training_batch_enters_whole():
    gate = TrainingGate(UserLoad(), limit=2)
    turns = [await asyncio.wait_for(gate.enter(), 1) for _ in range(8)]
    assert gate.running == 8 and gate.prefilling == 8
    for t in turns:
        t.leave()
    assert gate.running == 0 and gate.prefilling == 0


async def test_beside_users_one_prefill_at_a_time_and_at_most_limit_running():
    users = UserLoad()
    users.begin()
    gate = TrainingGate(users, limit=2)
    first = await gate.enter()
    second = asyncio.create_task(gate.enter())
    await settle()
    assert not second.done()  # the first is still being prefilled
    first.prefilled()
    second = await asyncio.wait_for(second, 1)
    second.prefilled()
    third = asyncio.create_task(gate.enter())
    await settle()
    assert not third.done() and gate.running == 2  # the limit
    first.leave()
    third = await asyncio.wait_for(third, 1)
    assert gate.running == 2 and gate.prefilling == 1
    second.leave()
    third.leave()
    third.leave()  # twice is once
    assert gate.running == 0 and gate.prefilling == 0


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


async def test_a_prompt_that_ends_before_its_first_output_frees_its_turn():
    users = UserLoad()
    users.begin()
    gate = TrainingGate(users, limit=4)
    failed = await gate.enter()
    nxt = asyncio.create_task(gate.enter())
    await settle()
    failed.leave()  # aborted or failed: no output ever came
    await asyncio.wait_for(nxt, 1)
    assert gate.running == 1 and gate.prefilling == 1


async def test_a_cancelled_wait_takes_no_room():
    users = UserLoad()
    users.begin()
    gate = TrainingGate(users, limit=1)
    turn = await gate.enter()
    waiting = asyncio.create_task(gate.enter())
    await settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert gate.running == 1 and not gate._wakes and not users.watchers
    turn.leave()
    await asyncio.wait_for(gate.enter(), 1)
