"""gRPC clients for the rollout, reward, reference and trainer services, with plain dataclasses.

Owns: the caller's side of the contracts in protos/ (proto types stop here), bounded retries
on UNAVAILABLE (channel service config plus a tenacity retry around whole streaming calls,
which gRPC's own retry cannot replay), and clear errors when a service stays down. The one
rollout client (`RolloutClient`: Generate, PushAdapter, Status, WatchLoad) and its result type
(`Completion`) serve the trainer's recipes, the gateway (`services/gateway/upstream.py`), the
publisher (`services/trainer/publish.py`), `hotloop eval` and the benchmarks.
Does not own: what the services do, nor a caller's own retry policy: a caller that retries on
its own schedule (the gateway on another replica, the publisher around a whole push) opens a
`direct_channel` and passes `retry=False`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import NamedTuple
from dataclasses import dataclass, field

import grpc

from hotloop import grpcutil
from hotloop.adapters import Version, version_from_proto, version_to_proto
from hotloop.completion import Completion
from hotloop.errors import HotloopError, InvalidArgument, NotFound, Unauthenticated, Unavailable
from hotloop.proto.v1 import common_pb2, reference_pb2, reference_pb2_grpc, reward_pb2, reward_pb2_grpc
from hotloop.proto.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from hotloop.tenants import DEFAULT, TenantId

RETRY_ATTEMPTS = 4
# vLLM priority scheduling admits lower values first: the gateway sends users at 0, and
# training rollouts that share the engine with users (PPO's joint serving) ask for this.
USER_PRIORITY = 0
TRAINING_PRIORITY = 1


def direct_channel(address: str, reconnect_backoff_ms: tuple[int, int],
                   min_reconnect_backoff_ms: int | None = None) -> grpc.aio.Channel:
    """A channel without gRPC's retry policy, for a caller that retries on its own schedule or
    must not replay a call (a stream that produced tokens; a push of many MiB, which gRPC
    buffers for a replay only up to a small limit).

    `reconnect_backoff_ms`: (first, longest) wait between connects to a lost server. A channel
    that failed to connect fails every call at once until its backoff (1 s, x1.6 per failure,
    up to 120 s by default) runs out, so with the defaults a caller's retry, or a health
    probe, would not really try to connect for up to two minutes after the server came back.
    `min_reconnect_backoff_ms`: gRPC's floor on a connect attempt (`[grpc] connect_timeout_s`,
    20 s), for callers whose retries are shorter than that. Like every channel, it pings a
    server that stops answering (`grpcutil.client_options`)."""
    options = [
        *grpcutil.client_options(connect_timeout_ms=min_reconnect_backoff_ms),
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", reconnect_backoff_ms[0]),
        ("grpc.max_reconnect_backoff_ms", reconnect_backoff_ms[1]),
    ]
    return grpc.aio.insecure_channel(address, options=options)


async def _call(what: str, address: str, fn, attempts: int = RETRY_ATTEMPTS):
    """Run a whole call, retrying on UNAVAILABLE (a service restarting) up to `attempts` times
    in all; then fail with an error that names the service."""
    from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

    def unavailable(e: BaseException) -> bool:
        return isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE

    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(attempts),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            retry=retry_if_exception(unavailable),
            reraise=True,
        ):
            with attempt:
                return await fn()
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            raise Unavailable(
                f"{what} at {address} is unavailable after {attempts} attempts: {e.details()}"
            ) from e
        raise


async def _unavailable_named(what: str, address: str, call) -> AsyncIterator:
    """The messages of a streaming call that is not retried; UNAVAILABLE becomes the same
    `Unavailable` naming the service that `_call` raises after its retries."""
    try:
        async for msg in call:
            yield msg
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            raise Unavailable(f"{what} at {address} is unavailable: {e.details()}") from e
        raise


# ---- rollout ------------------------------------------------------------------------------
def _completion(c: rollout_pb2.Completion) -> Completion:
    return Completion(
        c.prompt_index, c.sample_index, c.text, list(c.token_ids), list(c.logprobs),
        c.finish_reason, c.policy_version, list(c.prompt_token_ids),
        version_spans=[(s.version, s.first_token) for s in c.version_spans], tenant=c.tenant,
        # A replica without stream support sends whole completions; their finish_reason marks
        # them as the last message of their sample even where `final` is not set.
        final=c.final or bool(c.finish_reason), num_prompt_tokens=c.num_prompt_tokens,
        top_logprobs=[list(zip(t.token_ids, t.logprobs, t.tokens)) for t in c.top_logprobs],
        token_texts=list(c.token_texts),
    )


def _prompts(chats: Sequence[Sequence[dict[str, str]]] | None,
             texts: Sequence[str] | None) -> list[common_pb2.Prompt]:
    if texts is not None:
        return [common_pb2.Prompt(text=t) for t in texts]
    return [
        common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=[
            common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in chat]))
        for chat in chats or ()
    ]


def _request(chats: Sequence[Sequence[dict[str, str]]] | None, n: int = 1, max_tokens: int = 128,
             temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
             pin_version: int = 0, return_prompt_ids: bool = True, priority: int = 0,
             stop: Sequence[str] = (), top_logprobs: int = 0, texts: Sequence[str] | None = None,
             tenant: TenantId = DEFAULT, **extra) -> rollout_pb2.GenerateRequest:
    """One Generate request. `generate` and `generate_each` take these sampling arguments and
    defaults; `stream` adds `request_id` and `stream` (`extra`).

    `priority`: lower is admitted first where the engine schedules by priority (users come at
    0; training that must yield to them asks for `TRAINING_PRIORITY`). `stop`: strings that
    end a completion (left out of its text; its token ids and logprobs keep every sampled
    token). `texts`: raw prompts instead of `chats`. `tenant`: that tenant's lineage instead
    of the default one."""
    return rollout_pb2.GenerateRequest(
        prompts=_prompts(chats, texts),
        sampling=common_pb2.SamplingParams(
            n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
            top_logprobs=top_logprobs, stop=list(stop),
        ),
        pin_version=pin_version,
        return_prompt_ids=return_prompt_ids,
        priority=priority,
        tenant=tenant,
        **extra,
    )


class Load(NamedTuple):
    """A rollout replica's users' load (`RolloutClient.watch_load`)."""

    in_flight: int
    waiting: int  # of those, without a first token yet
    board_path: str = ""  # the same counts in shared memory on the replica's host (loadboard.py)
    board_nonce: int = 0


@dataclass(frozen=True)
class Pushed:
    """A replica's answer to `RolloutClient.push_adapter`."""

    loaded: Version  # what the replica now holds under that number
    verify_ms: float  # as the replica measured them
    load_ms: float
    already_present: bool  # it held this version already (a retried push)


