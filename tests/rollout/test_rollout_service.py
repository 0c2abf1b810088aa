"""The rollout service through a real gRPC server on port 0 with a real vLLM engine.

One engine per module (start-up takes ~20 s on 2 cores). Run in `lora` mode here; the merged
mode has its own module so each mode's version rule is tested on its own engine.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc
import pytest
import pytest_asyncio

from hotloop import adapters, grpcutil
from hotloop.proto.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
TOKEN = "test-admin-token"
MODE = "lora"


async def start(tiny_model, tmp_path, mode, dtype="auto", **overrides):
    from services.rollout.config import RolloutConfig
    from services.rollout.core import RolloutCore
    from services.rollout.server import serve

    cfg = RolloutConfig(**{
        "update_mode": mode, "max_lora_rank": 16, "max_prompt_tokens": 200, "max_n": 8,
        "max_new_tokens": 64, "default_max_tokens": 16, "kv_cache_gib": 1,
        "swap_drain_timeout_s": 30, **overrides,
    })
    core = RolloutCore(cfg, tiny_model, base_model="tiny", dtype=dtype, max_model_len=512,
                       storage_dir=tmp_path / "adapters")
    await core.start()
    server, port, _ = await serve(core, "127.0.0.1:0", TOKEN)
    return core, server, port


@asynccontextmanager
async def serving(tiny_model, tmp_path, mode, **kw):
    """`start`'s service with a client stub: (core, stub), stopped on exit."""
    core, server, port = await start(tiny_model, tmp_path, mode, **kw)
    ch = grpcutil.channel(f"127.0.0.1:{port}")
    try:
        yield core, rollout_pb2_grpc.RolloutStub(ch)
    finally:
        await ch.close()
        await server.stop(0)
        await core.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(tiny_model, tmp_path_factory):
    core, server, port = await start(tiny_model, tmp_path_factory.mktemp("rollout"), MODE)
    ch = grpcutil.channel(f"127.0.0.1:{port}")
    yield core, rollout_pb2_grpc.RolloutStub(ch)
    await ch.close()
    await server.stop(0)
    await core.stop()


def text_prompt(t: str) -> common_pb2.Prompt:
    return common_pb2.Prompt(text=t)


async def generate(stub, prompts, **sampling) -> list[rollout_pb2.Completion]:
    req = rollout_pb2.GenerateRequest(prompts=prompts, sampling=common_pb2.SamplingParams(**sampling))
    return [c async for c in stub.Generate(req)]


def push_messages(data: bytes, version: int, base: str = "tiny", sha: str | None = None, declared: int | None = None):
    info = common_pb2.VersionInfo(version=version, sha256=sha or adapters.sha256(data),
                                  bytes=len(data) if declared is None else declared, base_model=base)
    yield rollout_pb2.AdapterChunk(header=rollout_pb2.AdapterHeader(info=info, make_latest=True))
    for i in range(0, len(data), 4096):
        yield rollout_pb2.AdapterChunk(data=data[i : i + 4096])


async def push(stub, data, version, token=TOKEN, **kw):
    return await stub.PushAdapter(push_messages(data, version, **kw), metadata=grpcutil.bearer(token))


async def test_generate_text_chat_and_token_ids(rollout):
    core, stub = rollout
    ids = core.tokenizer.encode("def add(a, b):")
    prompts = [
        text_prompt("def add(a, b):"),
        common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="hi")])),
        common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=ids)),
    ]
    out = await generate(stub, prompts, n=3, max_tokens=8, seed=0)
    assert len(out) == 9
    assert sorted((c.prompt_index, c.sample_index) for c in out) == [(p, s) for p in range(3) for s in range(3)]
    for c in out:
        assert 0 < len(c.token_ids) <= 8
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.policy_version == 0
        assert c.finish_reason in ("stop", "length")


async def test_greedy_text_and_token_ids_agree(rollout):
    core, stub = rollout
    ids = core.tokenizer.encode("def add(a, b):")
    a = await generate(stub, [text_prompt("def add(a, b):")], max_tokens=8, temperature=0)
    b = await generate(stub, [common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=ids))], max_tokens=8, temperature=0)
    assert list(a[0].token_ids) == list(b[0].token_ids)


