"""`hotloop.grpcutil` servers through real grpc.aio channels on port 0.

The servicers here are small stand-ins for a rollout replica's `PushAdapter` (client stream)
and the reference's `Logprobs` (bidirectional stream); the thing under test is the server
`create_server` builds: its admin interceptor and how a request stream is answered while the
client is still sending. Several concurrent clients streaming 1 MiB chunks make the race that
turns a status into INTERNAL ("Internal error from Core") likely when nothing prevents it.
"""

from __future__ import annotations

import asyncio
import collections
import os

import grpc
import pytest

from hotloop import grpcutil
from hotloop.errors import FailedPrecondition
from hotloop.proto.v1 import (
    common_pb2,
    reference_pb2,
    reference_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)

TOKEN = "admin-secret"
ROLLOUT = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
REFERENCE = reference_pb2.DESCRIPTOR.services_by_name["Reference"].full_name
CHUNK = b"x" * grpcutil.CHUNK_BYTES

# what a PushAdapter header's version asks of `Pusher`
ACCEPT, REFUSE, RETURN_EARLY, CRASH = 1, 2, 3, 4


class Pusher(rollout_pb2_grpc.RolloutServicer):
    """Reads a header, then (by its version) takes every chunk, refuses, answers OK without
    reading the chunks, or fails with a bug."""

    @grpcutil.map_errors
    async def PushAdapter(self, request_iterator, context):
        first = await anext(aiter(request_iterator))
        version = first.header.info.version
        if version == REFUSE:
            raise FailedPrecondition("refused at the header")
        if version == CRASH:
            raise RuntimeError("a bug in the handler")
        got = 0
        if version == ACCEPT:
            async for msg in request_iterator:
                got += len(msg.data)
        return rollout_pb2.PushAdapterResponse(
            loaded=common_pb2.VersionInfo(version=version, bytes=got))


class Scorer(reference_pb2_grpc.ReferenceServicer):
    """Answers each request; the one with id "bad" ends the stream with INVALID_ARGUMENT."""

    async def Logprobs(self, request_iterator, context):
        async for req in request_iterator:
            if req.id == "bad":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request")
            yield reference_pb2.LogprobsResult(id=req.id)


async def start(token: str = TOKEN, **settle) -> tuple[grpc.aio.Server, grpc.aio.Channel]:
    server, port, _ = await grpcutil.create_server(
        [lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(Pusher(), s),
         lambda s: reference_pb2_grpc.add_ReferenceServicer_to_server(Scorer(), s)],
        [ROLLOUT, REFERENCE], "127.0.0.1:0",
        admin_methods=[f"/{ROLLOUT}/PushAdapter"], admin_token=token, **settle,
    )
    return server, grpcutil.channel(f"127.0.0.1:{port}")


@pytest.fixture
async def channel():
    server, ch = await start()
    yield ch
    await ch.close()
    await server.stop(None)


def push_messages(version: int, chunks: int = 10):
    info = common_pb2.VersionInfo(version=version, bytes=chunks * len(CHUNK))
    yield rollout_pb2.AdapterChunk(header=rollout_pb2.AdapterHeader(info=info))
    for _ in range(chunks):
        yield rollout_pb2.AdapterChunk(data=CHUNK)


async def outcomes(calls, rounds: int = 6, concurrency: int = 4) -> collections.Counter:
    """(code, details) of every call: `rounds` times `concurrency` concurrent runs of each."""
    seen: collections.Counter = collections.Counter()

    async def one(call):
        try:
            await call()
            seen[(grpc.StatusCode.OK, "")] += 1
        except grpc.aio.AioRpcError as e:
            seen[(e.code(), e.details())] += 1

    for _ in range(rounds):
        await asyncio.gather(*[one(c) for c in calls for _ in range(concurrency)])
    return seen


async def test_a_push_without_the_admin_token_is_denied_while_the_client_still_streams(channel):
    stub = rollout_pb2_grpc.RolloutStub(channel)
    calls = [lambda t=t: stub.PushAdapter(push_messages(ACCEPT), metadata=grpcutil.bearer(t))
             for t in ("", "wrong")]
    assert await outcomes(calls) == {
        (grpc.StatusCode.PERMISSION_DENIED, "missing or wrong admin token"): 48,
    }
    resp = await stub.PushAdapter(push_messages(ACCEPT), metadata=grpcutil.bearer(TOKEN))
    assert resp.loaded.bytes == 10 * len(CHUNK)


async def test_with_no_admin_token_configured_every_push_is_denied():
    server, ch = await start(token="")
    try:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        calls = [lambda t=t: stub.PushAdapter(push_messages(ACCEPT), metadata=grpcutil.bearer(t))
                 for t in ("", TOKEN)]
        assert await outcomes(calls, rounds=3) == {
            (grpc.StatusCode.PERMISSION_DENIED,
             "admin RPCs are disabled (no admin token configured)"): 24,
        }
    finally:
        await ch.close()
        await server.stop(None)


