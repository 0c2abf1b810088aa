"""gRPC helpers: servers with health, reflection, auth, tracing and limits; retrying channels.

Owns: `create_server(...) -> (server, port)` following grpc's Python examples (bind port 0
in tests), the admin-token interceptor, settling request streams before a status goes out,
mapping of `hotloop.errors` to status codes, client channels whose service config retries
UNAVAILABLE a bounded number of times, and the keepalive pings with which every client channel
finds a server that stopped answering without closing its connection, and every server a
client that did (`[grpc]`, `client_options`, `server_options`).
Does not own: any service's messages or logic.

Why request streams are settled: a grpc.aio client that is still writing when the server's
status arrives can have that status replaced by INTERNAL "Internal error from Core" (its
failed write overwrites the status it already received; grpc/grpc#36066, open in 1.85). So a
server that refuses a push at its header, or denies it for want of a token, must not answer
until the client has finished sending. `_SettleRequestStreams` does that for every
request-streaming method of every server built here: whenever such a handler ends (aborts,
raises or returns) before its request stream has ended, the rest of the stream is read and
discarded first, bounded by `SETTLE_MAX_BYTES` and `SETTLE_TIMEOUT_S`. Past either bound the
status goes out anyway: a client that streams more than any honest one would may then see
INTERNAL, and the server has spent no more than the bounds on it.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hotloop import adapters, errors
from hotloop.config import GrpcConfig

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # adapters travel in chunks; this bounds any one message
CHUNK_BYTES = 1024 * 1024  # measured: 1 MiB chunks stream at ~400-480 MB/s on loopback

# The longest request stream an honest client sends is a push of an adapter at the archive
# limit (plus its header message); a refused one is read to its end within these bounds.
SETTLE_MAX_BYTES = adapters.MAX_ARCHIVE_BYTES + MAX_MESSAGE_BYTES
SETTLE_TIMEOUT_S = 60.0

_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
# A server accepts a client's keepalive pings down to this interval; closer ones count as
# abuse, and a client that keeps sending them gets GOAWAY "too_many_pings" (gRPC's default
# floor is 5 minutes, which would end every call of a client pinging every 10 s).
MIN_PING_INTERVAL_MS = 500
_SERVER_OPTIONS = [*_OPTIONS,
                   ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS)]


_liveness = GrpcConfig()


def configure(cfg: GrpcConfig) -> GrpcConfig:
    """Use `cfg` (the `[grpc]` section) for every channel and server this process opens from
    now on; returns the settings it replaces. A service calls it before it builds any client
    or server."""
    global _liveness
    previous, _liveness = _liveness, cfg
    return previous


def client_options(connect_timeout_ms: int | None = None) -> list[tuple[str, Any]]:
    """The options every client channel of this process is built with: message limits, and
    the pings that find a server which stopped answering (`configure`). `connect_timeout_ms`
    replaces the configured connect timeout (a caller with short retries of its own)."""
    live = _liveness
    options: list[tuple[str, Any]] = [
        *_OPTIONS,
        ("grpc.min_reconnect_backoff_ms",
         connect_timeout_ms if connect_timeout_ms is not None else _ms(live.connect_timeout_s)),
    ]
    return options + _pings(live)


def server_options() -> list[tuple[str, Any]]:
    """The options every server of this process is built with: message limits, the clients'
    pings accepted down to `MIN_PING_INTERVAL_MS`, and pings of its own (`configure`) on a
    connection with a call open. A client process that froze (stopped, swapping, its host cut
    off) keeps its calls open on the server: a response stream's handler, blocked on a window
    the client no longer reads, waits with its queued outputs until the call's deadline, and a
    call without one for ever. Unanswered pings end the connection after `keepalive_s +
    keepalive_timeout_s`, which cancels its calls: the handlers run their cleanup. A client
    that is alive but reads slowly answers the pings; its calls stay (flow control, not a
    fault)."""
    return [*_SERVER_OPTIONS, *_pings(_liveness)]


def _pings(live: GrpcConfig) -> list[tuple[str, Any]]:
    """Keepalive pings while a call is open, either end (none with `keepalive_s` 0)."""
    if live.keepalive_s <= 0:
        return []
    return [
        ("grpc.keepalive_time_ms", _ms(live.keepalive_s)),
        ("grpc.keepalive_timeout_ms", _ms(live.keepalive_timeout_s)),
        # what gRPC 1.85 waits for an unacknowledged ping (default 1 minute, whatever the
        # keepalive timeout says)
        ("grpc.http2.ping_timeout_ms", _ms(live.keepalive_timeout_s)),
        # keep pinging a call on which nothing moves (a request queued in the engine, a
        # response stream whose window the other end no longer reads)
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 0),
    ]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class AdminAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses admin methods unless the caller presents `authorization: Bearer <token>`.

    With no token configured, admin methods are refused outright: a weight push must never
    be open to whoever can reach the port.
    """

    def __init__(self, admin_methods: Iterable[str], token: str):
        self._admin = frozenset(admin_methods)
        self._token = token.encode()

    async def intercept_service(self, continuation, details):
        if details.method not in self._admin:
            return await continuation(details)
        presented = dict(details.invocation_metadata or ()).get("authorization", "")
        ok = bool(self._token) and hmac.compare_digest(
            presented.encode(), b"Bearer " + self._token
        )
        if ok:
            return await continuation(details)
        why = "admin RPCs are disabled (no admin token configured)" if not self._token else (
            "missing or wrong admin token"
        )
        handler = await continuation(details)
        return _deny(handler, why)


