"""The stop order of a service process on SIGTERM, with a call held through the server's grace:
`Running.on_signal` runs at the signal, the cleanups only after the grace. The trainer stops its
online loop in `on_signal`; had it waited for the grace, a client holding a call (a stream, a
slow fetch) would have let it go on learning for `grace_s` after it was told to stop.

A real process (the signal handler is the event loop's, installed by `serve_until_signal`) runs
`hotloop.service`'s runner; the test holds a health `Watch` stream on it, which the server does
not end by itself, so the stop waits the whole grace for it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = textwrap.dedent("""
    import asyncio, pathlib, sys
    from hotloop import config as hconfig, service
    from hotloop.grpcutil import create_server

    out = pathlib.Path(sys.argv[1])

    async def build(mesh, cfg):
        server, port, health = await create_server([], [], "127.0.0.1:0")
        return service.Running(
            server, port, health,
            cleanups=[lambda: (out / "cleaned").write_text("")],
            on_signal=lambda: (out / "signalled").write_text(""))

    asyncio.run(service._main("svc", hconfig.MeshConfig(run_dir=str(out)),
                              hconfig.ServiceSection(), build, str(out / "svc.port")))
""")


async def read_to_the_end(call) -> grpc.StatusCode:
    """Read a response stream until it ends; its status."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return await call.code()


def _until(cond, what: str, proc: subprocess.Popen, log, timeout_s: float = 60.0):
    """An async wait for `cond()`, bounded: a failure says what never happened, with the
    service's own output."""

    async def wait():
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"{what} (exit {proc.poll()}):\n{log.read_text()}")
            await asyncio.sleep(0.02)

    return wait()


@pytest.mark.timeout(180)
async def test_on_signal_runs_while_a_held_call_keeps_the_grace_and_cleanups_after(tmp_path):
    log = tmp_path / "svc.log"  # a file, not a pipe: nothing the service writes can block it
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVICE, str(tmp_path)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        port_file = tmp_path / "svc.port"
        await _until(port_file.exists, "the service never wrote its port file", proc, log, 120)
        port = json.loads(port_file.read_text())["port"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            first = await asyncio.wait_for(watch.read(), 30)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            held = asyncio.create_task(read_to_the_end(watch))  # open until the server ends it
            os.kill(proc.pid, signal.SIGTERM)
            signalled, cleaned = tmp_path / "signalled", tmp_path / "cleaned"
            await _until(lambda: signalled.exists() or held.done(),
                         "on_signal never ran after SIGTERM", proc, log)
            # The marker read first, the call's state after: a marker seen with the call still
            # open existed while it was open.
            assert not held.done(), "the held call ended before on_signal ran"
            assert not cleaned.exists(), "a cleanup ran before the grace ended"
            # The stop still drains: the held call ends with the grace, then the cleanups run.
            code = await asyncio.wait_for(held, 60)
            assert code != grpc.StatusCode.OK  # ended by the stop, not by itself
        await asyncio.to_thread(proc.wait, timeout=60)
        assert proc.returncode == 0, log.read_text()
        assert cleaned.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
