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
