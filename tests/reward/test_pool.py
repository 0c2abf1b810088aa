"""Sandbox pools: the local backend directly, the Ray backend against a local Ray (slow)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.reward.config import RewardConfig, SandboxConfig
from services.reward.pool import LocalPool, make_pool
from services.reward.sandbox import SandboxJob

from .conftest import LIMITS

ADD = "def add(a, b):\n    return a + b\n"
JOBS = [
    SandboxJob(ADD, ("assert add(1, 2) == 3",)),
    SandboxJob("def add(a, b):\n    return a - b\n", ("assert add(1, 2) == 3",)),
    SandboxJob("raise SystemExit(3)\n", ("assert True",)),
    SandboxJob(ADD, ("assert add(2, 2) == 4", "assert add(0, 1) == 0")),
]
EXPECTED = [("ok", 1), ("failed", 0), ("failed", 0), ("failed", 1)]


async def test_local_pool_results_come_back_in_job_order():
    pool = LocalPool(SandboxConfig(**LIMITS), concurrency=2)
    try:
        results = await pool.run(JOBS)
        assert [(r.status, r.passed) for r in results] == EXPECTED
        assert pool.isolation.level in ("process", "namespaces", "full")
    finally:
        await pool.close()


async def test_local_pool_bounds_concurrency():
    pool = LocalPool(SandboxConfig(**LIMITS), concurrency=2)
    try:
        sleeper = SandboxJob("import time\ntime.sleep(0.6)\n", ("assert True",))
        start = time.monotonic()
        results = await pool.run([sleeper] * 4)
        elapsed = time.monotonic() - start
        assert [r.status for r in results] == ["ok"] * 4
        assert elapsed >= 1.2  # two waves of two: four at once would take ~0.6 s
    finally:
        await pool.close()


def test_factory_picks_the_configured_backend():
    pool = make_pool(RewardConfig(concurrency=1, sandbox=SandboxConfig(**LIMITS)))
    try:
        assert isinstance(pool, LocalPool)
    finally:
        asyncio.run(pool.close())


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_ray_pool_runs_the_same_sandbox(tmp_path):
    from services.reward.pool import RayPool

    import ray

    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")
    cfg = RewardConfig(backend="ray", concurrency=2, ray_num_cpus=2, sandbox=SandboxConfig(**LIMITS))
    pool = make_pool(cfg)
    try:
        assert isinstance(pool, RayPool)
        assert pool.isolation.level in ("process", "namespaces", "full")
        results = await pool.run(JOBS)
        assert [(r.status, r.passed) for r in results] == EXPECTED
        timeout = (await pool.run([SandboxJob("while True:\n    pass\n", ("assert True",))]))[0]
        assert timeout.status == "timeout"
    finally:
        await pool.close()
    assert not ray.is_initialized()