async def test_a_stop_string_ends_the_text_and_keeps_every_sampled_token(rollout):
    """What GRPO trains on when `[grpo] stop` ends a completion: its text stops before the stop
    string, its token ids and logprobs are every token the engine sampled, the string's too."""
    core, stub = rollout
    (full,) = await generate(stub, [text_prompt("def add(a, b):")], max_tokens=48, temperature=0)
    text, ids = full.text, list(full.token_ids)
    # a stop string across the boundary of two sampled tokens, at its first occurrence
    k = next(k for k in range(1, len(ids)) if len(core.tokenizer.decode(ids[:k])) >= 2)
    start = len(core.tokenizer.decode(ids[:k])) - 2
    stop = text[start:start + 4]
    assert len(stop) == 4 and text.find(stop) == start, (text, stop)
    (cut,) = await generate(stub, [text_prompt("def add(a, b):")], max_tokens=48, temperature=0, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == text[:start]
    n = len(cut.token_ids)
    assert n > k and list(cut.token_ids) == ids[:n] and len(cut.logprobs) == n
    assert stop in core.tokenizer.decode(list(cut.token_ids))  # the stop's tokens are kept


@pytest.mark.parametrize(
    "prompts,sampling,code,needle",
    [
        ([], {}, grpc.StatusCode.INVALID_ARGUMENT, "no prompts"),
        ([text_prompt("")], {}, grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        ([text_prompt("x " * 400)], {"max_tokens": 4}, grpc.StatusCode.INVALID_ARGUMENT, "at most 200"),
        ([text_prompt("hi")], {"n": 9}, grpc.StatusCode.INVALID_ARGUMENT, "n=9"),
        ([text_prompt("hi")], {"max_tokens": 65}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens=65"),
        ([common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[10**6]))], {}, grpc.StatusCode.INVALID_ARGUMENT, "outside vocab"),
        ([common_pb2.Prompt()], {}, grpc.StatusCode.INVALID_ARGUMENT, "text, token_ids or chat"),
        ([text_prompt("hi")], {"n": 2, "temperature": 0}, grpc.StatusCode.INVALID_ARGUMENT, "greedy"),
    ],
)
async def test_bad_generate_requests_are_refused(rollout, prompts, sampling, code, needle):
    _, stub = rollout
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, prompts, **sampling)
    assert e.value.code() == code
    assert needle in e.value.details()
    assert len(await generate(stub, [text_prompt("still serving")], max_tokens=2)) == 1


async def test_unknown_pinned_version_is_not_found(rollout):
    _, stub = rollout
    req = rollout_pb2.GenerateRequest(prompts=[text_prompt("hi")], pin_version=999)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        [c async for c in stub.Generate(req)]
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_push_needs_the_admin_token(rollout, adapter_factory):
    _, stub = rollout
    data = adapters.pack(adapter_factory(seed=1))
    for token in ("", "wrong"):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await push(stub, data, 50, token=token)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    status = await stub.Status(rollout_pb2.StatusRequest())
    assert 50 not in [v.version for v in status.versions]


