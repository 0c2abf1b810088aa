"""`UserLoad`: the rollout's count of users' requests in flight and waiting for a first
token, and its watchers (plain class, no engine)."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.core import UserLoad

pytestmark = pytest.mark.asyncio


async def test_counts_follow_a_request_through_its_first_token():
    load = UserLoad()
    load.begin()
    load.begin()
    assert load.snapshot() == (2, 2)
    load.first_token()
    assert load.snapshot() == (2, 1)
    load.end(got_first_token=True)
    load.end(got_first_token=False)  # failed before its first token: no longer waiting
    assert load.snapshot() == (0, 0)


async def test_watch_reports_now_then_each_change_coalesced():
    load = UserLoad()
    watch = load.watch()
    assert await anext(watch) == (0, 0)
    load.begin()
    assert await asyncio.wait_for(anext(watch), 1) == (1, 1)
    load.first_token()
    load.end(got_first_token=True)  # two changes before the watcher reads: it sees the latest
    assert await asyncio.wait_for(anext(watch), 1) == (0, 0)
    nothing = asyncio.ensure_future(anext(watch))
    await asyncio.sleep(0.05)
    assert not nothing.done()  # no change, no message
    load.begin()
    assert await asyncio.wait_for(nothing, 1) == (1, 1)
    await watch.aclose()
    assert not load.watchers  # a closed watcher is forgotten
