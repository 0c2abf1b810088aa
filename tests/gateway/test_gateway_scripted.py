"""The gateway end to end (HTTP with the official openai client, gRPC, real NATS) against a
scripted rollout replica: exact tokens, and failures on cue (refusals, stalls, a replica
stopped mid-stream). No engine, so these run in seconds; test_gateway_engine.py repeats the
main paths against a real vLLM rollout."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from hotloop import bus as hbus
from hotloop.proto.v1 import bus_pb2, common_pb2, gateway_pb2
from tests.scrape import parse

from .conftest import ADMIN_TOKEN, ANON_KEY, KEY, OTHER_KEY, operator_headers, start_gateway
from .fake_rollout import PROMPT_IDS, WORDS, start_fake

pytestmark = pytest.mark.asyncio(loop_scope="module")
TEXT = "".join(WORDS)
HI = [{"role": "user", "content": "hi"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(nats_module):
    fake, server, addr = await start_fake(version=3)
    gw = await start_gateway([addr], nats_module.url, admin_token=ADMIN_TOKEN)
    yield fake, gw
    await gw.stop()
    await server.stop(0)


def headers(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def test_chat_whole_carries_response_id_and_policy_version(rig):
    fake, gw = rig
    raw = await gw.openai().chat.completions.with_raw_response.create(model="tiny", messages=HI, max_tokens=8)
    r = raw.parse()
    assert r.choices[0].message.content == TEXT
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(PROMPT_IDS) and r.usage.completion_tokens == len(WORDS)
    assert raw.headers["x-hotloop-response-id"] == r.id and r.id.startswith("chatcmpl-")
    assert raw.headers["x-hotloop-policy-version"] == "3"
    assert r.model_extra["policy_version"] == 3
    req = fake.requests[-1]
    assert req.stream and req.return_prompt_ids and req.priority == 0
    assert [m.content for m in req.prompts[0].chat.messages] == ["hi"]


async def test_chat_stream_n2_logprobs_and_usage(rig):
    fake, gw = rig
    stream = await gw.openai().chat.completions.create(
        model="tiny", messages=HI, n=2, max_tokens=3, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True})
    texts, finish, tokens, versions, rid = {0: "", 1: ""}, {}, {0: [], 1: []}, set(), set()
    usage = None
    async for chunk in stream:
        rid.add(chunk.id)
        versions.add(chunk.model_extra["policy_version"])
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.logprobs:
                tokens[c.index] += c.logprobs.content
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {0: "Hello there,", 1: "Hello there,"}
    assert finish == {0: "length", 1: "length"}
    assert len(rid) == 1 and versions == {3}
    assert [t.token for t in tokens[0]] == WORDS[:3]
    assert [len(t.top_logprobs) for t in tokens[1]] == [2, 2, 2]
    assert tokens[0][1].logprob == pytest.approx(-1.5)
    assert usage.completion_tokens == 6 and usage.prompt_tokens == len(PROMPT_IDS)
    assert fake.requests[-1].sampling.top_logprobs == 2


async def test_logprobs_without_alternatives_still_name_tokens(rig):
    fake, gw = rig
    r = await gw.openai().chat.completions.create(model="tiny", messages=HI, max_tokens=2, logprobs=True)
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == WORDS[:2] and all(t.top_logprobs == [] for t in content)
    assert fake.requests[-1].sampling.top_logprobs == 1  # asked for token texts, trimmed


async def test_completions_whole_and_stream(rig):
    _, gw = rig
    client = gw.openai()
    r = await client.completions.create(model="tiny", prompt=["a", "b"], n=2, max_tokens=4, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text == "Hello there, friend" for c in r.choices)
    assert r.choices[0].logprobs.text_offset == [0, 5, 11, 12]
    assert r.usage.prompt_tokens == 2 * len(PROMPT_IDS)
    assert r.id.startswith("cmpl-") and r.model_extra["policy_version"] == 3
    text = ""
    async for chunk in await client.completions.create(model="tiny", prompt="a", max_tokens=16, stream=True):
        text += chunk.choices[0].text
        last = chunk.choices[0].finish_reason
    assert text == TEXT and last == "stop"


async def test_sse_wire_format(rig):
    _, gw = rig
    async with httpx.AsyncClient() as http:
        async with http.stream("POST", f"{gw.base_url}/chat/completions", headers=headers(),
                               json={"model": "tiny", "messages": HI, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-hotloop-policy-version"] == "3"
            body = (await r.aread()).decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    first = json.loads(events[0].removeprefix("data: "))
    assert first["choices"][0]["delta"]["role"] == "assistant" and first["policy_version"] == 3


async def test_models_and_unknown_model(rig):
    _, gw = rig
    client = gw.openai()
    assert [m.id async for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="gpt-4", messages=HI)
    assert e.value.body["code"] == "model_not_found"


async def test_missing_or_wrong_key_is_401(rig):
    _, gw = rig
    with pytest.raises(openai.AuthenticationError) as e:
        await gw.openai(key="sk-wrong-key-000000").chat.completions.create(model="tiny", messages=HI)
    assert set(e.value.body) == {"message", "type", "param", "code"}
    async with httpx.AsyncClient() as http:  # the openai client refuses to send no key at all
        for path, auth in (("/models", {}), ("/chat/completions", {}),
                           ("/chat/completions", {"Authorization": KEY})):
            r = await http.request("GET" if path == "/models" else "POST", f"{gw.base_url}{path}",
                                   headers=auth, json={"model": "tiny", "messages": HI})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    ch, stub = gw.stub()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        [c async for c in stub.Generate(gateway_pb2.UserGenerateRequest(
            messages=[common_pb2.ChatMessage(role="user", content="hi")]))]
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.SubmitFeedback(gateway_pb2.Feedback(response_id="x", label="up"),
                                  metadata=(("authorization", "Bearer nope-nope-nope"),))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await ch.close()


@pytest.mark.parametrize("body,status,param", [
    ({"messages": HI, "n": 0}, 400, "n"),
    ({"messages": HI, "n": 9}, 400, "n"),
    ({"messages": HI, "max_tokens": 5000}, 400, "max_tokens"),
    ({"messages": HI, "temperature": 3}, 400, "temperature"),
    ({"messages": HI, "temperature": 0, "n": 2}, 400, "n"),
    ({"messages": HI, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    ({"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x" * 40000}]}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": HI, "n": "many"}, 400, "n"),
    ({}, 400, None),
])
async def test_bad_chat_requests_are_4xx_and_serving_continues(rig, body, status, param):
    _, gw = rig
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{gw.base_url}/chat/completions", headers=headers(), json={"model": "tiny", **body})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if param:
            assert err["param"] == param
    assert (await gw.openai().chat.completions.create(model="tiny", messages=HI)).choices[0].message.content == TEXT


async def test_malformed_json_oversized_body_and_bad_completions(rig):
    _, gw = rig
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{gw.base_url}/chat/completions", headers={**headers(), "content-type": "application/json"},
                            content=b'{"model": "tiny", "messages": [')
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = await http.post(f"{gw.base_url}/chat/completions", headers=headers(), content=b"x" * (2 << 20))
        assert r.status_code == 413
        for body in ({"prompt": ""}, {"prompt": [1, 2, 3]}, {"prompt": "a", "echo": True}):
            r = await http.post(f"{gw.base_url}/completions", headers=headers(), json={"model": "tiny", **body})
            assert r.status_code == 400, body
        r = await http.get(f"{gw.base_url}/nope", headers=headers())
        assert r.status_code == 404 and "error" in r.json()
    assert (await gw.openai().completions.create(model="tiny", prompt="a")).choices[0].text == TEXT


async def test_replica_refusal_reaches_the_user_as_400(rig):
    fake, gw = rig
    fake.refuse = (grpc.StatusCode.INVALID_ARGUMENT, "prompt 0 has 900 tokens; at most 200")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            await gw.openai().chat.completions.create(model="tiny", messages=HI)
        assert "at most 200" in e.value.message
    finally:
        fake.refuse = None
    assert gw.core.router.states[0].healthy, "a refused request must not mark the replica down"


async def traffic(gw, rid: str, choice: int, timeout_s: float = 5.0) -> bus_pb2.TrafficEvent:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (ev := await gw.bus.traffic(rid, choice)) is None:
        assert asyncio.get_running_loop().time() < deadline, f"no traffic for {rid}:{choice}"
        await asyncio.sleep(0.05)
    return ev


async def test_each_served_choice_is_forked_to_traffic(rig):
    fake, gw = rig
    fake.swap_at = 2
    try:
        r = await gw.openai().chat.completions.create(model="tiny", messages=HI, n=2, max_tokens=4, temperature=0.7)
    finally:
        fake.swap_at = None
    for choice in (0, 1):
        ev = await traffic(gw, r.id, choice)
        assert ev.response_id == r.id and ev.choice == choice
        assert list(ev.prompt_ids) == PROMPT_IDS
        assert list(ev.completion_ids) == [1000, 1001, 1002, 1003]
        assert len(ev.logprobs) == 4 and ev.logprobs[1] == pytest.approx(-1.5)
        assert ev.user == "alice" and KEY not in ev.SerializeToString().decode(errors="ignore")
        assert ev.policy_version == 3
        assert [(s.version, s.first_token) for s in ev.version_spans] == [(3, 0), (4, 2)]
        assert ev.temperature == pytest.approx(0.7) and ev.finish_reason == "length"
        assert ev.served_at > 0
    # the chunk's version is the newest of its tokens; the header stays the admission version
    assert r.choices[0].model_extra["policy_version"] == 4 and r.model_extra["policy_version"] == 3
    assert await gw.bus.traffic(r.id, 2) is None


async def post_feedback(gw, key=KEY, **body) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(f"{gw.base_url}/feedback", headers=headers(key), json=body)


async def test_feedback_accepted_deduplicated_and_refused(rig):
    _, gw = rig
    r = await gw.openai().chat.completions.create(model="tiny", messages=HI, n=2)
    ok = await post_feedback(gw, response_id=r.id, score=0.5, text="nice")
    assert ok.status_code == 200 and ok.json() == {"accepted": True, "reason": "", "response_id": r.id, "choice": 0}
    dup = await post_feedback(gw, response_id=r.id, label="down")
    assert dup.status_code == 200 and dup.json()["reason"] == "duplicate"
    assert (await post_feedback(gw, response_id=r.id, choice=1, label="up")).json()["reason"] == ""
    cases = [
        (dict(response_id="chatcmpl-unknown", score=1), 404, "unknown"),
        (dict(response_id=r.id, score=1.5), 400, "[-1, 1]"),
        (dict(response_id=r.id, score=1, label="up"), 400, "exactly one"),
        (dict(response_id=r.id), 400, "exactly one"),
        (dict(response_id=r.id, label="meh"), 400, "label"),
        (dict(response_id=r.id, score=1, choice=2), 400, "out of range"),
        (dict(response_id="a.b.>", score=1), 404, "unknown"),
    ]
    for body, status, needle in cases:
        resp = await post_feedback(gw, **body)
        assert resp.status_code == status, (body, resp.text)
        assert needle in resp.json()["error"]["message"]
    # NaN is valid JSON for Python's parser; the gateway still refuses it
    async with httpx.AsyncClient() as http:
        resp = await http.post(f"{gw.base_url}/feedback", headers={**headers(), "content-type": "application/json"},
                               content=f'{{"response_id": "{r.id}", "score": NaN}}'.encode())
    assert resp.status_code == 400
    # another key cannot rate alice's response
    assert (await post_feedback(gw, key=OTHER_KEY, response_id=r.id, score=1)).status_code == 404
    # what reached FEEDBACK: choice 0 once (the duplicate was dropped by JetStream), choice 1 once
    consumer = await gw.bus.pull("FEEDBACK", hbus.FEEDBACK, "test-feedback", bus_pb2.FeedbackEvent)
    got = [m.payload for m in await consumer.fetch(100, 2) if m.payload.response_id == r.id]
    assert sorted((f.choice, f.score, f.user) for f in got) == [(0, 0.5, "alice"), (1, 1.0, "alice")]
    assert got[0].text == "nice" and got[0].received_at > 0
    status = gw.core.status()["counters"]
    assert status["feedback_duplicate"] >= 1 and status["feedback_rejected"] >= len(cases) + 2


async def test_grpc_generate_and_feedback(rig):
    _, gw = rig
    ch, stub = gw.stub()
    md = (("authorization", f"Bearer {ANON_KEY}"),)
    chunks = [c async for c in stub.Generate(gateway_pb2.UserGenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content="hi")], max_tokens=3), metadata=md)]
    assert "".join(c.delta for c in chunks) == "Hello there,"
    assert len({c.response_id for c in chunks}) == 1 and all(c.policy_version == 3 for c in chunks)
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 3
    assert chunks[-1].prompt_tokens == len(PROMPT_IDS)
    rid = chunks[0].response_id
    ev = await traffic(gw, rid, 0)
    assert ev.user.startswith("key-") and ev.user not in ANON_KEY
    ack = await stub.SubmitFeedback(gateway_pb2.Feedback(response_id=rid, score=-1.0), metadata=md)
    assert ack.accepted and ack.reason == ""
    ack = await stub.SubmitFeedback(gateway_pb2.Feedback(response_id=rid, score=-1.0), metadata=md)
    assert ack.accepted and ack.reason == "duplicate"
    for fb in (gateway_pb2.Feedback(response_id=rid, score=float("nan")),
               gateway_pb2.Feedback(response_id=rid, score=2.0),
               gateway_pb2.Feedback(response_id="nope", label="up"),
               gateway_pb2.Feedback(response_id=rid, label="up", choice=1)):
        ack = await stub.SubmitFeedback(fb, metadata=md)
        assert not ack.accepted and ack.reason, fb
    with pytest.raises(grpc.aio.AioRpcError) as e:
        [c async for c in stub.Generate(gateway_pb2.UserGenerateRequest(), metadata=md)]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await ch.close()


async def test_restarted_gateway_takes_feedback_on_forked_traffic(rig, nats_module):
    fake, gw = rig
    r = await gw.openai().chat.completions.create(model="tiny", messages=HI)
    await traffic(gw, r.id, 0)
    fresh = await start_gateway([gw.core.router.states[0].replica.address], nats_module.url)
    try:
        assert len(fresh.core.responses) == 0
        assert (await post_feedback(fresh, response_id=r.id, label="up")).status_code == 200
        assert (await post_feedback(fresh, key=OTHER_KEY, response_id=r.id, label="up")).status_code == 404
        assert "not served" in (await post_feedback(fresh, response_id=r.id, label="up", choice=1)).json()["error"]["message"]
    finally:
        await fresh.stop()


async def test_status_and_metrics(rig):
    """Counted from this test's own requests (the rig is shared: other tests' counts differ
    with the order they ran in)."""
    _, gw = rig
    metrics_url = f"http://127.0.0.1:{gw.http.port}/metrics"
    async with httpx.AsyncClient() as http:
        # the counters and /metrics are the operator's (every tenant's traffic): admin token
        before_status = (await http.get(f"{gw.base_url}/hotloop/status", headers=operator_headers())).json()
        before = parse((await http.get(metrics_url, headers=operator_headers())).text)
        assert (await http.get(f"{gw.base_url}/hotloop/status")).status_code == 401
        await gw.openai().chat.completions.create(model="tiny", messages=HI, max_tokens=8)
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # the traffic record is published after the answer, off the request's path
            s = (await http.get(f"{gw.base_url}/hotloop/status", headers=operator_headers())).json()
            if s["counters"]["traffic_published"] > before_status["counters"]["traffic_published"]:
                break
            assert asyncio.get_running_loop().time() < deadline, s["counters"]
            await asyncio.sleep(0.05)
        m = (await http.get(metrics_url, headers=operator_headers())).text
        mine = (await http.get(f"{gw.base_url}/hotloop/status", headers=headers())).json()
    assert s["replicas"][0]["healthy"] and mine["replicas"][0]["healthy"]
    assert s["counters"]["unauthenticated"] == before_status["counters"]["unauthenticated"] + 1
    unauth = ("hotloop_gateway_request_errors_total", {"code": "unauthenticated"})
    assert parse(m).value(unauth[0], **unauth[1]) == before.value(unauth[0], **unauth[1]) + 1
    assert parse(m).value("hotloop_gateway_traffic_dropped_total") == 0
    assert KEY not in json.dumps(s) + m


async def test_full_traffic_queue_drops_and_counts(rig):
    from services.gateway.events import BusEvents
    from services.gateway.types import ServedChoice

    _, gw = rig
    events = BusEvents(gw.bus, queue_size=1)  # not started: nothing drains the queue
    assert events.fork(ServedChoice("r1", 0, "alice")) is not None
    assert events.fork(ServedChoice("r2", 0, "alice")) is None
    assert events.counters.dropped == 1 and events.counters.forked == 1


async def test_deadline_is_504(nats_module):
    fake, server, addr = await start_fake()
    fake.stall = True
    gw = await start_gateway([addr], nats_module.url, request_timeout_s=0.5)
    try:
        with pytest.raises(openai.APIStatusError) as e:
            await gw.openai().chat.completions.create(model="tiny", messages=HI)
        assert e.value.status_code == 504
        assert gw.core.status()["counters"]["deadline_exceeded"] == 1
    finally:
        await gw.stop()
        await server.stop(0)


async def test_no_healthy_replica_is_503(nats_module):
    fake, server, addr = await start_fake()
    await server.stop(0)  # nothing listens there any more
    gw = await start_gateway([addr], nats_module.url)
    try:
        with pytest.raises(openai.APIStatusError) as e:
            await gw.openai().chat.completions.create(model="tiny", messages=HI)
        assert e.value.status_code == 503 and "no healthy rollout replica" in e.value.message
        ch, stub = gw.stub()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [c async for c in stub.Generate(gateway_pb2.UserGenerateRequest(
                messages=[common_pb2.ChatMessage(role="user", content="hi")]),
                metadata=(("authorization", f"Bearer {KEY}"),))]
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        await ch.close()
    finally:
        await gw.stop()


async def test_no_user_is_served_by_a_replica_behind_the_newest_version(nats_module):
    """Two replicas, one a version behind: users get the newest; when only the stale one is
    left, a clean 503 / UNAVAILABLE saying why, not an answer from the older policy; once it
    has caught up, it serves."""
    _, fresh_server, fresh_addr = await start_fake(version=4)
    stale, stale_server, stale_addr = await start_fake(version=3)
    gw = await start_gateway([fresh_addr, stale_addr], nats_module.url)  # max_version_lag 0
    try:
        client = gw.openai()
        rs = await asyncio.gather(*(client.chat.completions.create(model="tiny", messages=HI)
                                    for _ in range(4)))
        assert [r.model_extra["policy_version"] for r in rs] == [4] * 4
        assert stale.requests == []
        assert gw.core.servable_replicas() == [fresh_addr]

        await fresh_server.stop(0)
        with pytest.raises(openai.APIStatusError) as e:
            await client.chat.completions.create(model="tiny", messages=HI)
        assert e.value.status_code == 503
        assert f"{stale_addr}: serves v3, 1 behind the newest v4 (max_version_lag 0)" in e.value.message
        ch, stub = gw.stub()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [c async for c in stub.Generate(gateway_pb2.UserGenerateRequest(
                messages=[common_pb2.ChatMessage(role="user", content="hi")]),
                metadata=(("authorization", f"Bearer {KEY}"),))]
        await ch.close()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "behind the newest v4" in e.value.details()
        assert stale.requests == [] and gw.core.servable_replicas() == []
        # readiness agrees with routing: a healthy but stale replica cannot serve
        async with httpx.AsyncClient() as http:
            ready = await http.get(gw.base_url.removesuffix("/v1") + "/ready")
        assert ready.status_code == 503 and "behind the newest v4" in ready.json()["reason"]
        status = gw.core.status()
        assert status["newest_version"] == 4
        assert {r["address"]: r["version_lag"] for r in status["replicas"]}[stale_addr] == 1

        stale.version = 4  # caught up: the next poll lets it serve
        deadline = asyncio.get_running_loop().time() + 10
        while gw.core.servable_replicas() != [stale_addr]:
            assert asyncio.get_running_loop().time() < deadline, gw.core.status()
            await asyncio.sleep(0.05)
        r = await client.chat.completions.create(model="tiny", messages=HI)
        assert r.model_extra["policy_version"] == 4
    finally:
        await gw.stop()
        await stale_server.stop(0)


async def test_replica_failing_before_the_first_token_is_routed_around(nats_module):
    bad, bad_server, bad_addr = await start_fake()
    good, good_server, good_addr = await start_fake(version=7)
    bad.refuse = (grpc.StatusCode.UNAVAILABLE, "engine restarting")
    gw = await start_gateway([bad_addr, good_addr], nats_module.url, routing="round_robin",
                             max_version_lag=10)  # both may serve: the refusal is under test
    try:
        for _ in range(3):
            r = await gw.openai().chat.completions.create(model="tiny", messages=HI)
            assert r.model_extra["policy_version"] == 7
        assert gw.core.metrics.rerouted >= 1
    finally:
        await gw.stop()
        await bad_server.stop(0)
        await good_server.stop(0)


async def test_least_loaded_spreads_concurrent_requests(nats_module):
    fakes = [await start_fake(version=v, delay_s=0.05) for v in (1, 2)]  # versions tell them apart
    gw = await start_gateway([a for _, _, a in fakes], nats_module.url, max_version_lag=1)
    try:
        client = gw.openai()
        rs = await asyncio.gather(*(client.chat.completions.create(model="tiny", messages=HI) for _ in range(4)))
        assert sorted(r.model_extra["policy_version"] for r in rs) == [1, 1, 2, 2]
    finally:
        await gw.stop()
        for _, server, _ in fakes:
            await server.stop(0)


async def test_replica_stopped_mid_stream_ends_the_stream_with_an_error(nats_module):
    fake, server, addr = await start_fake(delay_s=0.3)
    gw = await start_gateway([addr], nats_module.url)
    try:
        stream = await gw.openai().chat.completions.create(model="tiny", messages=HI, stream=True)
        got, finish = [], []

        async def read():
            async for chunk in stream:
                got.extend(c.delta.content for c in chunk.choices)
                finish.extend(c.finish_reason for c in chunk.choices if c.finish_reason)

        reader = asyncio.create_task(read())
        await fake.sent.wait()
        await server.stop(0)  # the replica dies with the response half sent
        with pytest.raises(openai.APIError) as e:
            await reader
        assert "failed" in e.value.message or "ended the stream" in e.value.message
        assert 0 < len(got) < len(WORDS) and finish == []
        assert not gw.core.router.states[0].healthy
        r = await gw.bus.traffic(stream.response.headers["x-hotloop-response-id"], 0)
        assert r is None, "an unfinished choice must not be forked to training"
        resp = await post_feedback(gw, response_id=stream.response.headers["x-hotloop-response-id"], score=1)
        assert resp.status_code == 400 and "did not finish" in resp.json()["error"]["message"]
    finally:
        await gw.stop()



async def test_feedback_is_published_only_after_its_traffic_is_stored(rig):
    _, gw = rig
    for _ in range(5):
        r = await gw.openai().chat.completions.create(model="tiny", messages=HI)
        assert (await post_feedback(gw, response_id=r.id, label="up")).status_code == 200
        # no polling: the trainer joining this feedback finds the record at once
        assert await gw.bus.traffic(r.id, 0) is not None


async def test_feedback_on_traffic_that_could_not_be_stored_is_refused(nats_module):
    fake, server, addr = await start_fake()
    gw = await start_gateway([addr], nats_module.url)
    try:
        await gw.bus.nc.close()  # the bus goes away: the fork cannot store anything
        r = await gw.openai().chat.completions.create(model="tiny", messages=HI)
        assert r.choices[0].message.content == TEXT  # users are served regardless
        resp = await post_feedback(gw, response_id=r.id, score=1)
        assert resp.status_code == 404 and "could not be stored" in resp.json()["error"]["message"]
        assert gw.core.status()["counters"]["traffic_publish_errors"] == 1
    finally:
        await gw.stop()
        await server.stop(0)


async def test_a_client_that_hangs_up_cancels_the_replica_request(nats_module):
    fake, server, addr = await start_fake(delay_s=0.2)
    gw = await start_gateway([addr], nats_module.url)
    try:
        async with httpx.AsyncClient() as http:
            async with http.stream("POST", f"{gw.base_url}/chat/completions", headers=headers(),
                                   json={"model": "tiny", "messages": HI, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # one token, then hang up
        for _ in range(50):
            if fake.running == 0 and gw.core.status()["in_flight"] == 0:
                break
            await asyncio.sleep(0.1)
        assert fake.running == 0, "the replica is still generating for a client that left"
        status = gw.core.status()
        assert status["in_flight"] == 0 and status["replicas"][0]["in_flight"] == 0
        assert status["replicas"][0]["healthy"]
    finally:
        await gw.stop()
        await server.stop(0)
