"""gRPC edge of the rollout service: protos in, dataclasses to the core, protos out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from opentelemetry import trace

from hotloop.adapters import version_from_proto, version_to_proto
from hotloop.errors import InvalidArgument
from hotloop.grpcutil import create_server, map_errors
from hotloop.hardware import runtime_info
from hotloop.proto.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from hotloop.tenants import TenantId

from .catchup import Lineages
from .core import CompletionOut, GenerateInput, PromptIn, RolloutCore, Sampling

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
ADMIN_METHODS = [f"/{SERVICE}/PushAdapter"]


def _prompt(p: common_pb2.Prompt) -> PromptIn:
    kind = p.WhichOneof("kind")
    if kind == "text":
        return PromptIn(text=p.text)
    if kind == "token_ids":
        return PromptIn(token_ids=list(p.token_ids.ids))
    if kind == "chat":
        return PromptIn(messages=[{"role": m.role, "content": m.content} for m in p.chat.messages])
    raise InvalidArgument("a prompt must set text, token_ids or chat")


def generate_input(req: rollout_pb2.GenerateRequest) -> GenerateInput:
    s = req.sampling
    return GenerateInput(
        prompts=[_prompt(p) for p in req.prompts],
        sampling=Sampling(
            n=s.n or 1, max_tokens=s.max_tokens,
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            top_k=s.top_k, seed=s.seed if s.HasField("seed") else None, stop=list(s.stop),
            top_logprobs=s.top_logprobs,
        ),
        pin_version=req.pin_version,
        return_prompt_ids=req.return_prompt_ids,
        request_id=req.request_id,
        stream=req.stream,
        priority=req.priority,
        tenant=TenantId(req.tenant),  # InvalidTenant: INVALID_ARGUMENT
    )


def completion_to_proto(c: CompletionOut) -> rollout_pb2.Completion:
    return rollout_pb2.Completion(
        prompt_index=c.prompt_index, sample_index=c.sample_index, text=c.text,
        token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
        policy_version=c.policy_version, prompt_token_ids=c.prompt_token_ids, final=c.final,
        version_spans=[common_pb2.VersionSpan(version=v, first_token=t) for v, t in c.version_spans],
        top_logprobs=[rollout_pb2.TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs,
                                              tokens=t.tokens) for t in c.top_logprobs],
        token_texts=c.token_texts, num_prompt_tokens=c.num_prompt_tokens, tenant=c.tenant,
    )


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, core: RolloutCore, catchup: Lineages | None = None):
        self.core = core
        self.catchup = catchup

    @map_errors
    async def Generate(self, request, context) -> AsyncIterator[rollout_pb2.Completion]:
        # aclosing: a cancelled client closes the core's generator now (aborting its engine
        # requests), not whenever the garbage collector gets to it.
        span = trace.get_current_span()
        first = True
        async with aclosing(self.core.generate(generate_input(request))) as completions:
            async for c in completions:
                if first:  # time to first token, inside the replica (a trace shows the hops)
                    span.add_event("first_token")
                    first = False
                yield completion_to_proto(c)

    @map_errors
    async def PushAdapter(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "header":
            raise InvalidArgument("a push must start with a header message")
        header = first.header

        async def chunks():
            async for msg in request_iterator:
                if msg.WhichOneof("kind") != "data":
                    raise InvalidArgument("only data chunks may follow the header")
                yield msg.data

        res = await self.core.push(
            version_from_proto(header.info), chunks(), make_latest=header.make_latest,
            tenant=TenantId(header.tenant),  # InvalidTenant: INVALID_ARGUMENT
        )
        return rollout_pb2.PushAdapterResponse(
            loaded=version_to_proto(res.version), verify_ms=res.verify_ms, load_ms=res.load_ms,
            already_present=res.already_present,
        )

    def _tenants(self) -> list[rollout_pb2.TenantVersions]:
        """Every tenant the replica holds a version of or knows announced."""
        held = self.core.tenants()
        lineages = self.catchup
        known = lineages.tenants() if lineages is not None else []
        out = []
        for t in sorted(set(held) | set(known)):
            latest, versions = held.get(t, (0, []))
            c = lineages[t] if lineages is not None and t in lineages else None
            out.append(rollout_pb2.TenantVersions(
                tenant=t, latest_version=latest, versions=[version_to_proto(v) for v in versions],
                known_latest_version=max(latest, c.known_latest if c is not None else 0),
                catch_up=c.error if c is not None and c.behind else ""))
        return out

    async def Status(self, request, context):
        c = self.catchup.default if self.catchup is not None else None
        return rollout_pb2.RolloutStatus(
            model=self.core.base_model,
            latest_version=self.core.latest,
            versions=[version_to_proto(v) for v in self.core.versions()],
            running_requests=self.core.running(),
            foreground_requests=self.core.users.foreground,
            waiting_requests=self.core.users.waiting,
            update_mode=self.core.mode,
            engine=self.core.engine_name,
            runtime=common_pb2.RuntimeInfo(**runtime_info(self.core.dtype)),
            swap=self.core.swap,
            known_latest_version=c.known_latest if c is not None else self.core.latest,
            catch_up=c.error if c is not None and c.behind else "",
            tenants=self._tenants(),
            resident_adapters=[x or "" for x in self.core.tenant_slots().get("resident", [])],
        )

    async def WatchLoad(self, request, context):
        board = self.core.users.board
        path, nonce = (str(board.path), board.nonce) if board is not None else ("", 0)
        async for foreground, waiting in self.core.users.watch():
            yield rollout_pb2.RolloutLoad(foreground_requests=foreground, waiting_requests=waiting,
                                          board_path=path, board_nonce=nonce)


async def serve(core: RolloutCore, address: str, admin_token: str,
                catchup: Lineages | None = None) -> tuple[grpc.aio.Server, int, object]:
    """`catchup`: what Status reports of the mesh's latest version of each lineage (None: no
    bus)."""
    servicer = RolloutServicer(core, catchup)
    return await create_server(
        [lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, s)],
        [SERVICE], address, admin_methods=ADMIN_METHODS, admin_token=admin_token,
    )
