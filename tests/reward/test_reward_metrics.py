"""The reward service's Prometheus metrics: a real server on port 0 scoring through a real
channel (real sandboxes), its registry served by `hotloop.metrics.serve` and scraped over HTTP."""

from __future__ import annotations

import grpc

from hotloop import metrics
from hotloop.proto.v1 import reward_pb2, reward_pb2_grpc
from services.reward.config import RewardConfig, SandboxConfig
from services.reward.core import RewardCore
from services.reward.server import serve
from tests.scrape import scrape

from .conftest import LIMITS

TASK = reward_pb2.TaskSpec(task_id="t", entry_point="add",
                           test_cases=["assert add(1, 2) == 3", "assert add(0, 0) == 0"])


async def score(port: int, requests: list[reward_pb2.ScoreRequest]) -> dict[str, reward_pb2.ScoreResult]:
    async def gen():
        for r in requests:
            yield r

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return {r.id: r async for r in reward_pb2_grpc.RewardStub(channel).Score(gen())}


async def test_samples_by_scorer_and_status_sandbox_runs_and_isolation():
    core = RewardCore.from_config(RewardConfig(concurrency=2, sandbox=SandboxConfig(**LIMITS)))
    server, port, _ = await serve(core, "127.0.0.1:0")
    endpoint = metrics.serve(core.metrics.registry)
    try:
        before = await scrape(endpoint.port)
        got = await score(port, [
            reward_pb2.ScoreRequest(id="good", completion="```python\ndef add(a, b):\n    return a + b\n```", task=TASK),
            reward_pb2.ScoreRequest(id="half", completion="def add(a, b):\n    return a * b\n", task=TASK),
            reward_pb2.ScoreRequest(id="exit", completion="import os\nos._exit(3)\n", task=TASK),
            reward_pb2.ScoreRequest(id="none", completion="no idea", task=TASK),
            reward_pb2.ScoreRequest(id="fmt", completion="```python\nx\n```", scorer="format"),
            reward_pb2.ScoreRequest(id="bad", completion="x", scorer="made-up"),
        ])
        after = await scrape(endpoint.port)
    finally:
        endpoint.close()
        await server.stop(None)
        await core.close()
    assert {k: v.status for k, v in got.items()} == {
        "good": "ok", "half": "ok", "exit": "crash", "none": "no_code", "fmt": "ok", "bad": "scorer_error"}

    def delta(sample: str, **labels) -> float:
        return after.value(sample, **labels) - before.value(sample, **labels)

    assert delta("hotloop_reward_samples_total", scorer="code_tests", status="ok") == 2
    assert delta("hotloop_reward_samples_total", scorer="code_tests", status="crash") == 1
    assert delta("hotloop_reward_samples_total", scorer="code_tests", status="no_code") == 1
    assert delta("hotloop_reward_samples_total", scorer="format", status="ok") == 1
    # an unknown name is counted under one label, not under whatever a client sent
    assert delta("hotloop_reward_samples_total", scorer="unknown", status="scorer_error") == 1
    assert "made-up" not in after.labels("hotloop_reward_samples_total", "scorer")
    # the sample without code never reached a sandbox
    assert delta("hotloop_reward_sandbox_runs_total", status="ok") == 1
    assert delta("hotloop_reward_sandbox_runs_total", status="failed") == 1
    assert delta("hotloop_reward_sandbox_runs_total", status="crash") == 1
    assert delta("hotloop_reward_sandbox_run_seconds_count") == 3
    assert delta("hotloop_reward_sandbox_run_seconds_sum") > 0
    assert delta("hotloop_reward_score_seconds_count", scorer="code_tests") == 4
    assert delta("hotloop_reward_score_seconds_count", scorer="format") == 1
    assert after.type_of("hotloop_reward_score_seconds") == "histogram"
    level = core.isolation.level
    assert after.value("hotloop_reward_sandbox_isolation_info", level=level) == 1


async def test_a_service_without_sandboxes_reports_no_isolation():
    core = RewardCore.from_config(RewardConfig(scorers=["format"], default_scorer="format"))
    endpoint = metrics.serve(core.metrics.registry)
    try:
        got = await scrape(endpoint.port)
    finally:
        endpoint.close()
        await core.close()
    assert got.labels("hotloop_reward_sandbox_isolation_info", "level") == set()
