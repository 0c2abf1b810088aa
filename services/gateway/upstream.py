"""A rollout replica over gRPC: the gateway's side of rollout.proto, through the one rollout
client (`hotloop.clients.RolloutClient`).

Owns: what the gateway asks of a replica (a stream in user priority, with prompt ids for the
traffic fork), the health probe (grpc health, then `Status` for the replica's load and
versions, each tenant's lineage's too), and mapping the replica's status codes to
`hotloop.errors`. Does not own: the wire format and the result type (`hotloop.clients`),
choosing a replica or retrying (routing.py, core.py).

No gRPC-level retry here: a Generate stream replayed after it produced tokens would duplicate
them, so a failed call is reported once and the core decides (it only retries a request on
another replica before any token has reached the user).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hotloop.clients import USER_PRIORITY, Completion, RolloutClient, direct_channel
from hotloop.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    HotloopError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from hotloop.proto.v1 import rollout_pb2

from .types import Replica, ReplicaStatus, UpstreamRequest

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
# First and longest wait between connects to a lost replica: a health probe must really try
# to connect soon after the replica comes back (see `direct_channel`).
RECONNECT_BACKOFF_MS = (100, 250)


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
        self._client = RolloutClient(address, direct_channel(address, RECONNECT_BACKOFF_MS), retry=False)
        self._health = health_pb2_grpc.HealthStub(self._client.channel)

    async def generate(self, req: UpstreamRequest) -> AsyncIterator[Completion]:
        chats = None if req.chats is None else [
            [{"role": m.role, "content": m.content} for m in chat] for chat in req.chats]
        stream = self._client.stream(
            chats, texts=req.texts if req.chats is None else None, n=req.n,
            max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, stop=req.stop,
            top_logprobs=req.top_logprobs, priority=USER_PRIORITY,
            return_prompt_ids=True,  # the traffic fork needs them
            request_id=req.request_id, timeout_s=req.timeout_s, tenant=req.tenant)
        try:
            async for c in stream:
                yield c
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(self.address, e) from e
        finally:
            await stream.aclose()  # cancels the call: aborts the engine's work when the user left

    async def probe(self, timeout_s: float) -> ReplicaStatus | None:
        try:
            h = await self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout_s)
            if h.status != health_pb2.HealthCheckResponse.SERVING:
                return None
            status = await self._client.status(timeout_s)
        except grpc.aio.AioRpcError as e:
            raise Unavailable(f"{e.code().name}: {e.details()}") from e
        return ReplicaStatus(
            status.running_requests, status.latest_version,
            max(status.known_latest_version, status.latest_version),
            tenants={t.tenant: t.latest_version for t in status.tenants},
            tenants_known={t.tenant: max(t.known_latest_version, t.latest_version)
                           for t in status.tenants})

    async def close(self) -> None:
        await self._client.close()
