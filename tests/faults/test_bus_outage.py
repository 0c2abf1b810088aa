"""The bus's own bounds, against a real nats-server: closing does not wait out nats-py's drain
timeout, and connecting to nothing fails within its bound instead of retrying forever."""

from __future__ import annotations

import asyncio
import time

import pytest

from hotloop import bus as hbus
from hotloop.proto.v1 import bus_pb2


async def test_close_after_a_consumer_waited_for_messages_is_prompt(nats_server):
    b = await hbus.Bus.connect(nats_server.url, "closer")
    await b.ensure_streams()
    consumer = await b.pull("FEEDBACK", hbus.FEEDBACK, "closer", bus_pb2.FeedbackEvent)
    for _ in range(4):  # a trainer waiting for feedback: each pull request expires unanswered
        assert await consumer.fetch(4, 0.3) == []
    await b.js_publish(hbus.FEEDBACK, bus_pb2.FeedbackEvent(response_id="r", score=1.0))
    (m,) = await consumer.fetch(4, 1.0)
    await m.ack()
    t0 = time.monotonic()
    await b.close()
    # nats-py leaves the late expiry notices of those requests un-done in the subscription's
    # queue, and a drain waits for them for its whole timeout (30 s by default)
    assert time.monotonic() - t0 < 2.0
    assert b.nc.is_closed
    check = await hbus.Bus.connect(nats_server.url, "check")
    info = await check.js.consumer_info("FEEDBACK", "closer")
    await check.close()
    assert info.num_ack_pending == 0 and info.num_pending == 0  # the ack left before the close


async def test_connecting_to_nothing_fails_within_its_bound():
    t0 = time.monotonic()
    with pytest.raises(hbus.BusError, match="no NATS server answered"):
        await asyncio.wait_for(hbus.Bus.connect("nats://127.0.0.1:1", "nobody", timeout_s=1.0), 20)
    assert time.monotonic() - t0 < 3.0
