"""The gateway in front of a real rollout (vLLM, tiny model) over gRPC, with real NATS and the
official openai client. One engine for the module; a second gRPC server over the same engine
is the replica that gets stopped mid-stream."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from hotloop.proto.v1 import common_pb2, gateway_pb2

from .conftest import KEY, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
HI = [{"role": "user", "content": "Say hello."}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model, tmp_path_factory, nats_module):
    from services.rollout.config import RolloutConfig
    from services.rollout.core import RolloutCore
    from services.rollout.server import serve

    cfg = RolloutConfig(update_mode="merged", max_prompt_tokens=200, max_n=8, max_new_tokens=256,
                        default_max_tokens=16, kv_cache_gib=1)
    core = RolloutCore(cfg, tiny_model, base_model="tiny", max_model_len=512,
                       storage_dir=tmp_path_factory.mktemp("rollout") / "adapters")
    await core.start()
    server, port, _ = await serve(core, "127.0.0.1:0", "admin")
    gw = await start_gateway([f"127.0.0.1:{port}"], nats_module.url, max_tokens=256)
    yield core, gw
    await gw.stop()
    await server.stop(0)
    await core.stop()


async def traffic(gw, rid: str, choice: int):
    for _ in range(100):
        if (ev := await gw.bus.traffic(rid, choice)) is not None:
            return ev
        await asyncio.sleep(0.05)
    raise AssertionError(f"no traffic for {rid}:{choice}")


async def test_chat_whole_n2_with_logprobs_and_its_traffic(engine):
    core, gw = engine
    raw = await gw.openai().chat.completions.with_raw_response.create(
        model="tiny", messages=HI, n=2, max_tokens=12, logprobs=True, top_logprobs=3)
    r = raw.parse()
    assert raw.headers["x-hotloop-policy-version"] == "0" and r.model_extra["policy_version"] == 0
    assert len(r.choices) == 2
    ids = core.tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    prompt_ids = core.tokenizer.encode(ids, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt_ids)
    total = 0
    for c in r.choices:
        assert c.finish_reason in ("stop", "length")
        lps = c.logprobs.content
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lps)
        ev = await traffic(gw, r.id, c.index)
        assert list(ev.prompt_ids) == prompt_ids
        assert len(ev.completion_ids) == len(ev.logprobs) == len(lps)
        assert [t.logprob for t in lps] == pytest.approx(list(ev.logprobs), abs=1e-4)
        # the detokenizer holds back a trailing partial UTF-8 character, hence a prefix
        assert core.tokenizer.decode(list(ev.completion_ids)).startswith(c.message.content)
        assert [(s.version, s.first_token) for s in ev.version_spans] == [(0, 0)]
        assert ev.user == "alice" and ev.finish_reason == c.finish_reason
        total += len(ev.completion_ids)
    assert r.usage.completion_tokens == total


async def test_chat_stream_arrives_in_deltas(engine):
    _, gw = engine
    stream = await gw.openai().chat.completions.create(
        model="tiny", messages=HI, max_tokens=24, stream=True, stream_options={"include_usage": True})
    text, chunks, finish, usage = "", 0, None, None
    async for chunk in stream:
        assert chunk.model_extra["policy_version"] == 0
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            chunks += 1
            finish = c.finish_reason or finish
    assert finish in ("stop", "length") and usage.completion_tokens >= 1
    assert chunks > 1 or usage.completion_tokens == 1, "streamed as one message, not as deltas"
    ev = await traffic(gw, stream.response.headers["x-hotloop-response-id"], 0)
    assert len(ev.completion_ids) == usage.completion_tokens


async def test_completions_whole_and_stream(engine):
    _, gw = engine
    client = gw.openai()
    r = await client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=8, logprobs=2,
                                        temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    text = ""
    async for chunk in await client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=8,
                                                       temperature=0, stream=True):
        text += chunk.choices[0].text
    assert text == r.choices[0].text  # greedy: the stream adds up to the whole answer


async def test_prompt_over_the_replicas_token_limit_is_400_and_serving_continues(engine):
    _, gw = engine
    with pytest.raises(openai.BadRequestError) as e:
        await gw.openai().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x " * 400}])
    assert "at most 200" in e.value.message
    assert (await gw.openai().chat.completions.create(model="tiny", messages=HI, max_tokens=2)).choices


async def test_grpc_generate_streams_and_feedback_is_stored(engine):
    _, gw = engine
    ch, stub = gw.stub()
    md = (("authorization", f"Bearer {KEY}"),)
    chunks = [c async for c in stub.Generate(gateway_pb2.UserGenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content="hi")], max_tokens=16), metadata=md)]
    assert chunks[-1].finish_reason in ("stop", "length")
    assert chunks[-1].completion_tokens >= 1 and chunks[-1].prompt_tokens > 0
    rid = chunks[0].response_id
    await traffic(gw, rid, 0)
    ack = await stub.SubmitFeedback(gateway_pb2.Feedback(response_id=rid, label="up"), metadata=md)
    assert ack.accepted and not ack.reason
    await ch.close()
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{gw.base_url}/feedback", headers={"Authorization": f"Bearer {KEY}"},
                            json={"response_id": rid, "score": 1.0})
    assert r.json()["reason"] == "duplicate"


async def test_replica_stopped_mid_stream_ends_the_stream_with_an_error(engine, nats_module):
    from services.rollout.server import serve

    core, _ = engine
    server, port, _ = await serve(core, "127.0.0.1:0", "admin")
    gw = await start_gateway([f"127.0.0.1:{port}"], nats_module.url, max_tokens=256)
    try:
        stream = await gw.openai().chat.completions.create(
            model="tiny", messages=HI, n=4, max_tokens=256, stream=True)
        finish = []
        with pytest.raises(openai.APIError) as e:
            async for chunk in stream:
                if server is not None:
                    await server.stop(0)  # the replica goes away after its first token
                    server = None
                finish.extend(c.finish_reason for c in chunk.choices if c.finish_reason)
        assert "rollout replica" in e.value.message
        assert len(finish) < 4, "every choice finished: the replica was not stopped mid-stream"
        status = gw.core.status()
        assert not status["replicas"][0]["healthy"] and status["counters"]["unavailable"] == 1
        # the engine itself is fine: the module's gateway still serves through its own server
    finally:
        if server is not None:
            await server.stop(0)
        await gw.stop()


async def test_engine_still_serves_after_the_killed_replica(engine):
    _, gw = engine
    r = await gw.openai().chat.completions.create(model="tiny", messages=HI, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