class RolloutClient:
    def __init__(self, address: str, channel: grpc.aio.Channel | None = None, retry: bool = True,
                 attempts: int = RETRY_ATTEMPTS):
        """`channel`: None opens one that retries UNAVAILABLE in its service config
        (`grpcutil.channel`); a caller with its own retry policy passes a `direct_channel`.
        `retry`: `generate` and `status` retry UNAVAILABLE up to `attempts` times in all
        (tenacity) and then raise `Unavailable`; with False every call is made once and a
        failure surfaces as grpc.aio.AioRpcError, for the caller to judge by its code."""
        self.address = address
        self.channel = channel if channel is not None else grpcutil.channel(address)
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)
        self.retry, self.attempts = retry, attempts

    async def _unary(self, fn):
        return await (_call("rollout", self.address, fn, self.attempts) if self.retry else fn())

    async def generate(self, chats: Sequence[Sequence[dict[str, str]]], **sampling) -> list[Completion]:
        """Sample completions of each chat, returned sorted by (prompt, sample). `sampling`:
        `n`, `max_tokens`, `temperature`, `top_p`, `seed`, `pin_version`,
        `return_prompt_ids`, `priority`, `stop`, `tenant`, with `_request`'s defaults (one sample of
        128 tokens at temperature 1, prompt ids returned)."""
        req = _request(chats, **sampling)

        async def run():
            return [c async for c in self.stub.Generate(req)]

        comps = [_completion(c) for c in await self._unary(run)]
        return sorted(comps, key=lambda c: (c.prompt_index, c.sample_index))

    async def stream(
        self,
        chats: Sequence[Sequence[dict[str, str]]] | None,
        n: int = 1,
        max_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        top_logprobs: int = 0,
        priority: int = 0,
        pin_version: int = 0,
        return_prompt_ids: bool = False,
        request_id: str = "",
        stop: Sequence[str] = (),
        texts: Sequence[str] | None = None,
        timeout_s: float | None = None,
        tenant: TenantId = DEFAULT,
    ) -> AsyncIterator[Completion]:
        """Token deltas as the engine produces them, interleaved across (prompt, sample).
        `texts`: raw prompts instead of `chats`; `timeout_s` bounds the whole call.

        Not retried: a stream that has produced tokens cannot be replayed transparently (a
        failure surfaces as grpc.aio.AioRpcError). Leaving the loop early (break, or
        cancelling the consuming task) cancels the call, which aborts its engine requests.
        """
        req = _request(chats, n, max_tokens, temperature, top_p, seed, pin_version,
                       return_prompt_ids, priority, stop, top_logprobs, texts, tenant,
                       request_id=request_id, stream=True)
        call = self.stub.Generate(req, timeout=timeout_s)
        try:
            async for c in call:
                yield _completion(c)
        finally:
            call.cancel()  # no-op once the call has finished

    async def generate_each(self, chats: Sequence[Sequence[dict[str, str]]],
                            **sampling) -> AsyncIterator[Completion]:
        """`generate` (the same `sampling`), but each whole completion as soon as the engine
        finishes it (a prompt's `n` samples arrive together), in finishing order, so a caller
        can score the first while the rest still generate.

        Not retried: results already handed out cannot be replayed (a failure surfaces as
        `Unavailable` or grpc.aio.AioRpcError). Leaving the loop early cancels the call."""
        call = self.stub.Generate(_request(chats, **sampling))
        try:
            async for c in _unavailable_named("rollout", self.address, call):
                yield _completion(c)
        finally:
            call.cancel()  # no-op once the call has finished

    async def push_adapter(self, info: Version, data: bytes, admin_token: str, *,
                           make_latest: bool = True, timeout_s: float | None = None,
                           on_sent: Callable[[], None] | None = None, tenant: TenantId = DEFAULT) -> Pushed:
        """Push a packed adapter (`hotloop.adapters.pack`) as version `info`: its header, then
        `grpcutil.CHUNK_BYTES` chunks, with the admin bearer token. `timeout_s` bounds the
        push, the replica's verify and load included; `on_sent` is called once the last chunk
        is handed to gRPC (a benchmark times from there). `tenant`: into that tenant's
        lineage instead of the default one.

        Never retried here, whatever `retry` says: gRPC buffers a streamed request for a
        replay only up to a small limit, and whether to push again depends on why the replica
        refused (the publisher retries whole pushes on UNAVAILABLE). Failures surface as
        grpc.aio.AioRpcError."""
        header = rollout_pb2.AdapterHeader(info=version_to_proto(info), make_latest=make_latest,
                                           tenant=tenant)

        def messages() -> Iterator[rollout_pb2.AdapterChunk]:
            yield rollout_pb2.AdapterChunk(header=header)
            for i in range(0, len(data), grpcutil.CHUNK_BYTES):
                yield rollout_pb2.AdapterChunk(data=data[i : i + grpcutil.CHUNK_BYTES])
            if on_sent is not None:
                on_sent()

        resp = await self.stub.PushAdapter(messages(), metadata=grpcutil.bearer(admin_token),
                                           timeout=timeout_s)
        return Pushed(version_from_proto(resp.loaded), resp.verify_ms, resp.load_ms,
                      resp.already_present)

    async def status(self, timeout_s: float = 10.0) -> rollout_pb2.RolloutStatus:
        return await self._unary(lambda: self.stub.Status(rollout_pb2.StatusRequest(), timeout=timeout_s))

    async def watch_load(self) -> AsyncIterator[Load]:
        """Users' requests in flight and those waiting for a first token: now, then at every
        change. Ends with the replica (an error); the caller decides whether to watch again."""
        async for msg in self.stub.WatchLoad(rollout_pb2.WatchLoadRequest()):
            yield Load(msg.foreground_requests, msg.waiting_requests, msg.board_path, msg.board_nonce)

    async def close(self) -> None:
        await self.channel.close()


