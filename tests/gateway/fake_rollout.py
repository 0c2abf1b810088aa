"""A scripted rollout replica: a real gRPC `Rollout` server that streams canned tokens.

The gateway is what these tests exercise; this stands in for the vLLM engine where a test needs
exact control (a replica that dies after k tokens, stalls, or refuses) or no engine at all.
It follows rollout.proto's stream contract: deltas per (prompt, sample), prompt ids on the
first message, the full version_spans on every message, `final` with the finish reason.
"""

from __future__ import annotations

import asyncio

import grpc

from hotloop.grpcutil import create_server
from hotloop.proto.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
WORDS = ["Hello", " there", ",", " friend", "!"]
PROMPT_IDS = [101, 102, 103, 104]


class ScriptedRollout(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, version: int = 3, delay_s: float = 0.0):
        self.version = version
        self.delay_s = delay_s
        self.requests: list[rollout_pb2.GenerateRequest] = []
        self.refuse: tuple[grpc.StatusCode, str] | None = None
        self.stall = False
        self.swap_at: int | None = None  # token index where an in-flight update lands
        self.sent = asyncio.Event()  # set after the first token went out
        self.running = 0
        self.lineage: str | None = None  # answer for this lineage instead of the request's
        self.tenant_versions: dict[str, int] = {}  # tenant -> the version its lineage serves

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.refuse is not None:
            await context.abort(*self.refuse)
        if self.stall:
            await asyncio.sleep(3600)
        self.running += 1
        try:
            n = request.sampling.n or 1
            limit = request.sampling.max_tokens or 16
            k = request.sampling.top_logprobs
            version = (self.tenant_versions.get(request.tenant, 0) if request.tenant
                       else self.version)
            for p in range(len(request.prompts)):
                for s in range(n):
                    words = WORDS[:limit]
                    spans = [common_pb2.VersionSpan(version=version, first_token=0)]
                    for i, w in enumerate(words):
                        if self.swap_at is not None and i == self.swap_at:
                            spans.append(common_pb2.VersionSpan(version=version + 1, first_token=i))
                        last = i == len(words) - 1
                        msg = rollout_pb2.Completion(
                            prompt_index=p, sample_index=s, text=w, token_ids=[1000 + i],
                            logprobs=[-0.5 - i], policy_version=version,
                            version_spans=spans, num_prompt_tokens=len(PROMPT_IDS),
                            final=last, finish_reason=("length" if len(words) == limit else "stop") if last else "",
                            tenant=request.tenant if self.lineage is None else self.lineage,
                        )
                        if i == 0 and request.return_prompt_ids:
                            msg.prompt_token_ids.extend(PROMPT_IDS)
                        if k:
                            msg.token_texts.append(w)
                            msg.top_logprobs.append(rollout_pb2.TopLogprobs(
                                token_ids=[1000 + i + j for j in range(k)],
                                logprobs=[-0.5 - i - j for j in range(k)],
                                tokens=[w if j == 0 else f"alt{j}" for j in range(k)]))
                        yield msg
                        self.sent.set()
                        if self.delay_s:
                            await asyncio.sleep(self.delay_s)
        finally:
            self.running -= 1

    async def Status(self, request, context):
        return rollout_pb2.RolloutStatus(
            model="fake", latest_version=self.version, running_requests=self.running,
            tenants=[rollout_pb2.TenantVersions(tenant=t, latest_version=v, known_latest_version=v)
                     for t, v in sorted(self.tenant_versions.items())])


async def start_fake(address: str = "127.0.0.1:0", **kw) -> tuple[ScriptedRollout, grpc.aio.Server, str]:
    """`address`: where to listen; a stopped replica comes back on its old address with it."""
    impl = ScriptedRollout(**kw)
    server, port, _ = await create_server(
        [lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(impl, s)], [SERVICE], address)
    return impl, server, f"127.0.0.1:{port}"
