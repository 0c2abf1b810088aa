"""gRPC edge of the reference service: protos in, dataclasses to the core, protos out.

Owns the conversions and `Reference.Logprobs`, a bidirectional stream fed straight into
`ReferenceCore.stream` (which batches whatever is waiting, up to its token budget). A request
the core cannot score (`InvalidRequest`) ends that stream with INVALID_ARGUMENT naming the
request id; the server and later streams are unaffected.
Does not own: scoring, batching or validation (the core), or the process (`__main__`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from hotloop.grpcutil import create_server, map_errors
from hotloop.proto.v1 import common_pb2, reference_pb2, reference_pb2_grpc

from .core import LogprobsRequest, LogprobsResult, ReferenceCore

SERVICE = reference_pb2.DESCRIPTOR.services_by_name["Reference"].full_name


def request_from_proto(req: reference_pb2.LogprobsRequest) -> LogprobsRequest:
    return LogprobsRequest(
        id=req.id, prompt_ids=list(req.prompt_ids), completion_ids=list(req.completion_ids)
    )


def request_to_proto(req: LogprobsRequest) -> reference_pb2.LogprobsRequest:
    return reference_pb2.LogprobsRequest(
        id=req.id, prompt_ids=list(req.prompt_ids), completion_ids=list(req.completion_ids)
    )


def result_to_proto(res: LogprobsResult) -> reference_pb2.LogprobsResult:
    return reference_pb2.LogprobsResult(id=res.id, logprobs=res.logprobs)


def result_from_proto(res: reference_pb2.LogprobsResult) -> LogprobsResult:
    return LogprobsResult(id=res.id, logprobs=list(res.logprobs))


class ReferenceServicer(reference_pb2_grpc.ReferenceServicer):
    def __init__(self, core: ReferenceCore) -> None:
        self._core = core

    @map_errors
    async def Logprobs(
        self,
        request_iterator: AsyncIterator[reference_pb2.LogprobsRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[reference_pb2.LogprobsResult]:
        async def requests() -> AsyncIterator[LogprobsRequest]:
            async for req in request_iterator:
                yield request_from_proto(req)

        async for res in self._core.stream(requests()):
            yield result_to_proto(res)

    async def Status(self, request, context) -> reference_pb2.ReferenceStatus:
        from hotloop.hardware import runtime_info

        return reference_pb2.ReferenceStatus(
            model=self._core.cfg.model,
            runtime=common_pb2.RuntimeInfo(**runtime_info(self._core.cfg.dtype)),
        )


async def serve(core: ReferenceCore, address: str) -> tuple[grpc.aio.Server, int, object]:
    """Start a server for `core` with health and reflection; returns (server, port, health)."""
    servicer = ReferenceServicer(core)
    return await create_server(
        [lambda s: reference_pb2_grpc.add_ReferenceServicer_to_server(servicer, s)],
        [SERVICE],
        address,
    )
