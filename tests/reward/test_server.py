"""The gRPC edge: a real aio server on port 0, requests streamed through a real channel."""

from __future__ import annotations

import grpc
import pytest

from hotloop.proto.v1 import reward_pb2, reward_pb2_grpc
from services.reward.config import RewardConfig, SandboxConfig
from services.reward.core import RewardCore
from services.reward.server import RewardServicer, input_from_proto, input_to_proto, serve
from services.reward.types import ScoreInput, TaskSpec

from .conftest import LIMITS


def test_proto_round_trip_keeps_every_field():
    item = ScoreInput("i", "prompt", "completion", TaskSpec(
        "t", tests="assert 1", entry_point="f", test_cases=("a", "b"), extra={"code_prefix": "import os"}),
        scorer="format")
    assert input_from_proto(input_to_proto(item)) == item


async def test_score_stream_through_a_real_channel():
    core = RewardCore.from_config(RewardConfig(concurrency=2, sandbox=SandboxConfig(**LIMITS)))
    server = grpc.aio.server()
    reward_pb2_grpc.add_RewardServicer_to_server(RewardServicer(core), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        task = reward_pb2.TaskSpec(task_id="t", entry_point="add",
                                   test_cases=["assert add(1, 2) == 3", "assert add(0, 0) == 0"])
        requests = [
            reward_pb2.ScoreRequest(id="good", completion="```python\ndef add(a, b):\n    return a + b\n```", task=task),
            reward_pb2.ScoreRequest(id="half", completion="def add(a, b):\n    return a * b\n", task=task),
            reward_pb2.ScoreRequest(id="none", completion="no idea", task=task),
            reward_pb2.ScoreRequest(id="fmt", completion="```python\nx\n```", scorer="format"),
            reward_pb2.ScoreRequest(id="bad", completion="x", scorer="nope"),
        ]

        async def gen():
            for r in requests:
                yield r

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            results = {r.id: r async for r in reward_pb2_grpc.RewardStub(channel).Score(gen())}
        assert set(results) == {"good", "half", "none", "fmt", "bad"}
        assert (results["good"].reward, results["good"].passed, results["good"].status) == (1.0, 2, "ok")
        assert (results["half"].reward, results["half"].passed, results["half"].failed) == (0.5, 1, 1)
        assert results["none"].status == "no_code"
        assert (results["fmt"].reward, results["bad"].status) == (1.0, "scorer_error")
        assert results["good"].seconds > 0
    finally:
        await server.stop(None)
        await core.close()


async def test_serve_uses_the_shared_server_helper():
    core = RewardCore.from_config(RewardConfig(scorers=["format"], default_scorer="format"))
    server, port, _health = await serve(core, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            async def one():
                yield reward_pb2.ScoreRequest(id="1", completion="```python\nx\n```")

            (res,) = [r async for r in reward_pb2_grpc.RewardStub(channel).Score(one())]
        assert (res.id, res.reward, res.status) == ("1", 1.0, "ok")
    finally:
        await server.stop(None)
        await core.close()


async def test_reward_model_and_composite_through_a_real_channel(tiny_rm):
    from .test_reward_model import direct_scores

    model_dir = tiny_rm()
    core = RewardCore.from_config(RewardConfig.model_validate({
        "scorers": ["rm", "mix", "format"], "default_scorer": "mix",
        "reward_models": {"rm": {"model": str(model_dir), "device": "cpu", "dtype": "float32", "batch_size": 4}},
        "length_rules": {"brief": {"max_words": 8, "reward_under": 1.0, "reward_over": 0.0}},
        "composites": {"mix": {"parts": {"rm": 0.5, "brief": 1.0}}},
    }))
    server, port, _health = await serve(core, "127.0.0.1:0")
    pairs = [(f"Task {i}: add two numbers.", "def add(a, b): return a + b" + " # ok" * i) for i in range(6)]
    try:
        async def gen():
            for i, (p, c) in enumerate(pairs):
                yield reward_pb2.ScoreRequest(id=f"rm{i}", prompt=p, completion=c, scorer="rm")
                yield reward_pb2.ScoreRequest(id=f"mix{i}", prompt=p, completion=c)  # the default: mix
            yield reward_pb2.ScoreRequest(id="unknown", completion="x", scorer="brief")  # a part, not enabled

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            results = {r.id: r async for r in reward_pb2_grpc.RewardStub(channel).Score(gen())}
        expected = direct_scores(model_dir, pairs)
        for i, (_, c) in enumerate(pairs):
            rm, mix = results[f"rm{i}"], results[f"mix{i}"]
            assert (rm.status, mix.status) == ("ok", "ok"), (rm.error, mix.error)
            assert rm.reward == pytest.approx(expected[i], abs=1e-4)
            brief = 1.0 if len(c.split()) <= 8 else 0.0  # i = 0 is brief, the rest are not
            assert mix.reward == pytest.approx(0.5 * expected[i] + brief, abs=1e-4)
        assert results["unknown"].status == "scorer_error" and "unknown scorer 'brief'" in results["unknown"].error
    finally:
        await server.stop(None)
        await core.close()