async def test_bad_pushes_are_refused_and_serving_continues(rollout, adapter_factory, tmp_path):
    core, stub = rollout
    good = adapters.pack(adapter_factory(seed=1))
    before = core.latest
    cases = [
        (dict(sha="0" * 64), grpc.StatusCode.INVALID_ARGUMENT, "sha256"),
        (dict(declared=len(good) + 10), grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
        (dict(base="another-model"), grpc.StatusCode.FAILED_PRECONDITION, "trained on"),
    ]
    for kw, code, needle in cases:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await push(stub, good, 60, **kw)
        assert e.value.code() == code, kw
        assert needle in e.value.details()
    # an adapter for a different architecture (rank within limit, wrong shapes)
    from hotloop.models import build_tiny_model
    from tests.conftest import make_adapter

    other = build_tiny_model(tmp_path / "other", hidden=128, layers=2)
    wrong = adapters.pack(make_adapter(other, tmp_path / "wrong-adapter"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await push(stub, wrong, 61)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "another base model" in e.value.details()
    assert core.latest == before
    # nothing of a refused push stays on disk: neither its partial file nor its version
    assert not list(core.storage.glob(".incoming-*"))
    assert not (core.storage / "v60").exists() and not (core.storage / "v61").exists()
    out = await generate(stub, [text_prompt("hi")], max_tokens=2)
    assert out[0].policy_version == before


async def test_hot_push_serves_new_version_and_in_flight_finish_on_theirs(rollout, adapter_factory):
    core, stub = rollout
    base = (await generate(stub, [text_prompt("def add(a, b):")], max_tokens=12, temperature=0))[0]
    v = core.latest + 1
    long_req = rollout_pb2.GenerateRequest(
        prompts=[text_prompt("for i in range(10):")],
        sampling=common_pb2.SamplingParams(max_tokens=64, temperature=0),
    )
    in_flight = asyncio.create_task(_collect(stub.Generate(long_req)))
    await asyncio.sleep(0.05)
    resp = await push(stub, adapters.pack(adapter_factory(seed=2, scale=5.0)), v)
    assert resp.loaded.version == v and not resp.already_present
    after = (await generate(stub, [text_prompt("def add(a, b):")], max_tokens=12, temperature=0))[0]
    assert after.policy_version == v
    assert list(after.token_ids) != list(base.token_ids), "the new adapter did not change outputs"
    (old,) = await in_flight
    assert old.policy_version == v - 1
    # idempotent re-push of the same content
    again = await push(stub, adapters.pack(adapter_factory(seed=2, scale=5.0)), v)
    assert again.already_present


async def _collect(call):
    return [c async for c in call]


async def test_metrics_count_requests_tokens_pushes_and_swaps(rollout, adapter_factory):
    from hotloop import metrics
    from tests.scrape import scrape

    core, stub = rollout
    endpoint = metrics.serve(core.registry)
    try:
        before = await scrape(endpoint.port)
        whole = await generate(stub, [text_prompt("def add(a, b):"), text_prompt("hi")], n=2, max_tokens=8)
        stream = stub.Generate(rollout_pb2.GenerateRequest(
            prompts=[text_prompt("for i in range(10):")], stream=True,
            sampling=common_pb2.SamplingParams(max_tokens=32, temperature=0)))
        first = await anext(aiter(stream))
        during = await scrape(endpoint.port)
        deltas = [first] + [c async for c in stream]

        v = core.latest + 1
        data = adapters.pack(adapter_factory(seed=3))
        await push(stub, data, v)
        assert (await push(stub, data, v)).already_present
        for kw in (dict(sha="0" * 64), dict(base="another-model")):
            with pytest.raises(grpc.aio.AioRpcError):
                await push(stub, data, v + 1, **kw)
        after = await scrape(endpoint.port)
    finally:
        endpoint.close()

    def delta(sample: str, **labels) -> float:
        return after.value(sample, **labels) - before.value(sample, **labels)

    assert delta("hotloop_rollout_requests_total") == 2
    assert delta("hotloop_rollout_generated_tokens_total") == (
        sum(len(c.token_ids) for c in whole) + sum(len(c.token_ids) for c in deltas))
    # while the stream ran: one call admitted, a user's, past its first token
    assert during.value("hotloop_rollout_requests_running") == 1
    assert during.value("hotloop_rollout_user_requests_running") == 1
    assert during.value("hotloop_rollout_user_requests_waiting") == 0
    assert after.value("hotloop_rollout_requests_running") == 0

    assert delta("hotloop_rollout_pushes_total", result="loaded") == 1
    assert delta("hotloop_rollout_pushes_total", result="already_present") == 1
    assert delta("hotloop_rollout_pushes_total", result="invalid_argument") == 1
    assert delta("hotloop_rollout_pushes_total", result="failed_precondition") == 1
    assert delta("hotloop_rollout_push_seconds_count") == 1
    assert delta("hotloop_rollout_swaps_total", swap="slot", result="ok") == 1  # lora mode
    assert delta("hotloop_rollout_swap_seconds_count", swap="slot") == 1
    assert after.value("hotloop_rollout_version") == v == core.latest
    assert after.value("hotloop_rollout_versions_held") == len(core.versions())
    assert after.value("hotloop_rollout_engine_info", update_mode="lora", swap="slot") == 1