class LoadWatch:
    """`Rollout.WatchLoad` as a blocking stream, for a thread with no event loop (the trainer's
    users-first watcher). A second asyncio loop in a process that uses grpc.aio on its main
    loop leaves grpc's poller calling into it after it closed ("Event loop is closed").
    Iterate it; `cancel()` from any thread ends the iteration with a cancelled RpcError."""

    def __init__(self, address: str) -> None:
        # a sync channel (read on a thread); pings like the others, so a frozen replica's
        # watch ends rather than leaving its last load standing
        self._channel = grpc.insecure_channel(address, options=grpcutil.client_options())
        self._call = rollout_pb2_grpc.RolloutStub(self._channel).WatchLoad(rollout_pb2.WatchLoadRequest())

    def __iter__(self):
        for msg in self._call:
            yield Load(msg.foreground_requests, msg.waiting_requests, msg.board_path, msg.board_nonce)

    def cancel(self) -> None:
        self._call.cancel()
        self._channel.close()


# ---- reward -------------------------------------------------------------------------------
@dataclass
class ScoreItem:
    id: str
    prompt: str
    completion: str
    task_id: str = ""
    tests: str = ""
    entry_point: str = ""
    test_cases: list[str] = field(default_factory=list)
    extra: dict[str, str] = field(default_factory=dict)
    scorer: str = ""