def _deny(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    # No request deserializer: a refused caller's messages are never parsed, only counted
    # while `_SettleRequestStreams` reads them to their end.
    async def unary(request, context):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    async def stream(request_iterator, context):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    async def responses(request, context):  # a response stream's handler is an async generator
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        yield  # never reached

    async def responses_of_stream(request_iterator, context):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        yield  # never reached

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(responses_of_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(stream)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(responses)
    return grpc.unary_unary_rpc_method_handler(unary)


class _RequestStream:
    """A handler's request iterator that knows whether the client has finished sending.

    It reads raw messages and deserializes only those the handler takes, so settling costs
    a copy of the bytes, not a parse of messages nobody reads."""

    def __init__(self, requests: AsyncIterator[bytes], deserialize: Callable | None) -> None:
        self._requests = aiter(requests)
        self._deserialize = deserialize
        self.ended = False

    def __aiter__(self) -> _RequestStream:
        return self

    async def _raw(self) -> bytes:
        try:
            return await anext(self._requests)
        except StopAsyncIteration:
            self.ended = True
            raise

    async def __anext__(self):
        raw = await self._raw()
        return raw if self._deserialize is None else self._deserialize(raw)

    async def settle(self, max_bytes: int, timeout_s: float) -> None:
        """Read and discard the rest of the stream, within the bounds. Best effort by
        design: whatever stops the reading, the caller sends its status next."""
        if self.ended:
            return
        seen = 0
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                while seen <= max_bytes:
                    seen += len(await self._raw())
        except (StopAsyncIteration, TimeoutError):
            pass
        if not self.ended:
            log.warning(
                "answering a request stream the client is still sending (%d bytes read in "
                "%.1f s); the client may see INTERNAL instead of the status", seen,
                time.monotonic() - t0,
            )


class _SettlingContext:
    """The servicer context a request-streaming handler sees: `abort` first settles the
    request stream, then sends the status. Everything else is the real context's."""

    def __init__(self, context, stream: _RequestStream, settle: Callable[[], Any]) -> None:
        self._context = context
        self._stream = stream
        self._settle = settle

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    async def read(self):
        try:
            return await anext(self._stream)
        except StopAsyncIteration:
            return grpc.aio.EOF

    async def abort(self, code, details="", trailing_metadata=()):
        await self._settle()
        await self._context.abort(code, details, trailing_metadata)


class _SettleRequestStreams(grpc.aio.ServerInterceptor):
    """Every request-streaming handler answers only once its client has finished sending
    (within the bounds); see the module docstring for why."""

    def __init__(self, max_bytes: int, timeout_s: float) -> None:
        self._max_bytes = max_bytes
        self._timeout_s = timeout_s

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not handler.request_streaming:
            return handler
        if handler.response_streaming:
            behavior = handler.stream_stream
            if not (inspect.isasyncgenfunction(behavior) or inspect.iscoroutinefunction(behavior)):
                return handler  # a sync handler runs in a thread; not ours to wrap
            return grpc.stream_stream_rpc_method_handler(
                self._bidi(behavior, handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        behavior = handler.stream_unary
        if not inspect.iscoroutinefunction(behavior):
            return handler
        return grpc.stream_unary_rpc_method_handler(
            self._unary(behavior, handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )

    def _wrap(
        self, requests, context, deserialize
    ) -> tuple[_RequestStream, _SettlingContext, Callable]:
        stream = _RequestStream(requests, deserialize)
        settled = False

        async def settle() -> None:
            nonlocal settled
            if not settled:
                settled = True
                await stream.settle(self._max_bytes, self._timeout_s)

        return stream, _SettlingContext(context, stream, settle), settle

    def _unary(self, behavior, deserialize):
        async def settled_unary(requests, context):
            stream, ctx, settle = self._wrap(requests, context, deserialize)
            try:
                response = await behavior(stream, ctx)
            except grpc.aio.AbortError:
                raise  # `ctx.abort` settled before it sent the status
            except Exception:
                await settle()  # grpc answers UNKNOWN (or the set code) once this propagates
                raise
            await settle()
            return response

        return settled_unary

    def _bidi(self, behavior, deserialize):
        async def settled_bidi(requests, context):
            stream, ctx, settle = self._wrap(requests, context, deserialize)
            try:
                result = behavior(stream, ctx)
                if inspect.isasyncgen(result):
                    async for response in result:
                        yield response
                else:  # a handler that writes through `context.write`
                    await result
            except grpc.aio.AbortError:
                raise
            except Exception:
                await settle()
                raise
            await settle()

        return settled_bidi


_INSTRUMENTED = {"server": False, "client": False}


def instrument_grpc() -> None:
    """Install OpenTelemetry gRPC instrumentation once per process, before servers/channels."""
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
    )

    if not _INSTRUMENTED["server"]:
        GrpcAioInstrumentorServer().instrument()
        _INSTRUMENTED["server"] = True
    if not _INSTRUMENTED["client"]:
        GrpcAioInstrumentorClient().instrument()
        _INSTRUMENTED["client"] = True


async def create_server(
    add_servicers: list[Callable[[grpc.aio.Server], Any]],
    service_names: list[str],
    address: str = "127.0.0.1:0",
    admin_methods: Iterable[str] = (),
    admin_token: str = "",
    settle_max_bytes: int = SETTLE_MAX_BYTES,
    settle_timeout_s: float = SETTLE_TIMEOUT_S,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Build and start an aio server with health and reflection; returns (server, port, health).

    `add_servicers` are callables like `lambda s: pb2_grpc.add_XServicer_to_server(impl, s)`.
    `settle_*` bound how much of a refused request stream is read before its status goes
    out (module docstring).
    """
    # Settling is outermost, so an admin denial is settled like any other early answer.
    interceptors: list[grpc.aio.ServerInterceptor] = [
        _SettleRequestStreams(settle_max_bytes, settle_timeout_s)
    ]
    if admin_methods:
        interceptors.append(AdminAuthInterceptor(admin_methods, admin_token))
    server = grpc.aio.server(options=server_options(), interceptors=interceptors)
    for add in add_servicers:
        add(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise errors.FatalError(f"could not bind {address}")
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


async def serve_until_signal(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer | None = None,
    grace_s: float = 5.0,
    on_stop: Callable[[], Any] | None = None,
    on_signal: Callable[[], None] | None = None,
) -> None:
    """Run until SIGINT/SIGTERM; then report NOT_SERVING, drain for `grace_s`, and stop.
    `on_signal` runs at once when the stop begins (what must not go on through the drain),
    `on_stop` after it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    if on_signal is not None:
        on_signal()
    if health_servicer is not None:
        await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
    if on_stop is not None:
        result = on_stop()
        if inspect.isawaitable(result):
            await result
    waiter.cancel()
    stopper.cancel()


def map_errors(fn):
    """Decorator for servicer methods: hotloop errors become statuses with their message.

    Works for unary handlers and (async-generator) streaming handlers. Anything else
    propagates: grpc reports it as UNKNOWN and logs the traceback, which is what a bug
    should look like.
    """

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def gen_wrapper(self, request, context):
            try:
                async for item in fn(self, request, context):
                    yield item
            except errors.HotloopError as e:
                await context.abort(getattr(grpc.StatusCode, e.code), str(e))

        return gen_wrapper

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except errors.HotloopError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))

    return wrapper


def _service_config(max_attempts: int) -> str:
    # gRPC's own retry policy: bounded attempts with exponential backoff, only on UNAVAILABLE
    # (the server was not reachable or is restarting), so a request is never replayed after
    # it could have had effects on a healthy server.
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{}],
                    "retryPolicy": {
                        "maxAttempts": max_attempts,
                        "initialBackoff": "0.1s",
                        "maxBackoff": "2s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
        }
    )


def channel(address: str, max_attempts: int = 5) -> grpc.aio.Channel:
    """An aio channel with message-size limits and bounded retry on UNAVAILABLE. A `dns:///`
    target (a name that resolves to several replicas: a headless Kubernetes service, a
    compose service with replicas) is balanced call by call over its addresses, skipping
    those that are down (gRPC's round_robin; its default would hold to the first address)."""
    options = [*client_options(), ("grpc.enable_retries", 1),
               ("grpc.service_config", _service_config(max_attempts))]
    if address.startswith("dns:"):
        options.append(("grpc.lb_policy_name", "round_robin"))
    return grpc.aio.insecure_channel(address, options=options)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token."""
    return (("authorization", f"Bearer {token}"),)


async def wait_healthy(address: str, timeout_s: float = 60.0, service: str = "") -> None:
    """Poll the health service until SERVING or raise TimeoutError."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{address} did not become healthy within {timeout_s:.0f}s")
            await asyncio.sleep(0.2)
