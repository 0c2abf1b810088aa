"""The same service contract in merged mode (the CPU default) with `swap = "drain"`: weights
merged into the engine, swapped after in-flight requests drain (in-flight swaps:
test_rollout_inflight.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from hotloop import adapters, grpcutil
from hotloop.proto.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from .test_rollout_service import _collect, generate, push, start, text_prompt

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(tiny_model, tmp_path_factory):
    core, server, port = await start(tiny_model, tmp_path_factory.mktemp("rollout-merged"), "merged",
                                     swap="drain")
    ch = grpcutil.channel(f"127.0.0.1:{port}")
    yield core, rollout_pb2_grpc.RolloutStub(ch)
    await ch.close()
    await server.stop(0)
    await core.stop()


async def test_merged_push_drains_then_serves_new_version(rollout, adapter_factory):
    core, stub = rollout
    assert core.mode == "merged"
    prompt = [text_prompt("def add(a, b):")]
    base = (await generate(stub, prompt, max_tokens=12, temperature=0))[0]
    long_req = rollout_pb2.GenerateRequest(
        prompts=[text_prompt("for i in range(10):")],
        sampling=common_pb2.SamplingParams(max_tokens=64, n=2, seed=1),
    )
    in_flight = asyncio.create_task(_collect(stub.Generate(long_req)))
    await asyncio.sleep(0.05)
    resp = await push(stub, adapters.pack(adapter_factory(seed=3, scale=5.0)), 1)
    assert resp.loaded.version == 1
    old = await in_flight
    assert {c.policy_version for c in old} == {0}, "an in-flight request changed version mid-way"
    after = (await generate(stub, prompt, max_tokens=12, temperature=0))[0]
    assert after.policy_version == 1
    assert list(after.token_ids) != list(base.token_ids)
    # pinning a version that is not live is refused with a reason, not silently served
    req = rollout_pb2.GenerateRequest(prompts=prompt, pin_version=0)
    out = [c async for c in stub.Generate(req)]  # 0 means latest
    assert out[0].policy_version == 1


async def test_merged_same_adapter_twice_gives_same_outputs(rollout, adapter_factory):
    core, stub = rollout
    prompt = [text_prompt("class Point:")]
    data = adapters.pack(adapter_factory(seed=4, scale=5.0))
    await push(stub, data, core.latest + 1)
    a = (await generate(stub, prompt, max_tokens=10, temperature=0))[0]
    await push(stub, adapters.pack(adapter_factory(seed=3, scale=5.0)), core.latest + 1)
    await push(stub, data, core.latest + 1)
    b = (await generate(stub, prompt, max_tokens=10, temperature=0))[0]
    assert list(a.token_ids) == list(b.token_ids)
    assert b.policy_version == a.policy_version + 2


async def test_merged_pin_of_old_version_is_refused(rollout):
    core, stub = rollout
    old = [v.version for v in (await stub.Status(rollout_pb2.StatusRequest())).versions if v.version != core.latest]
    assert old
    req = rollout_pb2.GenerateRequest(prompts=[text_prompt("hi")], pin_version=old[-1])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        [c async for c in stub.Generate(req)]
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "merged" in e.value.details()


async def test_the_heartbeat_beats_at_every_step_of_a_request_that_returns_only_its_end(rollout):
    """A whole-mode request (vLLM sends its output once, at the end) still beats the engine's
    heartbeat at every step, and holds it busy while it runs: the hung-engine rule
    (services/rollout/heartbeat.py) sees a long request as progress, not as a stall. A call
    into the engine core holds it busy too."""
    core, stub = rollout
    hb = core.heartbeat
    assert hb.stall_s > 0 and hb.busy == 0
    steps = hb.steps
    seen_busy = []

    async def watch():
        while True:
            seen_busy.append(hb.busy)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    try:
        out = await generate(stub, [text_prompt("def add(a, b):")], max_tokens=24)
    finally:
        watcher.cancel()
    (c,) = out
    assert len(c.token_ids) >= 8  # the tiny random model rarely ends early
    assert hb.steps - steps >= len(c.token_ids)  # one per token: the decode steps, the prefill's
    assert max(seen_busy) >= 1 and hb.busy == 0
    assert hb.stalled() is None
    await core.engine.collective_rpc("hotloop_status")
    assert hb.busy == 0


async def test_a_reader_that_stops_reading_does_not_hold_back_a_drain_swap(rollout, adapter_factory):
    """A drain swap waits for the engine's requests, not for their readers: a caller that
    stopped reading (a frozen client) held it until `swap_drain_timeout_s` failed the push."""
    from services.rollout.core import GenerateInput, PromptIn, Sampling

    core, stub = rollout
    prompt = "def mul(a, b):"
    ref = (await generate(stub, [text_prompt(prompt)], max_tokens=16, temperature=0))[0]
    old = core.latest
    gen = core.generate(GenerateInput([PromptIn(text=prompt)], Sampling(
        max_tokens=16, temperature=0), stream=True))
    got = [await anext(gen)]  # one delta read, then the reader stops
    resp = await asyncio.wait_for(push(stub, adapters.pack(adapter_factory(seed=9, scale=5.0)),
                                       old + 1), 20)  # the fixture's drain timeout: 30 s
    assert resp.loaded.version == core.latest == old + 1
    got += [c async for c in gen]  # the reader comes back: the old version's answer, whole
    assert [t for c in got for t in c.token_ids] == list(ref.token_ids)
    assert {c.policy_version for c in got} == {old} and got[-1].final