@pytest.mark.parametrize("version,code,details", [
    (REFUSE, grpc.StatusCode.FAILED_PRECONDITION, "refused at the header"),
    (RETURN_EARLY, grpc.StatusCode.OK, ""),
    (CRASH, grpc.StatusCode.UNKNOWN, "Unexpected <class 'RuntimeError'>: a bug in the handler"),
])
async def test_a_push_answered_before_its_last_chunk_reaches_the_client_with_that_answer(
        channel, version, code, details):
    """REFUSE and CRASH end the call at the header while the client streams; RETURN_EARLY
    answers OK there (a race grpc.aio's client has not shown for OK, kept for the settling
    path's own return)."""
    stub = rollout_pb2_grpc.RolloutStub(channel)

    def call():
        return stub.PushAdapter(push_messages(version), metadata=grpcutil.bearer(TOKEN))

    assert await outcomes([call]) == {(code, details): 24}


async def test_a_bidirectional_stream_ended_early_reaches_the_client_with_its_code(channel):
    stub = reference_pb2_grpc.ReferenceStub(channel)

    def requests():
        yield reference_pb2.LogprobsRequest(id="bad")
        for i in range(100):
            yield reference_pb2.LogprobsRequest(id=str(i), prompt_ids=range(2000))

    async def call():
        return [r async for r in stub.Logprobs(requests())]

    assert await outcomes([call], rounds=3) == {
        (grpc.StatusCode.INVALID_ARGUMENT, "bad request"): 12,
    }


@pytest.mark.parametrize("settle", [
    {"settle_max_bytes": 4 * len(CHUNK)},
    {"settle_timeout_s": 0.2},
])
async def test_a_refused_stream_that_never_ends_is_answered_within_the_bounds(settle):
    """A client that never stops sending cannot hold a refused call open: the server answers
    once it has read `settle_max_bytes` or waited `settle_timeout_s`. Which code such a client
    sees is the race the bounds give up on, so only the ending is asserted."""
    server, ch = await start(**settle)
    sent = 0

    async def endless():
        nonlocal sent
        yield rollout_pb2.AdapterChunk(header=rollout_pb2.AdapterHeader(
            info=common_pb2.VersionInfo(version=REFUSE)))
        while True:
            sent += 1
            yield rollout_pb2.AdapterChunk(data=CHUNK)
            await asyncio.sleep(0.01)

    try:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        with pytest.raises(grpc.aio.AioRpcError):
            # 60 s is the default bound this server does not have; far above either set here
            await asyncio.wait_for(
                stub.PushAdapter(endless(), metadata=grpcutil.bearer(TOKEN)), timeout=50)
        assert sent > 0
    finally:
        await ch.close()
        await server.stop(None)


def test_grpc_fork_support_is_off_in_hotloop_processes_and_the_children_they_start():
    """Any process that imports hotloop, and every child it starts, runs with gRPC's fork
    support off (grpc/grpc#43055: with it on, a service the launcher started could abort
    before its exec); a value the user set is kept."""
    import subprocess
    import sys

    probe = ("import hotloop, os, subprocess, sys; print(os.environ['GRPC_ENABLE_FORK_SUPPORT']); "
             "subprocess.run([sys.executable, '-c', "
             "'import os; print(os.environ.get(\"GRPC_ENABLE_FORK_SUPPORT\"))'], check=True)")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "0"]
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "GRPC_ENABLE_FORK_SUPPORT": "1"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"]


def test_every_client_channel_pings_as_configured_and_zero_turns_the_pings_off():
    from pydantic import ValidationError

    from hotloop.config import GrpcConfig

    with pytest.raises(ValidationError, match="at most once a second"):
        GrpcConfig(keepalive_s=0.5)  # faster than the servers accept
    previous = grpcutil.configure(GrpcConfig(keepalive_s=3, keepalive_timeout_s=2, connect_timeout_s=5))
    try:
        opts = dict(grpcutil.client_options())
        assert (opts["grpc.keepalive_time_ms"], opts["grpc.keepalive_timeout_ms"],
                opts["grpc.http2.ping_timeout_ms"], opts["grpc.min_reconnect_backoff_ms"]) == \
            (3000, 2000, 2000, 5000)
        assert dict(grpcutil.client_options(connect_timeout_ms=100))["grpc.min_reconnect_backoff_ms"] == 100
        # the servers ping their clients on the same settings
        server = dict(grpcutil.server_options())
        assert (server["grpc.keepalive_time_ms"], server["grpc.keepalive_timeout_ms"]) == (3000, 2000)
        grpcutil.configure(GrpcConfig(keepalive_s=0))
        assert not any("keepalive" in k or "ping" in k for k, _ in grpcutil.client_options())
        assert not any("keepalive" in k for k, _ in grpcutil.server_options())
    finally:
        grpcutil.configure(previous)
    # and the servers accept pings that often
    assert dict(grpcutil._SERVER_OPTIONS)["grpc.http2.min_ping_interval_without_data_ms"] <= 1000
