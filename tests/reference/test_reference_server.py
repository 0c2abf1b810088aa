"""The reference service through a real gRPC server on port 0 and a real channel.

The core runs the tiny model in fp32, where the stream's batching (which depends on arrival
timing) cannot move a logprob by more than ~1e-6 (see test_reference_core.py); results are
compared with `ReferenceCore.logprobs` called directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import grpc
import pytest

from hotloop import config as hconfig
from hotloop import grpcutil
from hotloop.proto.v1 import reference_pb2, reference_pb2_grpc
from services.reference.config import ReferenceConfig
from services.reference.core import LogprobsRequest, LogprobsResult, ReferenceCore
from services.reference.server import (
    request_from_proto,
    request_to_proto,
    result_from_proto,
    result_to_proto,
    serve,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def core(tiny_model: Path) -> ReferenceCore:
    return ReferenceCore(ReferenceConfig(model=str(tiny_model), dtype="float32", token_budget=256))


@pytest.fixture
async def stub(core):
    server, port, _ = await serve(core, "127.0.0.1:0")
    async with grpcutil.channel(f"127.0.0.1:{port}") as ch:
        yield reference_pb2_grpc.ReferenceStub(ch)
    await server.stop(None)


def requests(n: int) -> list[LogprobsRequest]:
    # deterministic, varied lengths (1..7 prompt, 0..9 completion tokens), ids inside the vocab
    return [
        LogprobsRequest(
            id=f"q{i}",
            prompt_ids=[3 + (i * 7 + k) % 300 for k in range(1 + i % 7)],
            completion_ids=[5 + (i * 11 + k) % 300 for k in range(i % 10)],
        )
        for i in range(n)
    ]


async def call(stub, reqs: Iterable[LogprobsRequest]) -> list[LogprobsResult]:
    async def gen():
        for r in reqs:
            yield request_to_proto(r)
            await asyncio.sleep(0)  # let the server see requests arrive over time

    return [result_from_proto(r) async for r in stub.Logprobs(gen())]


def assert_close(got: list[LogprobsResult], want: list[LogprobsResult]) -> None:
    assert [g.id for g in got] == [w.id for w in want]
    for g, w in zip(got, want):
        assert len(g.logprobs) == len(w.logprobs), g.id
        assert all(abs(a - b) < TOL for a, b in zip(g.logprobs, w.logprobs)), g.id


def test_proto_round_trip() -> None:
    req = LogprobsRequest("a", [1, 2], [3])
    assert request_from_proto(request_to_proto(req)) == req
    res = LogprobsResult("a", [-0.5, -1.25])
    assert result_from_proto(result_to_proto(res)) == res


async def test_results_match_the_core_called_directly(core, stub) -> None:
    reqs = requests(8)
    assert_close(await call(stub, reqs), core.logprobs(reqs))


async def test_many_requests_on_one_stream_all_come_back_in_order(core, stub) -> None:
    reqs = requests(120)
    got = await call(stub, reqs)
    assert [g.id for g in got] == [r.id for r in reqs]
    assert_close(got, core.logprobs(reqs))
    assert all(len(g.logprobs) == len(r.completion_ids) for g, r in zip(got, reqs))


@pytest.mark.parametrize(
    "bad,needle",
    [
        (LogprobsRequest("bad-empty", [], [1, 2]), "empty prompt"),
        (LogprobsRequest("bad-vocab", [1, 2], [10**6]), "outside the vocabulary"),
    ],
)
async def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(core, stub, bad, needle) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call(stub, [bad])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details() and bad.id in e.value.details()
    reqs = requests(3)
    assert_close(await call(stub, reqs), core.logprobs(reqs))  # the next stream is served


async def test_a_bad_request_mid_stream_ends_that_stream_after_earlier_results(core, stub) -> None:
    good = requests(2)
    seen: list[str] = []
    gate = asyncio.Event()

    async def gen():
        for r in good:
            yield request_to_proto(r)
        await gate.wait()  # the bad one arrives after the good ones were scored
        yield request_to_proto(LogprobsRequest("late-bad", [], [1]))

    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for r in stub.Logprobs(gen()):
            seen.append(r.id)
            if len(seen) == len(good):
                gate.set()
    assert seen == ["q0", "q1"]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "late-bad" in e.value.details()


async def test_metrics_count_requests_tokens_and_batches(core, stub) -> None:
    from hotloop import metrics
    from tests.scrape import scrape

    endpoint = metrics.serve(core.metrics.registry)
    try:
        before = await scrape(endpoint.port)
        reqs = requests(12)
        await call(stub, reqs)
        with pytest.raises(grpc.aio.AioRpcError):
            await call(stub, [LogprobsRequest("bad", [], [1])])
        after = await scrape(endpoint.port)
    finally:
        endpoint.close()

    def delta(sample: str, **labels) -> float:
        return after.value(sample, **labels) - before.value(sample, **labels)

    assert delta("hotloop_reference_requests_total", result="scored") == 12
    assert delta("hotloop_reference_requests_total", result="refused") == 1
    assert delta("hotloop_reference_tokens_total", kind="prompt") == sum(len(r.prompt_ids) for r in reqs)
    assert delta("hotloop_reference_tokens_total", kind="completion") == sum(
        len(r.completion_ids) for r in reqs)
    # how the stream batches depends on arrival timing; each scored batch is observed once
    assert 1 <= delta("hotloop_reference_batch_seconds_count") <= 12
    assert delta("hotloop_reference_batch_seconds_sum") > 0
    assert after.type_of("hotloop_reference_batch_seconds") == "histogram"


async def test_main_builds_on_the_mesh_model_and_refuses_another(tiny_model: Path) -> None:
    from services.reference.__main__ import ReferenceServiceConfig, build

    mesh, cfg = hconfig.load(
        "reference", ReferenceServiceConfig,
        overrides=[f"model.name={tiny_model}", "model.dtype=float32", "reference.port=0"],
    )
    running = await build(mesh, cfg)
    try:
        async with grpcutil.channel(f"127.0.0.1:{running.port}") as ch:
            stub = reference_pb2_grpc.ReferenceStub(ch)
            req = reference_pb2.LogprobsRequest(id="x", prompt_ids=[3, 4], completion_ids=[5, 6, 7])

            async def one():
                yield req

            (res,) = [r async for r in stub.Logprobs(one())]
            assert res.id == "x" and len(res.logprobs) == 3
    finally:
        await running.server.stop(None)

    assert (cfg.model, cfg.dtype) == (str(tiny_model), "float32")  # the mesh's, declared once
    with pytest.raises(hconfig.ConfigError, match=r"\[reference\] model: declared once, as model.name"):
        hconfig.load("reference", ReferenceServiceConfig,
                     overrides=[f"model.name={tiny_model}", "reference.model=some-other-model"])
