"""gRPC edge of the reward service: protos in, dataclasses to the core, protos out.

Owns the conversions and `Reward.Score`, a bidirectional stream whose flow control is the
core's `score_stream`: the server reads at most `max_in_flight` requests ahead of the results
the client has taken. Does not own scoring or its errors: a bad sample is a `ScoreResult`
with a status, never a failed RPC.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from hotloop.grpcutil import create_server, map_errors
from hotloop.proto.v1 import reward_pb2, reward_pb2_grpc

from .core import RewardCore
from .types import ScoreInput, ScoreOutput, TaskSpec

SERVICE = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name


def input_from_proto(req: reward_pb2.ScoreRequest) -> ScoreInput:
    t = req.task
    return ScoreInput(
        id=req.id, prompt=req.prompt, completion=req.completion, scorer=req.scorer,
        task=TaskSpec(
            task_id=t.task_id, tests=t.tests, entry_point=t.entry_point,
            test_cases=tuple(t.test_cases), extra=dict(t.extra),
        ),
    )


def input_to_proto(item: ScoreInput) -> reward_pb2.ScoreRequest:
    t = item.task
    return reward_pb2.ScoreRequest(
        id=item.id, prompt=item.prompt, completion=item.completion, scorer=item.scorer,
        task=reward_pb2.TaskSpec(
            task_id=t.task_id, tests=t.tests, entry_point=t.entry_point,
            test_cases=list(t.test_cases), extra=t.extra,
        ),
    )


def output_to_proto(out: ScoreOutput) -> reward_pb2.ScoreResult:
    return reward_pb2.ScoreResult(
        id=out.id, reward=out.reward, passed=out.passed, failed=out.failed,
        timed_out=out.timed_out, error=out.error, status=out.status, seconds=out.seconds,
    )


def output_from_proto(res: reward_pb2.ScoreResult) -> ScoreOutput:
    return ScoreOutput(
        id=res.id, reward=res.reward, passed=res.passed, failed=res.failed,
        timed_out=res.timed_out, error=res.error, status=res.status,  # type: ignore[arg-type]
        seconds=res.seconds,
    )


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, core: RewardCore):
        self._core = core

    @map_errors
    async def Score(
        self, request_iterator: AsyncIterator[reward_pb2.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[reward_pb2.ScoreResult]:
        async def inputs() -> AsyncIterator[ScoreInput]:
            async for req in request_iterator:
                yield input_from_proto(req)

        async for out in self._core.score_stream(inputs()):
            yield output_to_proto(out)


async def serve(core: RewardCore, address: str):
    """Start a server for `core` (health and reflection included); returns (server, port, health)."""
    servicer = RewardServicer(core)
    return await create_server(
        [lambda s: reward_pb2_grpc.add_RewardServicer_to_server(servicer, s)], [SERVICE], address,
    )
