"""The gateway core: authenticate, validate, route to a rollout replica, stream, fork, take
feedback. No sockets, no grpc or HTTP types: the edges (http.py, server.py) convert.

Owns:
- request validation against the gateway's limits (the replica validates again, and its
  refusals, e.g. a prompt over its token limit, reach the user as the same 4xx);
- response ids (`chatcmpl-…` / `cmpl-…`, valid NATS subject tokens) and the request deadline;
- the generation itself: pick a replica, and if it fails before the first token try the next
  healthy one (nothing has reached the user yet, so this is invisible); once tokens flow, a
  failure ends the response with an error, never with a made-up finish_reason;
- the traffic fork: each choice that finishes is queued for TRAFFIC without waiting;
- readiness (`readiness()`): whether a request arriving now has a replica to go to, and why
  not; HTTP `/ready` and the Gateway service's gRPC health both report it;
- its Prometheus metrics (`registry`): the counters of `Metrics` and the replica table, read
  when scraped, and the time to a request's first token;
- feedback: checked against the responses this gateway served (a bounded TTL map), else
  against TRAFFIC on the bus (so a restarted gateway still takes feedback on what it forked),
  then published to FEEDBACK and acknowledged only once JetStream stored it;
- tenants: each key id's tenant (`hotloop.tenants.Directory`, from `[tenants]`) goes with its
  requests to the replica (whose lineage serves it) and with their traffic; feedback is
  published on the subject of the tenant that served the response (`bus.feedback_subject`),
  which only that tenant's trainer reads; a tenant's request is routed by its lineage's
  versions (`Router.pick(tenant=)`, fed the tenants' announced versions by
  `BusEvents.watch_lineages`).

Feedback rules (the edges map `FeedbackResult.outcome`):
- exactly one of `score` (finite, in [-1, 1]) and `label` ("up" = +1, "down" = -1), a choice in
  range that finished, a comment within the limit: else `invalid` (HTTP 400, ack false);
- a response id this gateway (or TRAFFIC) does not know, that expired, that was served to
  another key, or whose traffic record was dropped: `unknown_response` (HTTP 404, ack false;
  another key's responses are indistinguishable from unknown ones);
- feedback is published only after the choice's traffic record is stored (the trainer
  dead-letters feedback without one); a record still queued after `feedback_wait_s` is
  `Unavailable` (retry);
- the same (response, choice, key) again within the FEEDBACK duplicate window: accepted with
  reason "duplicate" (stored once);
- the bus not acknowledging: `Unavailable` (HTTP 503 / UNAVAILABLE: retry), never "accepted".

Does not own: the wire to replicas (upstream.py), replica health (routing.py), the bus
(events.py), key storage (keys.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Histogram

from hotloop import telemetry
from hotloop.metrics import LATENCY_BUCKETS, StateCollector, counter, gauge
from hotloop.tenants import DEFAULT, Directory, TenantId
from hotloop.errors import (
    DeadlineExceeded,
    HotloopError,
    InvalidArgument,
    NotFound,
    Unauthenticated,
    Unavailable,
)

from .config import GatewayConfig
from .events import BusEvents
from .keys import KeyConfigError, KeyRing
from .routing import ReplicaState, Router
from .types import (
    Completion,
    Delta,
    FeedbackIn,
    FeedbackResult,
    GenerateIn,
    ServedChoice,
    TokenLogprob,
    UpstreamRequest,
    Usage,
)

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
MAX_TOP_LOGPROBS = 20  # common.proto SamplingParams.top_logprobs: 0..20
FINISH_REASONS = ("stop", "length")
_SUBJECT_UNSAFE = set(". *>\t\r\n:")  # response ids are NATS subject tokens and msg-id parts


class BadRequest(InvalidArgument):
    """A request the gateway refuses, naming the offending parameter (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Metrics:
    """What the gateway counts; `status()` reports it and `/metrics` exports it (as named in
    `GatewayCore._metric_families`)."""

    requests: int = 0
    succeeded: int = 0
    unauthenticated: int = 0
    invalid: int = 0  # refused by the gateway's or the replica's validation
    unavailable: int = 0  # no healthy replica, or the replica failed
    deadline_exceeded: int = 0
    rerouted: int = 0  # a replica failed before the first token; another one served
    wrong_tenant: int = 0  # a replica answered from another tenant's lineage: refused
    cancelled: int = 0  # the client went away
    completion_tokens: int = 0
    feedback_accepted: int = 0
    feedback_duplicate: int = 0
    feedback_rejected: int = 0


@dataclass
class _Served:
    user: str
    choices: int
    tenant: TenantId = DEFAULT
    finished: set[int] = field(default_factory=set)
    expires_at: float = 0.0
    # per finished choice: resolves once its TRAFFIC record is stored (None: it was dropped)
    traffic: dict[int, asyncio.Future | None] = field(default_factory=dict)


class ResponseIndex:
    """Responses served by this gateway, for feedback: bounded in count and in age."""

    def __init__(self, ttl_s: float, max_entries: int, clock=time.monotonic):
        self._ttl_s, self._max, self._clock = ttl_s, max_entries, clock
        self._entries: OrderedDict[str, _Served] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, response_id: str, user: str, choices: int, tenant: TenantId = DEFAULT) -> _Served:
        entry = _Served(user, choices, tenant, expires_at=self._clock() + self._ttl_s)
        self._entries[response_id] = entry
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)  # insertion order is age order
        return entry

    def get(self, response_id: str) -> _Served | None:
        entry = self._entries.get(response_id)
        if entry is not None and entry.expires_at < self._clock():
            del self._entries[response_id]
            return None
        return entry


