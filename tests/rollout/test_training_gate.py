"""`TrainingGate`: training prompts enter the engine one at a time, each once no user waits
for a first token (plain asyncio, no engine: the gate's order is the whole behaviour)."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.core import TrainingGate, UserLoad


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_training_prompt_waits_while_a_user_waits_for_a_first_token():
    users = UserLoad()
    gate = TrainingGate(users)
    users.begin()  # a user's request: waiting for its first token
    entered = asyncio.create_task(gate.enter())
    await settle()
    assert not entered.done()
    users.first_token()  # streaming now: it waits no more
    await asyncio.wait_for(entered, 1)
    gate.leave()
    users.end(True)


async def test_training_prompts_enter_one_at_a_time():
    gate = TrainingGate(UserLoad())
    await gate.enter()
    second = asyncio.create_task(gate.enter())
    await settle()
    assert not second.done()  # the first one's prefill is not done
    gate.leave()
    await asyncio.wait_for(second, 1)
    gate.leave()


async def test_a_user_who_comes_while_a_prompt_waits_keeps_it_waiting():
    users = UserLoad()
    gate = TrainingGate(users)
    await gate.enter()
    queued = asyncio.create_task(gate.enter())
    users.begin()  # a user arrives while the next training prompt waits for its turn
    gate.leave()
    await settle()
    assert not queued.done()
    users.end(False)  # the user's call failed before a token: it waits no more either
    await asyncio.wait_for(queued, 1)
    gate.leave()


async def test_a_cancelled_wait_gives_the_turn_on():
    users = UserLoad()
    gate = TrainingGate(users)
    users.begin()
    waiting = asyncio.create_task(gate.enter())
    await settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    users.first_token()
    await asyncio.wait_for(gate.enter(), 1)  # the cancelled one did not keep the turn
    gate.leave()
