"""A replica whose process freezes (alive, its connections open, silent): its callers find out
from their keepalive pings (`[grpc]`, `hotloop.grpcutil.client_options`) instead of waiting
until the kernel drops the connection, a quarter of an hour later.

Real processes: two `python -m services.reward`, one stopped with SIGSTOP (a frozen process as
its peers see one: the kernel still holds and accepts its connections, nothing answers). The
callers are the balanced client a GRPO job uses (`hotloop.replicas.Rewards`) and the
one-replica client (`hotloop.clients.RewardClient`)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotloop import grpcutil
from hotloop.clients import RewardClient, ScoreItem
from hotloop.config import GrpcConfig
from hotloop.errors import Unavailable
from hotloop.replicas import Rewards
from tests.procs import freeze

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
LIVENESS = GrpcConfig(keepalive_s=1, keepalive_timeout_s=1, connect_timeout_s=2)
# A call on the frozen replica fails after the ping interval and its timeout (2 s); gRPC's
# own retry then reconnects, and the kernel's accept leaves the handshake to time out (2 s).
# Wide for a loaded machine; without the pings the calls wait for ever.
BOUND_S = 20.0
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"


def items(n: int, prefix: str = "") -> list[ScoreItem]:
    return [ScoreItem(id=f"{prefix}{i}", prompt="p", completion=GOOD if i % 2 == 0 else "nope",
                      entry_point="add", test_cases=["assert add(1, 2) == 3"]) for i in range(n)]


def expected(n: int) -> list[float]:
    return [1.0 if i % 2 == 0 else 0.0 for i in range(n)]


@pytest.fixture
def liveness():
    previous = grpcutil.configure(LIVENESS)
    yield
    grpcutil.configure(previous)


@pytest.fixture
def reward_services(tmp_path):
    """Start two reward services; yields (addresses, processes)."""
    procs, files = [], []
    for i in range(2):
        port_file = tmp_path / f"reward{i}.json"
        with open(tmp_path / f"reward{i}.log", "wb") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "services.reward", "--port-file", str(port_file),
                 "--set", f"run_dir={tmp_path / f'run{i}'}",
                 "--set", "reward.sandbox.isolation=process", "--set", "reward.metrics_port=-1"],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err))
        files.append(port_file)
    try:
        deadline = time.monotonic() + 120
        while not all(f.exists() for f in files):
            assert all(p.poll() is None for p in procs), \
                [(tmp_path / f"reward{i}.log").read_text()[-2000:] for i in range(2)]
            assert time.monotonic() < deadline, "the reward services did not start"
            time.sleep(0.1)
        yield [f"127.0.0.1:{json.loads(f.read_text())['port']}" for f in files], procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


async def timed(coro):
    t0 = time.monotonic()
    result = await asyncio.wait_for(coro, timeout=BOUND_S * 3)
    return result, time.monotonic() - t0


async def test_a_frozen_replica_has_its_work_moved_to_the_other(liveness, reward_services):
    addresses, procs = reward_services
    rewards = Rewards.connect(addresses)
    try:
        # both answer; a stream left idle with pings going (every 1 s: 4 of them) is not cut
        # by the server as a ping flood
        first = await rewards.score(items(6))
        assert [s.reward for s in first] == expected(6)
        assert all(rewards.stats[a].answered for a in addresses)
        gate = asyncio.Event()

        async def slow_items():
            yield items(1, "idle-")[0]
            await gate.wait()
            yield items(2, "idle-")[1]

        async def after_a_pause():
            await asyncio.sleep(4.5)
            gate.set()

        waker = asyncio.create_task(after_a_pause())
        idle = [s async for s in rewards.score_each(slow_items())]
        await waker
        assert sorted((s.id, s.reward) for s in idle) == [("idle-0", 1.0), ("idle-1", 0.0)]
        assert not any(st.failed_calls for st in rewards.stats.values()), rewards.stats

        await freeze(procs[1].pid)
        # a batch: the frozen replica's chunk is re-run on the other
        scores, took = await timed(rewards.score(items(8)))
        assert [s.reward for s in scores] == expected(8)
        assert took < BOUND_S, took
        frozen = rewards.stats[addresses[1]]
        assert frozen.failed_calls == 1 and frozen.resent >= 1, frozen
        assert f"reward at {addresses[1]} is unavailable" in frozen.last_error, frozen

        async def stream():
            for it in items(8, "s-"):
                yield it

        # a stream, with the frozen replica tried again (its cool-down set aside): each item
        # answered once, by the live one
        rewards.cooldown_s = 0.0
        answered, took = await timed(_collect(rewards.score_each(stream())))
        assert sorted(s.id for s in answered) == sorted(f"s-{i}" for i in range(8))
        assert {s.id: s.reward for s in answered} == {f"s-{i}": r for i, r in enumerate(expected(8))}
        assert took < BOUND_S, took
    finally:
        await rewards.close()


async def test_a_call_to_the_only_service_frozen_fails_with_a_clear_error(liveness, reward_services):
    addresses, procs = reward_services
    client = RewardClient(addresses[0])
    try:
        assert [s.reward for s in await client.score(items(2))] == expected(2)
        await freeze(procs[0].pid)
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match=f"reward at {addresses[0]}"):
            await asyncio.wait_for(client.score(items(2)), timeout=BOUND_S * 3)
        # the client's attempts, each a reconnect that times out: bounded, not for ever
        assert time.monotonic() - t0 < BOUND_S * 2
    finally:
        await client.close()


async def _collect(it):
    return [x async for x in it]