def _version_at(spans: list[tuple[int, int]], token: int) -> int:
    """The version that produced token `token` (spans ascend by first token)."""
    version = spans[0][0]
    for v, first in spans:
        if first <= token:
            version = v
    return version


def _subject_safe(response_id: str) -> bool:
    return bool(response_id) and len(response_id) <= 128 and not (set(response_id) & _SUBJECT_UNSAFE)


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str


class GatewayCore:
    def __init__(self, cfg: GatewayConfig, keys: KeyRing, router: Router, events: BusEvents,
                 served_model: str, registry: CollectorRegistry | None = None,
                 tenants: Directory | None = None):
        """`registry`: where the metrics go (the process's, `hotloop.metrics.registry()`, in
        a service; a private one by default). `tenants`: which tenant each key id is in (none:
        every user is in the default tenant)."""
        self.cfg = cfg
        self.keys = keys
        self.tenants = tenants if tenants is not None else Directory({})
        unknown = sorted(self.tenants.key_ids() - keys.ids())
        if unknown:
            raise KeyConfigError(f"[tenants] name key ids that no API key has: {', '.join(unknown)}")
        self.router = router
        self.events = events
        self.served_model = served_model
        self.metrics = Metrics()
        self.responses = ResponseIndex(cfg.response_ttl_s, cfg.max_remembered_responses)
        self._in_flight = 0
        self._tracer = telemetry.tracer("hotloop.gateway")
        self.registry = registry if registry is not None else CollectorRegistry()
        StateCollector(self._metric_families, self.registry)
        self._first_token_s = Histogram(
            "hotloop_gateway_time_to_first_token_seconds",
            "Seconds from a generation request's arrival to the first message from a replica "
            "(validation, routing, retries on another replica, the replica's queue and prefill).",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self._inter_token_s = Histogram(
            "hotloop_gateway_inter_token_seconds",
            "Seconds between two tokens of one choice as the gateway receives them from the "
            "replica (a message of k tokens: its gap over k, for each of them); a choice's first "
            "tokens are its time to first token instead.", buckets=LATENCY_BUCKETS,
            registry=self.registry)

    async def start(self) -> None:
        await self.events.start()
        # before the first poll: a tenant's request is routed by its announced version at once
        await self.events.watch_lineages(self.router.announced)
        await self.router.start()

    async def close(self) -> None:
        await self.router.close()
        await self.events.close()

    # ---- auth ---------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> str:
        """The caller's key id, or Unauthenticated."""
        try:
            return self.keys.authenticate(authorization)
        except Unauthenticated:
            self.metrics.unauthenticated += 1
            raise

    # ---- generation ---------------------------------------------------------------------
    def _validate(self, req: GenerateIn) -> UpstreamRequest:
        cfg = self.cfg
        if req.model and req.model != self.served_model:
            raise NotFound(f"the model {req.model!r} does not exist; this gateway serves {self.served_model!r}")
        if req.messages is not None:
            if not req.messages:
                raise BadRequest("messages must not be empty", "messages")
            if len(req.messages) > cfg.max_messages:
                raise BadRequest(f"{len(req.messages)} messages; at most {cfg.max_messages}", "messages")
            for i, m in enumerate(req.messages):
                if m.role not in ROLES:
                    raise BadRequest(f"messages[{i}].role {m.role!r} is not one of {list(ROLES)}",
                                     f"messages[{i}].role")
            chars, param = sum(len(m.content) for m in req.messages), "messages"
        else:
            if not req.prompts:
                raise BadRequest("prompt must not be empty", "prompt")
            if len(req.prompts) > cfg.max_prompts:
                raise BadRequest(f"{len(req.prompts)} prompts; at most {cfg.max_prompts}", "prompt")
            if any(not p for p in req.prompts):
                raise BadRequest("a prompt must not be the empty string", "prompt")
            chars, param = max(len(p) for p in req.prompts), "prompt"
        if chars > cfg.max_prompt_chars:
            raise BadRequest(f"the prompt has {chars} characters; at most {cfg.max_prompt_chars}", param)
        if not 1 <= req.n <= cfg.max_n:
            raise BadRequest(f"n={req.n} is out of range 1..{cfg.max_n}", "n")
        max_tokens = req.max_tokens or cfg.default_max_tokens
        if not 1 <= max_tokens <= cfg.max_tokens:
            raise BadRequest(f"max_tokens={max_tokens} is out of range 1..{cfg.max_tokens}", "max_tokens")
        if not (math.isfinite(req.temperature) and 0 <= req.temperature <= 2):
            raise BadRequest(f"temperature={req.temperature} is out of range [0, 2]", "temperature")
        if not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
            raise BadRequest(f"top_p={req.top_p} is out of range (0, 1]", "top_p")
        if req.temperature == 0 and req.n > 1:
            raise BadRequest("temperature 0 (greedy) gives one answer: use n=1", "n")
        if len(req.stop) > cfg.max_stop:
            raise BadRequest(f"{len(req.stop)} stop strings; at most {cfg.max_stop}", "stop")
        if any(not s for s in req.stop):
            raise BadRequest("a stop string must not be empty", "stop")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs={req.top_logprobs} is out of range 0..{MAX_TOP_LOGPROBS}",
                             "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs", "top_logprobs")
        return UpstreamRequest(
            chats=[list(req.messages)] if req.messages is not None else None,
            texts=list(req.prompts) if req.messages is None else None,
            n=req.n, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
            stop=list(req.stop),
            # The replica sends token texts only with alternatives: ask for at least one when
            # the user wants logprobs, and trim to what they asked for.
            top_logprobs=max(1, req.top_logprobs) if req.logprobs else 0,
            request_id="", timeout_s=cfg.request_timeout_s,
        )

    async def generate(self, req: GenerateIn, user: str) -> "Generation":
        """Validate, route, and wait for the first message from a replica (so validation
        errors of the replica and "no replica" arrive before anything is sent to the user).
        The caller must iterate the result to its end or `aclose()` it."""
        self.metrics.requests += 1
        t0 = time.perf_counter()
        try:
            up = self._validate(req)
        except (InvalidArgument, NotFound):
            self.metrics.invalid += 1
            raise
        chat = req.messages is not None
        tenant = self.tenants.tenant_of(user)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.request_timeout_s
        span = self._tracer.start_span("gateway.generate", attributes={
            "hotloop.response_id": rid, "hotloop.user": user, "hotloop.tenant": tenant,
            "hotloop.n": req.n})
        tried: set[int] = set()
        while True:
            try:
                state = self.router.pick(exclude=tried, tenant=tenant)
            except Unavailable as e:
                self._fail(span, e)
                raise
            tried.add(id(state))
            stream = state.replica.generate(replace(
                up, request_id=rid, timeout_s=max(0.001, deadline - loop.time()), tenant=tenant))
            self.router.acquire(state)
            try:
                # the upstream call starts at the first anext: under this span, so the
                # replica's spans join the request's trace
                with trace.use_span(span, end_on_exit=False):
                    async with asyncio.timeout_at(deadline):
                        first = await anext(stream)
            except StopAsyncIteration:
                err: HotloopError = Unavailable(f"rollout replica {state.replica.address} sent nothing")
            except TimeoutError:
                err = DeadlineExceeded(f"no token within the request deadline of {self.cfg.request_timeout_s:g}s")
            except HotloopError as e:
                err = e
            except BaseException:  # cancelled by the caller
                await stream.aclose()
                self.router.release(state, ok=False)
                span.end()
                raise
            else:
                self._first_token_s.observe(time.perf_counter() - t0)
                span.set_attribute("hotloop.replica", state.replica.address)
                span.set_attribute("hotloop.policy_version", first.policy_version)
                return Generation(self, req, up, rid, user, tenant, state, stream, first, deadline,
                                  span)
            await stream.aclose()
            self.router.release(state, ok=False)
            if isinstance(err, Unavailable):
                # nothing reached the user: try the next healthy replica
                self.replica_failed(state, err)
                self.metrics.rerouted += 1
                continue
            self._fail(span, err)
            raise err

    def replica_failed(self, state: ReplicaState, err: HotloopError) -> None:
        """Mark `state`'s replica down after it failed a request with `err`. The replica's
        reason may name the request's tenant (a version it has not fetched yet, the adapter
        slots it waited for): it goes to the log; the router keeps a reason without it, since
        every user's 503 and the unauthenticated `/ready` say why each replica is down."""
        log.warning("rollout replica %s failed a request: %s", state.replica.address, err)
        self.router.mark_down(state.replica, "it failed a request (the gateway's log says how)")

    def _fail(self, span, e: BaseException) -> None:
        if isinstance(e, (InvalidArgument, NotFound)):
            self.metrics.invalid += 1
        elif isinstance(e, DeadlineExceeded):
            self.metrics.deadline_exceeded += 1
        elif isinstance(e, Unavailable):
            self.metrics.unavailable += 1
        span.set_attribute("hotloop.error", str(e))
        span.end()

    # ---- feedback -----------------------------------------------------------------------
    async def submit_feedback(self, fb: FeedbackIn, user: str) -> FeedbackResult:
        result = await self._feedback(fb, user)
        if not result.accepted:
            self.metrics.feedback_rejected += 1
        elif result.outcome == "duplicate":
            self.metrics.feedback_duplicate += 1
        else:
            self.metrics.feedback_accepted += 1
        return result

    async def _feedback(self, fb: FeedbackIn, user: str) -> FeedbackResult:
        def invalid(why: str) -> FeedbackResult:
            return FeedbackResult(False, "invalid", why)

        def unknown() -> FeedbackResult:
            return FeedbackResult(False, "unknown_response",
                                  f"unknown or expired response id {fb.response_id!r}")

        if (fb.score is None) == (not fb.label):
            return invalid("give exactly one of score (in [-1, 1]) and label (\"up\" or \"down\")")
        if fb.label:
            if fb.label not in ("up", "down"):
                return invalid(f"label {fb.label!r} is not \"up\" or \"down\"")
            score = 1.0 if fb.label == "up" else -1.0
        else:
            score = float(fb.score)
            if not (math.isfinite(score) and -1.0 <= score <= 1.0):
                return invalid(f"score {fb.score} is not a number in [-1, 1]")
        if len(fb.text) > self.cfg.max_feedback_text_chars:
            return invalid(f"text has {len(fb.text)} characters; at most {self.cfg.max_feedback_text_chars}")
        if fb.choice < 0:
            return invalid(f"choice {fb.choice} is negative")
        if not _subject_safe(fb.response_id):
            return unknown()
        entry = self.responses.get(fb.response_id)
        if entry is not None:
            if entry.user != user:
                return unknown()
            tenant = entry.tenant
            if fb.choice >= entry.choices:
                return invalid(f"choice {fb.choice} is out of range: the response has "
                               f"{entry.choices} choice{'s' * (entry.choices > 1)}")
            if fb.choice not in entry.finished:
                return invalid(f"choice {fb.choice} of {fb.response_id} did not finish")
            # The trainer joins feedback to its traffic record and dead-letters feedback that
            # has none, so the record must be stored before the feedback is published.
            stored = entry.traffic.get(fb.choice)
            if stored is None:
                return FeedbackResult(False, "unknown_response", (
                    f"the traffic record of {fb.response_id} choice {fb.choice} was dropped "
                    "(the gateway was overloaded): feedback on it cannot be learned from"))
            try:
                ok = await asyncio.wait_for(asyncio.shield(stored), self.cfg.feedback_wait_s)
            except TimeoutError:
                raise Unavailable("the response's traffic record is not stored yet; retry") from None
            if not ok:
                return FeedbackResult(False, "unknown_response", (
                    f"the traffic record of {fb.response_id} choice {fb.choice} could not be "
                    "stored: feedback on it cannot be learned from"))
        else:
            # Not in memory (restarted gateway, or forgotten): TRAFFIC is the record.
            served = await self.events.traffic(fb.response_id, fb.choice)
            if served is None:
                if fb.choice > 0 and await self.events.traffic(fb.response_id, 0) is not None:
                    return invalid(f"choice {fb.choice} of {fb.response_id} was not served")
                return unknown()
            if served.user != user:
                return unknown()
            tenant = served.tenant
        # the tenant whose lineage served the response, the one whose trainer learns from it
        duplicate = await self.events.publish_feedback(
            fb.response_id, fb.choice, user, score, fb.label, fb.text, time.time(), tenant)
        if duplicate:
            return FeedbackResult(True, "duplicate", "duplicate")
        return FeedbackResult(True, "accepted", "")

    # ---- status -------------------------------------------------------------------------
    def readiness(self) -> Readiness:
        """Whether a request arriving now has a replica to go to, and why (not). The one
        place that decides it: `/ready` and the gRPC health of the Gateway service read it,
        and it must agree with which replicas `Router.pick` would choose."""
        states = self.router.states
        able = self.router.servable()
        if able:
            return Readiness(True, f"{len(able)} of {len(states)} rollout replicas can serve")
        if not states:
            return Readiness(False, "no rollout replica found ([endpoints] rollout resolves to "
                                    "no address yet)")
        why = "; ".join(f"{s.replica.address}: {self.router.why_not(s)}" for s in states)
        return Readiness(False, f"no healthy rollout replica ({why})")

    def tenant_status(self, tenant: TenantId) -> dict:
        """What one tenant's user may see (`GET /v1/hotloop/status` with a user key): its own
        lineage's newest version and each replica's version of it, nothing of another tenant
        (not its name, versions or traffic; gateway-wide counters and replicas' addresses and
        load are the operator's, in `status`). The default tenant's is the default lineage."""
        r = self.router
        if tenant.is_default:
            newest = r.newest
            replicas = [{"healthy": s.healthy, "version": s.version, "version_lag": r.lag(s),
                         "may_serve": r.may_serve(s)} for s in r.states]
        else:
            newest = r.tenant_newest.get(tenant, 0)
            replicas = [{"healthy": s.healthy, "version": s.tenants.get(tenant, 0),
                         "version_lag": r.tenant_lag(s, tenant), "may_serve": s.healthy}
                        for s in r.states]
        return {"model": self.served_model, "tenant": tenant, "newest_version": newest,
                "replicas": replicas}

    def status(self) -> dict:
        """The operator's view (the admin token's): every tenant, counters, replicas."""
        t = self.events.counters
        return {
            "model": self.served_model,
            "in_flight": self._in_flight,
            "remembered_responses": len(self.responses),
            "counters": {
                **self.metrics.__dict__,
                "traffic_forked": t.forked, "traffic_published": t.published,
                "traffic_dropped": t.dropped, "traffic_publish_errors": t.publish_errors,
            },
            "traffic_queued": self.events.queued,
            "newest_version": self.router.newest,
            "tenant_newest_versions": dict(self.router.tenant_newest),
            "tenant_behind_picks": self.router.behind_picks,
            "replicas": [
                {"address": s.replica.address, "healthy": s.healthy, "reason": s.reason,
                 "version": s.version, "version_lag": self.router.lag(s),
                 "tenant_versions": dict(s.tenants),
                 "may_serve": self.router.may_serve(s),
                 "in_flight": s.in_flight, "other_load": s.others, "served": s.served,
                 "failures": s.failures}
                for s in self.router.states
            ],
        }

    def _metric_families(self):
        """The gateway's state as Prometheus families, read when scraped (`hotloop.metrics`:
        in the endpoint's thread, so only ints, `len` and copied lists are read)."""
        m, t = self.metrics, self.events.counters
        yield counter("hotloop_gateway_requests_total",
                      "Generation requests received (HTTP and gRPC).", m.requests)
        yield counter("hotloop_gateway_requests_succeeded_total",
                      "Generation requests whose every choice finished.", m.succeeded)
        yield counter(
            "hotloop_gateway_request_errors_total",
            "Requests refused or failed, by gRPC status code: invalid_argument (the gateway's or "
            "the replica's validation), unavailable (no replica may serve, or it failed), "
            "deadline_exceeded, cancelled (the client went away), unauthenticated (any call "
            "with a missing or wrong key, feedback and status included).",
            labels=["code"], samples=[
                (["invalid_argument"], m.invalid), (["unavailable"], m.unavailable),
                (["deadline_exceeded"], m.deadline_exceeded), (["cancelled"], m.cancelled),
                (["unauthenticated"], m.unauthenticated)])
        yield counter("hotloop_gateway_reroutes_total",
                      "Requests a replica failed before their first token, sent to another.",
                      m.rerouted)
        yield counter("hotloop_gateway_wrong_tenant_total",
                      "Answers a replica gave from another tenant's lineage than the caller's: "
                      "refused, never passed to the user (a replica gone wrong; should stay 0).",
                      m.wrong_tenant)
        yield counter("hotloop_gateway_completion_tokens_total", "Tokens generated for users.",
                      m.completion_tokens)
        yield counter("hotloop_gateway_feedback_total", "Feedback submitted, by outcome.",
                      labels=["outcome"], samples=[
                          (["accepted"], m.feedback_accepted), (["duplicate"], m.feedback_duplicate),
                          (["rejected"], m.feedback_rejected)])
        yield counter("hotloop_gateway_traffic_forked_total",
                      "Finished choices queued for the TRAFFIC stream.", t.forked)
        yield counter("hotloop_gateway_traffic_published_total",
                      "Finished choices stored in the TRAFFIC stream.", t.published)
        yield counter("hotloop_gateway_traffic_dropped_total",
                      "Finished choices dropped because the traffic queue was full (feedback on "
                      "them cannot be learned from).", t.dropped)
        yield counter("hotloop_gateway_traffic_publish_errors_total",
                      "Finished choices the bus did not store within its outage bound.",
                      t.publish_errors)
        yield gauge("hotloop_gateway_requests_in_flight", "Generation requests being answered.",
                    self._in_flight)
        yield gauge("hotloop_gateway_traffic_queued", "Finished choices waiting to be published.",
                    self.events.queued)
        yield gauge("hotloop_gateway_remembered_responses",
                    "Served responses held in memory for feedback.", len(self.responses))
        yield gauge("hotloop_gateway_ready",
                    "1 when a request arriving now has a replica that may serve it (as /ready).",
                    int(bool(self.router.servable())))
        yield gauge("hotloop_gateway_newest_version",
                    "The newest policy version any replica serves or knows announced.",
                    self.router.newest)
        newest = sorted(list(self.router.tenant_newest.items()))  # a copy: the loop may add one
        yield gauge("hotloop_gateway_tenant_newest_version",
                    "The newest version of each tenant's lineage announced on the bus or seen at "
                    "any replica.", labels=["tenant"], samples=[([t], v) for t, v in newest])
        yield counter("hotloop_gateway_tenant_behind_picks_total",
                      "Tenants' requests sent to a replica behind the tenant's newest version "
                      "because no healthy replica had it.", self.router.behind_picks)
        states = self.router.states

        def per_replica(family, name: str, doc: str, value) -> object:
            return family(name, doc, labels=["address"],
                          samples=[([s.replica.address], value(s)) for s in states])

        yield per_replica(gauge, "hotloop_gateway_replica_healthy",
                          "1 while the replica answers its health polls and requests.",
                          lambda s: int(s.healthy))
        yield per_replica(gauge, "hotloop_gateway_replica_may_serve",
                          "1 while the replica gets users: healthy and within max_version_lag.",
                          lambda s: int(self.router.may_serve(s)))
        yield per_replica(gauge, "hotloop_gateway_replica_version",
                          "The policy version the replica served at its last poll.",
                          lambda s: s.version)
        yield gauge("hotloop_gateway_replica_tenant_version",
                    "The version of each tenant's lineage the replica served at its last poll.",
                    labels=["address", "tenant"],
                    samples=[([s.replica.address, t], v) for s in states
                             for t, v in sorted(list(s.tenants.items()))])
        yield per_replica(gauge, "hotloop_gateway_replica_version_lag",
                          "Versions the replica is behind the newest version seen.",
                          self.router.lag)
        yield per_replica(gauge, "hotloop_gateway_replica_requests_in_flight",
                          "This gateway's requests on the replica now.", lambda s: s.in_flight)
        yield per_replica(counter, "hotloop_gateway_replica_requests_served_total",
                          "Requests the replica answered to their end.", lambda s: s.served)
        yield per_replica(counter, "hotloop_gateway_replica_failures_total",
                          "Requests the replica failed.", lambda s: s.failures)

    def servable_replicas(self) -> list[str]:
        """Addresses of the replicas a user request may go to now (healthy, and within
        `max_version_lag` of the newest version seen); empty: requests get 503/UNAVAILABLE."""
        return [s.replica.address for s in self.router.servable()]


