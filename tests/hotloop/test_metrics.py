"""hotloop.metrics: the process registry, the HTTP endpoint and metrics read from state; and
the service runner's endpoint (`metrics_port`, the port file), through a real reward service
process. Per-service metrics are tested beside each service."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from hotloop import metrics
from hotloop.proto.v1 import reward_pb2, reward_pb2_grpc
from tests.scrape import scrape

ROOT = Path(__file__).resolve().parents[2]


def test_one_registry_per_process_with_the_process_collectors():
    reg = metrics.registry()
    assert metrics.registry() is reg
    names = {m.name for m in reg.collect()}
    assert {"process_resident_memory_bytes", "python_info"} <= names, names
    import prometheus_client

    assert reg is not prometheus_client.REGISTRY  # vLLM's, in the rollout's process


async def test_serve_on_port_0_and_close():
    reg = CollectorRegistry()
    c = Counter("hotloop_test_things", "Things.", ["kind"], registry=reg)
    c.labels("a").inc(3)
    endpoint = metrics.serve(reg, "127.0.0.1", 0)
    try:
        assert endpoint.port > 0
        got = await scrape(endpoint.port)
        assert got.value("hotloop_test_things_total", kind="a") == 3
        c.labels("a").inc()
        assert (await scrape(endpoint.port)).value("hotloop_test_things_total", kind="a") == 4
    finally:
        endpoint.close()
    endpoint.close()  # idempotent
    with pytest.raises(httpx.ConnectError):
        await scrape(endpoint.port)


async def test_state_is_read_when_scraped():
    reg = CollectorRegistry()
    state = {"n": 1, "queued": 5}
    metrics.StateCollector(lambda: [
        metrics.counter("hotloop_test_done_total", "Done.", state["n"]),
        metrics.gauge("hotloop_test_queued", "Queued.", labels=["where"],
                      samples=[(["here"], state["queued"])]),
        metrics.info("hotloop_test_build", "Build.", {"mode": "x"}),
    ], reg)
    endpoint = metrics.serve(reg)
    try:
        state["n"], state["queued"] = 7, 2
        got = await scrape(endpoint.port)
    finally:
        endpoint.close()
    assert got.value("hotloop_test_done_total") == 7
    assert got.value("hotloop_test_queued", where="here") == 2
    assert got.value("hotloop_test_build_info", mode="x") == 1
    assert got.type_of("hotloop_test_done") == "counter" and got.type_of("hotloop_test_queued") == "gauge"


def test_a_name_registered_twice_fails_at_registration():
    reg = CollectorRegistry()
    Counter("hotloop_test_twice", "Once.", registry=reg)
    with pytest.raises(ValueError, match="Duplicated"):
        metrics.StateCollector(lambda: [metrics.counter("hotloop_test_twice_total", "Again.", 1)], reg)


# ---- the runner: a real service process ------------------------------------------------------


def start_reward(tmp_path: Path, *sets: str) -> tuple[subprocess.Popen, dict]:
    port_file = tmp_path / "reward.port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTLOOP__")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.reward", "--port-file", str(port_file),
         "--set", f"run_dir={tmp_path}", "--set", 'reward.scorers=["format"]',
         "--set", "reward.default_scorer=format", *(a for s in sets for a in ("--set", s))],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the reward service exited: {proc.stderr.read()}")
        assert time.monotonic() < deadline, "the reward service did not start"
        time.sleep(0.05)
    return proc, json.loads(port_file.read_text())


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def test_the_runner_serves_the_process_registry_on_metrics_port(tmp_path):
    proc, ports = start_reward(tmp_path)
    try:
        assert ports["metrics_port"] > 0 and ports["metrics_port"] != ports["port"]
        before = await scrape(ports["metrics_port"])

        async def one():
            yield reward_pb2.ScoreRequest(id="1", completion="```python\nx = 1\n```")

        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['port']}") as ch:
            (res,) = [r async for r in reward_pb2_grpc.RewardStub(ch).Score(one())]
        assert res.status == "ok"
        after = await scrape(ports["metrics_port"])
    finally:
        stop(proc)
    ok = {"scorer": "format", "status": "ok"}
    assert after.value("hotloop_reward_samples_total", **ok) - before.value(
        "hotloop_reward_samples_total", **ok) == 1
    assert after.value("process_resident_memory_bytes") > 0  # the process registry's own


async def test_metrics_port_minus_1_serves_none(tmp_path):
    proc, ports = start_reward(tmp_path, "reward.metrics_port=-1")
    stop(proc)
    assert "metrics_port" not in ports and ports["port"] > 0


def test_a_taken_metrics_port_stops_the_service_saying_why(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOTLOOP__")}
        env["PYTHONPATH"] = str(ROOT)
        p = subprocess.run(
            [sys.executable, "-m", "services.reward", "--set", f"run_dir={tmp_path}",
             "--set", 'reward.scorers=["format"]', "--set", "reward.default_scorer=format",
             "--set", f"reward.metrics_port={port}"],
            env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert f"cannot serve metrics on 127.0.0.1:{port}" in p.stderr
    assert "Traceback" not in p.stderr