@dataclass
class Score:
    id: str
    reward: float
    passed: int
    failed: int
    timed_out: bool
    error: str
    status: str
    seconds: float


def _score_request(it: ScoreItem) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(
        id=it.id, prompt=it.prompt, completion=it.completion, scorer=it.scorer,
        task=reward_pb2.TaskSpec(task_id=it.task_id, tests=it.tests, entry_point=it.entry_point,
                                 test_cases=it.test_cases, extra=it.extra),
    )


class RewardClient:
    def __init__(self, address: str, attempts: int = RETRY_ATTEMPTS):
        """`attempts`: how often `score` tries in all while the service is UNAVAILABLE."""
        self.address, self.attempts = address, attempts
        self.channel = grpcutil.channel(address)
        self.stub = reward_pb2_grpc.RewardStub(self.channel)

    async def score(self, items: Sequence[ScoreItem]) -> list[Score]:
        """Score all items over one bidirectional stream; results in the order of `items`."""

        def requests():
            for it in items:
                yield _score_request(it)

        async def run():
            return [r async for r in self.stub.Score(requests())]

        results = {r.id: r for r in await _call("reward", self.address, run, self.attempts)}
        missing = [it.id for it in items if it.id not in results]
        if missing:
            raise RuntimeError(f"reward service returned no result for {len(missing)} items, e.g. {missing[:3]}")
        return [
            Score(r.id, r.reward, r.passed, r.failed, r.timed_out, r.error, r.status, r.seconds)
            for r in (results[it.id] for it in items)
        ]

    async def score_each(self, items: AsyncIterator[ScoreItem]) -> AsyncIterator[Score]:
        """Score items as the caller produces them, over one bidirectional stream; each result
        as soon as its sample is scored (in finishing order, matched by `id`). The stream ends
        after the last result of an exhausted `items`. Not retried (see `generate_each`)."""

        async def requests():
            async for it in items:
                yield _score_request(it)

        call = self.stub.Score(requests())
        try:
            async for r in _unavailable_named("reward", self.address, call):
                yield Score(r.id, r.reward, r.passed, r.failed, r.timed_out, r.error, r.status,
                            r.seconds)
        finally:
            call.cancel()

    async def close(self) -> None:
        await self.channel.close()


