"""A service that is down fails the call after bounded retries with an error naming it
(the GRPO step then fails; it never becomes a silent zero reward)."""

import socket
import time

import pytest

from hotloop.clients import ReferenceClient, RewardClient, ScoreItem
from hotloop.errors import Unavailable


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_reward_down_is_a_clear_bounded_failure():
    client = RewardClient(f"127.0.0.1:{_unused_port()}")
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="reward at 127.0.0.1"):
        await client.score([ScoreItem(id="1", prompt="p", completion="c", tests="assert True")])
    assert time.monotonic() - t0 < 30
    await client.close()


async def test_reference_down_is_a_clear_bounded_failure():
    client = ReferenceClient(f"127.0.0.1:{_unused_port()}")
    with pytest.raises(Unavailable, match="reference"):
        await client.logprobs([([1, 2], [3])])
    await client.close()


async def test_score_each_answers_before_the_input_ends():
    """The streaming call hands out each score while the caller still holds the next item
    back: asynchronous GRPO scores a group while the engine generates the rest."""
    import asyncio

    from services.reward.config import RewardConfig, SandboxConfig
    from services.reward.core import RewardCore
    from services.reward.server import serve

    core = RewardCore.from_config(RewardConfig(concurrency=2, sandbox=SandboxConfig(
        wall_seconds=3.0, cpu_seconds=2, memory_mb=256)))
    server, port, _ = await serve(core, "127.0.0.1:0")
    client = RewardClient(f"127.0.0.1:{port}")
    gate: asyncio.Queue = asyncio.Queue()
    good = "```python\ndef add(a, b):\n    return a + b\n```"

    async def items():
        for i in range(3):
            if (await gate.get()) is None:
                return
            yield ScoreItem(id=str(i), prompt="p", completion=good if i != 1 else "nope",
                            entry_point="add", test_cases=["assert add(1, 2) == 3"])

    try:
        got = []
        await gate.put(True)
        async for s in client.score_each(items()):
            got.append((s.id, s.reward))
            await gate.put(True if len(got) < 3 else None)  # the next item only after this result
        assert got == [("0", 1.0), ("1", 0.0), ("2", 1.0)]
    finally:
        await client.close()
        await server.stop(None)
        await core.close()


async def test_logprobs_each_matches_the_batch_call(tiny_model):
    from services.reference.config import ReferenceConfig
    from services.reference.core import ReferenceCore
    from services.reference.server import serve

    core = ReferenceCore(ReferenceConfig(model=str(tiny_model), dtype="float32", token_budget=256))
    server, port, _ = await serve(core, "127.0.0.1:0")
    client = ReferenceClient(f"127.0.0.1:{port}")
    pairs = [([5, 6, 7], [8, 9]), ([11], [12, 13, 14]), ([3, 4], [])]

    async def each():
        for i, (p, c) in enumerate(pairs):
            yield f"s{i}", p, c

    try:
        streamed = {i: lp async for i, lp in client.logprobs_each(each())}
        batch = await client.logprobs(pairs)
        assert set(streamed) == {"s0", "s1", "s2"}
        for i, lp in enumerate(batch):
            assert streamed[f"s{i}"] == pytest.approx(lp, abs=1e-5) and len(lp) == len(pairs[i][1])
    finally:
        await client.close()
        await server.stop(None)


async def test_streams_to_a_service_that_is_down_name_it():
    async def none():
        return
        yield

    client = RewardClient(f"127.0.0.1:{_unused_port()}")
    with pytest.raises(Unavailable, match="reward at 127.0.0.1"):
        async for _ in client.score_each(none()):
            pass
    await client.close()
