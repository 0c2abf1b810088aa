"""gRPC edge of the gateway: `Gateway.Generate` (server-streaming) and `SubmitFeedback`.

Owns: reading the user's key from `authorization` metadata, proto <-> dataclass conversion,
and the status codes (`hotloop.errors` via `map_errors`; a missing or wrong key is
UNAUTHENTICATED). Feedback the core refuses is an OK call with `FeedbackAck(accepted=false,
reason)`, as gateway.proto's ack is designed; a bus that does not acknowledge is UNAVAILABLE,
so a client retries instead of believing it was stored.

Health: the server's own entry ("") is SERVING while the process serves (liveness, as HTTP
`/health`); the `hotloop.v1.Gateway` entry follows `GatewayCore.readiness` (as HTTP `/ready`),
NOT_SERVING while no replica can serve, re-read as often as the router polls the replicas.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2

from hotloop.grpcutil import create_server, map_errors
from hotloop.proto.v1 import gateway_pb2, gateway_pb2_grpc

from .core import GatewayCore
from .types import FeedbackIn, GenerateIn, Message

SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def _user(core: GatewayCore, context: grpc.aio.ServicerContext) -> str:
    return core.authenticate(dict(context.invocation_metadata() or ()).get("authorization"))


def generate_input(req: gateway_pb2.UserGenerateRequest) -> GenerateIn:
    return GenerateIn(
        messages=[Message(m.role, m.content) for m in req.messages], model=req.model,
        max_tokens=req.max_tokens,
        temperature=req.temperature if req.HasField("temperature") else 1.0,
        top_p=req.top_p if req.HasField("top_p") else 1.0,
        stop=list(req.stop),
    )


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore):
        self._core = core

    @map_errors
    async def Generate(self, request, context):
        user = _user(self._core, context)
        g = await self._core.generate(generate_input(request), user)
        try:
            async for d in g:
                chunk = gateway_pb2.UserGenerateChunk(
                    delta=d.text, response_id=g.response_id, policy_version=d.policy_version,
                    finish_reason=d.finish_reason)
                if d.finish_reason:  # n is 1 here: the choice's last delta is the response's
                    u = g.usage
                    chunk.prompt_tokens, chunk.completion_tokens = u.prompt_tokens, u.completion_tokens
                yield chunk
        finally:
            await g.aclose()  # a client that hung up releases its replica now, not at GC

    @map_errors
    async def SubmitFeedback(self, request, context):
        user = _user(self._core, context)
        r = await self._core.submit_feedback(FeedbackIn(
            response_id=request.response_id,
            score=request.score if request.HasField("score") else None,
            label=request.label, text=request.text, choice=request.choice,
        ), user)
        return gateway_pb2.FeedbackAck(accepted=r.accepted, reason=r.reason)


async def _follow_readiness(core: GatewayCore, health, server: grpc.aio.Server) -> None:
    """Set the Gateway service's health from `core.readiness()` until the server stops."""
    stopped = asyncio.ensure_future(server.wait_for_termination())
    last = None
    try:
        while not stopped.done():
            ready = core.readiness().ready
            if ready != last:
                await health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING if ready
                                 else health_pb2.HealthCheckResponse.NOT_SERVING)
                last = ready
            await asyncio.wait({stopped}, timeout=core.cfg.health_interval_s)
    finally:
        stopped.cancel()


_followers: set[asyncio.Task] = set()  # the loop holds tasks weakly


async def serve(core: GatewayCore, address: str):
    """Start the gRPC server (health and reflection included); returns (server, port, health)."""
    servicer = GatewayServicer(core)
    server, port, health = await create_server(
        [lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s)], [SERVICE], address,
    )
    follower = asyncio.create_task(_follow_readiness(core, health, server))
    _followers.add(follower)
    follower.add_done_callback(_followers.discard)
    return server, port, health
