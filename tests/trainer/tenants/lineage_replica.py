"""A rollout replica that keeps a lineage per tenant, without an engine, for trainer tests.

`LineageReplica` is a real gRPC `Rollout` server (port 0, the admin-token interceptor on
PushAdapter) that takes pushes into each tenant's lineage, checks their sha256, refuses a
version below the lineage's latest as the real one does, and answers `Status` with every
tenant's latest version. The thing under test is the trainer; a vLLM replica costs tens of
seconds per start (tests/trainer/recipes/test_online.py uses one). `traffic` builds what the
gateway stores for a served choice, with token ids any tiny model knows.
"""

from __future__ import annotations

import hashlib
import time

import grpc

from hotloop import grpcutil
from hotloop.proto.v1 import bus_pb2, common_pb2, rollout_pb2, rollout_pb2_grpc

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name


class LineageReplica(rollout_pb2_grpc.RolloutServicer):
    def __init__(self) -> None:
        self.pushes: list[tuple[str, int]] = []  # (tenant, version), in arrival order
        self.latest: dict[str, int] = {}

    async def PushAdapter(self, request_iterator, context):
        first = await anext(aiter(request_iterator))
        header = first.header
        buf = bytearray()
        async for msg in request_iterator:
            buf.extend(msg.data)
        info = header.info
        if len(buf) != info.bytes or hashlib.sha256(buf).hexdigest() != info.sha256:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sha256 mismatch")
        held = self.latest.get(header.tenant, 0)
        if info.version < held:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"v{info.version} is older than the lineage's v{held}")
        self.pushes.append((header.tenant, info.version))
        self.latest[header.tenant] = info.version
        return rollout_pb2.PushAdapterResponse(loaded=info, already_present=info.version == held)

    async def Status(self, request, context):
        return rollout_pb2.RolloutStatus(
            model="fake", latest_version=self.latest.get("", 0),
            tenants=[rollout_pb2.TenantVersions(tenant=t, latest_version=v)
                     for t, v in self.latest.items() if t])


async def start_replica(token: str) -> tuple[LineageReplica, grpc.aio.Server, str]:
    fake = LineageReplica()
    server, port, _ = await grpcutil.create_server(
        [lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(fake, s)], [SERVICE],
        "127.0.0.1:0", admin_methods=[f"/{SERVICE}/PushAdapter"], admin_token=token)
    return fake, server, f"127.0.0.1:{port}"


def traffic(rid: str, tenant: str, seed: int, version: int = 0) -> bus_pb2.TrafficEvent:
    """A served choice as the gateway records it: a few prompt and completion ids of the tiny
    model's vocabulary and behaviour logprobs near its uniform ones."""
    prompt = [3 + (seed * 7 + i) % 400 for i in range(5)]
    completion = [3 + (seed * 13 + 5 * i) % 400 for i in range(6)]
    return bus_pb2.TrafficEvent(
        response_id=rid, prompt_ids=prompt, completion_ids=completion,
        logprobs=[-6.2] * len(completion), policy_version=version, served_at=time.time(),
        version_spans=[common_pb2.VersionSpan(version=version, first_token=0)], user="u",
        choice=0, temperature=1.0, finish_reason="length", tenant=tenant)