# ---- reference ----------------------------------------------------------------------------
class ReferenceClient:
    def __init__(self, address: str, attempts: int = RETRY_ATTEMPTS):
        """`attempts`: how often `logprobs` and `status` try in all while the service is
        UNAVAILABLE."""
        self.address, self.attempts = address, attempts
        self.channel = grpcutil.channel(address)
        self.stub = reference_pb2_grpc.ReferenceStub(self.channel)

    async def logprobs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """Base-model logprobs of each completion given its prompt; in the order of `pairs`."""

        def requests():
            for i, (p, c) in enumerate(pairs):
                yield reference_pb2.LogprobsRequest(id=str(i), prompt_ids=list(p), completion_ids=list(c))

        async def run():
            return [r async for r in self.stub.Logprobs(requests())]

        answers = await _call("reference", self.address, run, self.attempts)
        results = {r.id: list(r.logprobs) for r in answers}
        if len(results) != len(pairs):
            raise RuntimeError(f"reference returned {len(results)} of {len(pairs)} results")
        return [results[str(i)] for i in range(len(pairs))]

    async def logprobs_each(
        self, pairs: AsyncIterator[tuple[str, Sequence[int], Sequence[int]]]
    ) -> AsyncIterator[tuple[str, list[float]]]:
        """Base-model logprobs of (id, prompt_ids, completion_ids) as the caller produces them,
        over one stream; each (id, logprobs) as soon as it is computed (the service batches
        whatever is waiting). Not retried (see `RolloutClient.generate_each`)."""

        async def requests():
            async for i, p, c in pairs:
                yield reference_pb2.LogprobsRequest(id=i, prompt_ids=list(p), completion_ids=list(c))

        call = self.stub.Logprobs(requests())
        try:
            async for r in _unavailable_named("reference", self.address, call):
                yield r.id, list(r.logprobs)
        finally:
            call.cancel()

    async def status(self) -> reference_pb2.ReferenceStatus:
        return await _call("reference", self.address,
                           lambda: self.stub.Status(reference_pb2.ReferenceStatusRequest(), timeout=10),
                           self.attempts)

    async def close(self) -> None:
        await self.channel.close()


# ---- trainer ------------------------------------------------------------------------------
class TrainerClient:
    """A trainer's `FetchAdapter`: how a rollout replica gets a version it missed.

    No gRPC-level retry, and a short reconnect backoff: the caller (the replica's catch-up)
    retries on its own schedule, and each of its attempts must really try to connect rather
    than fail fast on a channel still waiting out a long backoff after the trainer was down."""

    def __init__(self, address: str, admin_token: str = ""):
        self.address = address
        self.admin_token = admin_token  # FetchAdapter is an admin RPC
        self.channel = direct_channel(address, (100, 1000), min_reconnect_backoff_ms=100)
        self.stub = trainer_pb2_grpc.TrainerStub(self.channel)

    def _error(self, e: grpc.aio.AioRpcError) -> HotloopError:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            return NotFound(f"trainer at {self.address}: {e.details()}")
        if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return Unauthenticated(f"trainer at {self.address}: {e.details()}")
        return Unavailable(f"trainer at {self.address} is unavailable: {e.code().name}: {e.details()}")

    async def fetch_adapter(self, version: int = 0, timeout_s: float = 120.0,
                            tenant: TenantId = DEFAULT) -> tuple[Version, AsyncIterator[bytes]]:
        """The stored `Version` of `tenant`'s lineage (0: the trainer's latest) and its
        archive's chunks, with this client's admin token. The header
        is read here, so an unknown version (`NotFound`) or an unreachable trainer
        (`Unavailable`) raises before anything is handed over; `timeout_s` bounds the whole
        transfer. Not retried. Leave the chunks unconsumed and the call is cancelled when the
        iterator is closed."""
        call = self.stub.FetchAdapter(
            trainer_pb2.FetchAdapterRequest(version=version, tenant=tenant), timeout=timeout_s,
            metadata=grpcutil.bearer(self.admin_token))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from e
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "info":
            call.cancel()
            raise InvalidArgument(f"trainer at {self.address} sent no version header")
        info = version_from_proto(first.info)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while True:
                    try:
                        msg = await call.read()
                    except grpc.aio.AioRpcError as e:
                        raise self._error(e) from e
                    if msg is grpc.aio.EOF:
                        return
                    if msg.WhichOneof("kind") != "data":
                        raise InvalidArgument(f"trainer at {self.address} sent a second header")
                    yield msg.data
            finally:
                call.cancel()  # no-op once the call has finished

        return info, chunks()

    async def close(self) -> None:
        await self.channel.close()