@dataclass
class _Choice:
    prompt_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: str = ""
    tokens_at: float = 0.0  # perf_counter when its last tokens arrived (0: none yet)


class Generation:
    """One response in flight. Iterate it for `Delta`s; `usage` is complete at the end.

    Choice `i` of prompt `p` is `p * n + i` (OpenAI's order for several prompts).
    """

    def __init__(self, core: GatewayCore, req: GenerateIn, up: UpstreamRequest, response_id: str,
                 user: str, tenant: TenantId, state: ReplicaState, stream: AsyncIterator[Completion],
                 first: Completion, deadline: float, span):
        self.response_id = response_id
        self.created = int(time.time())
        self.model = core.served_model
        self.policy_version = first.policy_version  # the version the request was admitted on
        self.user = user
        self.tenant = tenant
        # the lineage the replica says it served from (its first message): said to the client,
        # who can check it against its key's tenant; a mismatch is refused in `_absorb`
        self.served_tenant = first.tenant
        self._n_prompts = len(up.chats if up.chats is not None else up.texts)
        self.choices = self._n_prompts * up.n
        self._core, self._req, self._n = core, req, up.n
        self._state, self._stream, self._first = state, stream, first
        self._deadline, self._span = deadline, span
        self._by_choice: dict[int, _Choice] = {}
        self._prompt_ids: dict[int, list[int]] = {}
        self._prompt_tokens: dict[int, int] = {}
        self._closed = False
        self._ok = False
        self._entry = core.responses.add(response_id, user, self.choices, tenant)
        core._in_flight += 1

    @property
    def usage(self) -> Usage:
        # A prompt counts once however many choices it has (OpenAI's accounting).
        prompt = sum(self._prompt_tokens.get(p) or len(self._prompt_ids.get(p, []))
                     for p in range(self._n_prompts))
        return Usage(prompt, sum(len(c.token_ids) for c in self._by_choice.values()))

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        try:
            pending: Completion | None = self._first
            while True:
                if pending is None:
                    try:
                        async with asyncio.timeout_at(self._deadline):
                            pending = await anext(self._stream)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        raise DeadlineExceeded(
                            f"the response ran past the request deadline of "
                            f"{self._core.cfg.request_timeout_s:g}s") from None
                up, pending = pending, None
                delta = self._absorb(up)
                if delta is not None:
                    yield delta
            unfinished = [c for c in range(self.choices) if c not in self._entry.finished]
            if unfinished:
                raise Unavailable(f"rollout replica {self._state.replica.address} ended the stream "
                                  f"before choice{'s' * (len(unfinished) > 1)} {unfinished} finished")
            self._ok = True
        except HotloopError as e:
            if isinstance(e, Unavailable):
                self._core.replica_failed(self._state, e)
            self._core._fail(self._span, e)
            self._span = None
            raise
        except (asyncio.CancelledError, GeneratorExit):
            self._core.metrics.cancelled += 1
            raise
        finally:
            await self.aclose()

    def _absorb(self, up: Completion) -> Delta | None:
        if up.prompt_token_ids:
            self._prompt_ids[up.prompt_index] = up.prompt_token_ids
        if up.num_prompt_tokens:
            self._prompt_tokens[up.prompt_index] = up.num_prompt_tokens
        if up.tenant != self.tenant:
            # never pass on an answer of another tenant's lineage, whatever the replica did
            self._core.metrics.wrong_tenant += 1
            # the other tenant's name is the operator's (the log), never this user's
            log.warning("rollout replica %s answered a request of tenant %r from the lineage "
                        "of tenant %r: refused", self._state.replica.address, self.tenant, up.tenant)
            raise Unavailable(f"rollout replica {self._state.replica.address} answered from "
                              "another tenant's lineage than yours: refused")
        index = up.prompt_index * self._n + up.sample_index
        if not 0 <= index < self.choices or index in self._entry.finished:
            raise Unavailable(f"rollout replica {self._state.replica.address} sent an unexpected "
                              f"message for prompt {up.prompt_index}, sample {up.sample_index}")
        c = self._by_choice.setdefault(index, _Choice(up.prompt_index))
        start = len(c.token_ids)
        if up.token_ids:
            now = time.perf_counter()
            if c.tokens_at:
                gap = (now - c.tokens_at) / len(up.token_ids)
                for _ in up.token_ids:
                    self._core._inter_token_s.observe(gap)
            c.tokens_at = now
        c.token_ids += up.token_ids
        c.logprobs += up.logprobs
        c.spans = up.version_spans or c.spans or [(up.policy_version, 0)]
        self._core.metrics.completion_tokens += len(up.token_ids)
        logprobs = None
        if self._req.logprobs:
            k = self._req.top_logprobs
            texts = up.token_texts or ([up.text] if len(up.token_ids) == 1 else [""] * len(up.token_ids))
            tops = up.top_logprobs or [[] for _ in up.token_ids]
            logprobs = [TokenLogprob(t, lp, [(alt, alt_lp) for _, alt_lp, alt in top[:k]])
                        for t, lp, top in zip(texts, up.logprobs, tops)]
        finish = ""
        if up.final:
            if up.finish_reason not in FINISH_REASONS:
                raise Unavailable(f"rollout replica {self._state.replica.address} ended choice "
                                  f"{index} with {up.finish_reason or 'no finish reason'!r}")
            finish = c.finish_reason = up.finish_reason
            self._entry.finished.add(index)
            self._fork(index, c)
        elif not up.text and not up.token_ids:
            return None
        last = start + len(up.token_ids) - 1
        version = _version_at(c.spans, last) if last >= 0 else _version_at(c.spans, max(0, start - 1))
        return Delta(choice=index, text=up.text, policy_version=version, logprobs=logprobs,
                     finish_reason=finish, num_tokens=len(up.token_ids))

    def _fork(self, index: int, c: _Choice) -> None:
        served = ServedChoice(
            response_id=self.response_id, choice=index, user=self.user,
            prompt_ids=self._prompt_ids.get(c.prompt_index, []),
            completion_ids=c.token_ids, logprobs=c.logprobs, version_spans=c.spans,
            temperature=self._req.temperature, finish_reason=c.finish_reason, served_at=time.time(),
            tenant=self.tenant,
        )
        stored = self._entry.traffic[index] = self._core.events.fork(served)
        if stored is None and self._span is not None:
            self._span.add_event("traffic_dropped", {"hotloop.choice": index})

    async def aclose(self) -> None:
        """Release the replica and end the upstream call (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._core._in_flight -= 1
        try:
            await self._stream.aclose()
        finally:
            self._core.router.release(self._state, ok=self._ok)
            if self._ok:
                self._core.metrics.succeeded += 1
            if self._span is not None:
                self._span.end()
                self._span = None
