"""A client whose process freezes (alive, its connections open, silent): the server finds out
from its own keepalive pings (`[grpc]`, `hotloop.grpcutil.server_options`) and cancels the
client's calls, so a response stream's handler stops waiting on a window nobody reads (a
rollout's queued outputs, a gateway's user stream) instead of holding on until the call's
deadline, or for ever without one.

Real processes: the servers are built here by `grpcutil.create_server` (the builder of every
service's server), the client is a separate Python process that opens a response stream on
each, reads one message and then reads no more; the test stops it with SIGSTOP. One server
pings (the mesh's settings, faster), the other does not (`keepalive_s` 0): the control that
shows it is the pings, not the stop itself, that end the call."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from hotloop import grpcutil
from hotloop.config import GrpcConfig
from tests.procs import freeze

pytestmark = pytest.mark.slow
LIVENESS = GrpcConfig(keepalive_s=1, keepalive_timeout_s=1)
# An unanswered ping ends the connection after the interval and its timeout (2 s); wide for a
# loaded machine.
BOUND_S = 20.0
SERVICE = "hotloop.test.Flood"
CHUNK = b"x" * 65536

CLIENT = textwrap.dedent(f"""
    import sys, time
    import grpc
    streams = []
    for address in sys.argv[1:]:
        channel = grpc.insecure_channel(address)  # no keepalive of its own: the server's pings
        stream = channel.unary_stream("/{SERVICE}/Flood")(b"")
        next(stream)
        streams.append((channel, stream))
    print("reading no more", flush=True)
    time.sleep(3600)
""")


class Flood:
    """A response stream that writes as fast as its client reads; records whether its handler
    ended (it can only be ended from outside: it never returns)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.ended = False

    async def flood(self, request: bytes, context):
        self.started.set()
        try:
            while True:
                yield CHUNK
        finally:
            self.ended = True

    def add(self, server: grpc.aio.Server) -> None:
        handler = grpc.unary_stream_rpc_method_handler(self.flood)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"Flood": handler}),))


async def serve(liveness: GrpcConfig) -> tuple[grpc.aio.Server, int, Flood]:
    previous = grpcutil.configure(liveness)
    try:
        flood = Flood()
        server, port, _ = await grpcutil.create_server([flood.add], [SERVICE])
        return server, port, flood
    finally:
        grpcutil.configure(previous)


async def test_a_frozen_clients_stream_ends_at_the_servers_pings():
    pinging, ping_port, watched = await serve(LIVENESS)
    silent, silent_port, control = await serve(GrpcConfig(keepalive_s=0))
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, f"127.0.0.1:{ping_port}", f"127.0.0.1:{silent_port}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(client.stdout.readline), 60)
        assert line.strip() == b"reading no more", client.stderr.read().decode()[-2000:]
        await asyncio.wait_for(watched.started.wait(), 10)
        # A client that is alive but not reading answers the pings: its call stays (flow
        # control is not a fault), across several ping intervals.
        await asyncio.sleep(3 * (LIVENESS.keepalive_s + LIVENESS.keepalive_timeout_s))
        assert not watched.ended and not control.ended

        await freeze(client.pid)
        frozen_at = time.monotonic()
        while not watched.ended:
            assert time.monotonic() - frozen_at < BOUND_S, \
                f"the frozen client's stream was still open {BOUND_S:g} s after it stopped"
            await asyncio.sleep(0.1)
        # The server without pings still waits on its stream: the stop alone ends nothing.
        assert not control.ended
    finally:
        client.kill()  # SIGKILL ends a stopped process too
        client.wait(timeout=10)
        await pinging.stop(0)
        await silent.stop(0)
