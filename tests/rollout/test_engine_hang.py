"""A rollout whose engine hangs fails its requests and stops, rather than keeping them (and
the users the gateway keeps sending it) waiting for ever (services/rollout/heartbeat.py).

Real processes: `python -m services.rollout` on the tiny model; its engine core is stopped
with SIGSTOP (a hang as the front end sees one: alive, silent)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import psutil
import pytest

from hotloop.proto.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from .test_engine_orphans import REPO, engine_descendants, env, wait_for_engines

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]
# Above the slowest healthy step of a loaded CI machine: at 3 s the first request's prefill,
# with another test worker on the other core, was called a hang (no step for 4 s).
STALL_S = 10.0


def request(max_tokens: int, stream: bool) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompts=[common_pb2.Prompt(text="def add(a, b):")], stream=stream,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0))


async def test_a_hung_engine_fails_its_requests_with_unavailable_and_the_service_exits(
        tiny_model, tmp_path):
    port_file, log = tmp_path / "port.json", tmp_path / "rollout.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.rollout", "--port-file", str(port_file),
             "--set", f"model.name={tiny_model}", "--set", "model.max_model_len=512",
             "--set", "rollout.kv_cache_gib=1", "--set", f"rollout.engine_stall_s={STALL_S}",
             "--set", f"run_dir={tmp_path / 'run'}"],
            cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=err,
        )
    engines: list[psutil.Process] = []
    try:
        engines = wait_for_engines(proc, 1, 300, ready=port_file.exists)
        port = json.loads(port_file.read_text())["port"]
        # A channel without retries: each call's own status, not a retry's on a closed port
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = rollout_pb2_grpc.RolloutStub(ch)
        # A healthy engine answers, and a long idle spell after it is no stall.
        (done,) = [c async for c in stub.Generate(request(4, stream=False))]
        assert done.token_ids
        await asyncio.sleep(STALL_S + 2.5)
        assert proc.poll() is None

        # A stream that has its first tokens, then the engine stops stepping.
        streaming = stub.Generate(request(400, stream=True))
        first = await streaming.read()
        assert first.token_ids
        for p in engines:
            p.suspend()
        hung_at = time.monotonic()
        whole = stub.Generate(request(8, stream=False))  # arrives after the hang

        async def outcome(call):
            try:
                while (await call.read()) is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as e:
                return e
            return None

        errors = await asyncio.wait_for(asyncio.gather(outcome(streaming), outcome(whole)),
                                        timeout=STALL_S + 20)
        waited = time.monotonic() - hung_at
        for e in errors:
            assert e is not None, "a request on a hung engine ended as if served"
            assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
            assert "hung" in e.details(), e.details()
        # the bound (counted from the last step, a moment before the stop) plus the 2 s poll,
        # not the request's own length; wide: a loaded machine delays the poll
        assert STALL_S - 1 < waited < STALL_S + 10, waited
        await ch.close()

        assert proc.wait(timeout=60) == 1
        text = log.read_text(errors="replace")
        assert "the vLLM engine is hung: no step for" in text, text[-3000:]
        gone, alive = psutil.wait_procs(engines, timeout=10)
        assert not alive, f"engine processes survived the stopped service: {alive}"
    finally:
        for p in engines:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
