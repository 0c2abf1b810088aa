"""A rollout replica over gRPC: the gateway's caller side of rollout.proto.

Owns: the streaming `Rollout.Generate` call (stream=true, return_prompt_ids, user priority),
proto -> `UpstreamDelta` conversion, the health probe (grpc health, then `Status` for the
replica's load and versions), and mapping the replica's status codes to `hotloop.errors`.
Does not own: choosing a replica or retrying (routing.py, core.py).

No gRPC-level retry here: a Generate stream replayed after it produced tokens would duplicate
them, so a failed call is reported once and the core decides (it only retries a request on
another replica before any token has reached the user).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hotloop import grpcutil
from hotloop.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    HotloopError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from hotloop.proto.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from .types import Replica, ReplicaStatus, UpstreamDelta, UpstreamRequest

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
USER_PRIORITY = 0  # rollout.proto: the gateway sends users at 0, training uses larger values
RECONNECT_BACKOFF_MS = (100, 250)  # first and longest wait between connects to a lost replica


def request_to_proto(req: UpstreamRequest) -> rollout_pb2.GenerateRequest:
    if req.chats is not None:
        prompts = [
            common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=[
                common_pb2.ChatMessage(role=m.role, content=m.content) for m in chat]))
            for chat in req.chats
        ]
    else:
        prompts = [common_pb2.Prompt(text=t) for t in req.texts or []]
    return rollout_pb2.GenerateRequest(
        prompts=prompts,
        sampling=common_pb2.SamplingParams(
            n=req.n, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
            stop=req.stop, top_logprobs=req.top_logprobs,
        ),
        return_prompt_ids=True,  # the traffic fork needs them
        request_id=req.request_id,
        stream=True,
        priority=USER_PRIORITY,
    )


def delta_from_proto(c: rollout_pb2.Completion) -> UpstreamDelta:
    return UpstreamDelta(
        prompt_index=c.prompt_index, sample_index=c.sample_index, text=c.text,
        token_ids=list(c.token_ids), logprobs=list(c.logprobs),
        finish_reason=c.finish_reason,
        # A replica without stream support sends whole completions; their finish_reason marks
        # them as the last message of their sample even where `final` is not set.
        final=c.final or bool(c.finish_reason),
        policy_version=c.policy_version,
        version_spans=[(s.version, s.first_token) for s in c.version_spans],
        prompt_token_ids=list(c.prompt_token_ids),
        num_prompt_tokens=c.num_prompt_tokens,
        top_logprobs=[list(zip(t.tokens, t.logprobs)) for t in c.top_logprobs],
        token_texts=list(c.token_texts),
    )


_CODES: dict[grpc.StatusCode, type[HotloopError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def error_from_rpc(address: str, e: grpc.aio.AioRpcError) -> HotloopError:
    """The replica's refusal keeps its message (it is the user's error); anything else means
    the replica could not serve, whatever its code."""
    cls = _CODES.get(e.code())
    if cls is not None:
        return cls(e.details() or e.code().name)
    return Unavailable(f"rollout replica {address} failed: {e.code().name}: {e.details()}")


class GrpcReplica(Replica):
    def __init__(self, address: str):
        self.address = address
        # no retry policy: see the module docstring
        self._channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", grpcutil.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", grpcutil.MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 0),
            # A channel that failed to connect fails every call at once until its reconnect
            # backoff (1 s, x1.6 per failure, up to 120 s by default) runs out, health probes
            # included: after a long outage users would be refused for up to two minutes
            # after the replica came back. Keep trying often; a refused connect is cheap.
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
        ])
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def generate(self, req: UpstreamRequest) -> AsyncIterator[UpstreamDelta]:
        call = self._stub.Generate(request_to_proto(req), timeout=req.timeout_s)
        try:
            async for msg in call:
                yield delta_from_proto(msg)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(self.address, e) from e
        finally:
            call.cancel()  # no-op when finished; aborts the engine's work when the user left

    async def probe(self, timeout_s: float) -> ReplicaStatus | None:
        try:
            h = await self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout_s)
            if h.status != health_pb2.HealthCheckResponse.SERVING:
                return None
            status = await self._stub.Status(rollout_pb2.StatusRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise Unavailable(f"{e.code().name}: {e.details()}") from e
        return ReplicaStatus(status.running_requests, status.latest_version,
                             max(status.known_latest_version, status.latest_version))

    async def close(self) -> None:
        await self._channel.close()
