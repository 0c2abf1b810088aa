"""The gateway's only rollout replica goes away and comes back: real gateway (HTTP with the
official openai client, gRPC), real NATS, and the scripted rollout replica over real gRPC
(tests/gateway/fake_rollout.py), stopped and restarted on its address."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import openai
import pytest

from hotloop.proto.v1 import common_pb2, gateway_pb2
from tests.gateway.conftest import KEY, start_gateway
from tests.gateway.fake_rollout import start_fake

pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "hi"}]
# gRPC's default reconnect backoff (1 s, x1.6 per failed connect, jitter 20%) puts the channel's
# connects near 0, 1, 2.6, 5.2, 9.3 (at most 11.1) and 15.8 (at least 12.6) s into an outage: a
# replica back at 11 s would be seen over a second later at best, after 2 minutes down up to 2
# minutes later. The routing is what is under test, so the replica is the scripted one.
DOWN_S = 11.0


async def grpc_generate(gw):
    ch, stub = gw.stub()
    try:
        return [c async for c in stub.Generate(gateway_pb2.UserGenerateRequest(
            messages=[common_pb2.ChatMessage(role="user", content="hi")]),
            metadata=(("authorization", f"Bearer {KEY}"),))]
    finally:
        await ch.close()


async def test_the_only_replica_down_is_a_clear_503_and_users_recover_when_it_returns(nats_server):
    _, server, addr = await start_fake(version=4)
    gw = await start_gateway([addr], nats_server.url)  # health polled every 0.2 s
    client = gw.openai()
    try:
        r = await client.chat.completions.create(model="tiny", messages=HI)
        assert r.model_extra["policy_version"] == 4

        await server.stop(0)  # the replica's process is gone
        async with httpx.AsyncClient() as http:
            resp = await http.post(f"{gw.base_url}/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                                   json={"model": "tiny", "messages": HI})
        assert resp.status_code == 503
        err = resp.json()["error"]  # OpenAI's error shape
        assert err["type"] == "server_error" and err["code"] == "service_unavailable"
        assert "no healthy rollout replica" in err["message"] and addr in err["message"]
        with pytest.raises(openai.APIStatusError) as e:
            await client.chat.completions.create(model="tiny", messages=HI, stream=True)
        assert e.value.status_code == 503
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await grpc_generate(gw)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        await asyncio.sleep(DOWN_S)  # the gateway keeps polling the dead address meanwhile

        _, server, back = await start_fake(addr, version=5)  # restarted, with a newer version
        assert back == addr
        returned = time.monotonic()
        while True:
            try:
                r = await client.chat.completions.create(model="tiny", messages=HI)
                break
            except openai.APIStatusError as refused:
                assert refused.status_code == 503
                assert time.monotonic() - returned < 30, "the gateway never saw the replica return"
                await asyncio.sleep(0.05)
        recovered_s = time.monotonic() - returned
        assert r.model_extra["policy_version"] == 5
        assert (await grpc_generate(gw))[-1].policy_version == 5
        # A poll every 0.2 s finds it (about 0.5 s with the channel's 250 ms backoff cap); a
        # channel waiting out gRPC's default backoff would not before 12.6 s into the outage,
        # 1.6 s after the return. The bound sits just under that, as far from the expected
        # time as it can be while still telling the two apart.
        assert recovered_s < 1.5, f"users were refused for {recovered_s:.1f}s after the replica returned"
    finally:
        await gw.stop()
        await server.stop(0)
