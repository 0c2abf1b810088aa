"""Where sandboxes run: one narrow async interface, two backends, one factory.

Owns: `SandboxPool.run(jobs) -> results` with bounded concurrency, the local backend
(threads in this process, each driving one sandbox subprocess at a time) and the Ray
backend (actors, each holding the same `Sandbox`), and `make_pool(config)`, the only place
that looks at `config.backend`. Does not own: the sandbox itself (`sandbox.py`) or what
jobs mean (`scorers.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .config import ISOLATION_ORDER, RewardConfig, SandboxConfig
from .sandbox import IsolationReport, IsolationUnavailable, Sandbox, SandboxJob, SandboxResult

log = logging.getLogger(__name__)

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


class SandboxPool(ABC):
    """Runs sandbox jobs with bounded concurrency; results come back in job order."""

    isolation: IsolationReport

    @abstractmethod
    async def run(self, jobs: Sequence[SandboxJob]) -> list[SandboxResult]: ...

    @abstractmethod
    async def close(self) -> None: ...


class LocalPool(SandboxPool):
    """Sandboxes as subprocesses of this process; at most `concurrency` at once.

    Threads are only the waiting side: the work is in the subprocesses, so the GIL is not
    the limit. Queued jobs wait in the executor's queue.
    """

    def __init__(self, config: SandboxConfig, concurrency: int):
        self._sandbox = Sandbox(config)
        self._sandbox.warm(concurrency)  # one worker per thread that can drive a run
        self.isolation = self._sandbox.report
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sandbox")

    async def run(self, jobs: Sequence[SandboxJob]) -> list[SandboxResult]:
        loop = asyncio.get_running_loop()
        return list(
            await asyncio.gather(*(loop.run_in_executor(self._executor, self._sandbox.run, j) for j in jobs))
        )

    async def close(self) -> None:
        # Running jobs finish (each is bounded by its wall-clock limit); queued ones are dropped.
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        self._sandbox.close()


class _SandboxActor:
    """A Ray actor holding one sandbox. Detection runs in the actor, on the node it lands on.

    A failed detection is kept and raised from `report()`, so the driver sees the
    `IsolationUnavailable` itself rather than a dead actor.
    """

    def __init__(self, config: SandboxConfig):
        self._sandbox: Sandbox | None = None
        self._startup_error: Exception | None = None
        try:
            self._sandbox = Sandbox(config)
            self._sandbox.warm(1)  # an actor drives one run at a time
        except IsolationUnavailable as e:  # re-raised by report(), never swallowed
            self._startup_error = e

    def report(self) -> IsolationReport:
        if self._startup_error is not None:
            raise self._startup_error
        return self._sandbox.report

    def run(self, job: SandboxJob) -> SandboxResult:
        return self._sandbox.run(job)

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()


class RayPool(SandboxPool):
    """Sandboxes in Ray actors, one job per actor at a time; `concurrency` actors.

    Starts a local Ray (no dashboard, its own temp dir, `RAY_AUTH_MODE=disabled` so nothing is
    written under ~/.ray) unless this process already joined one, which it then uses as is.
    """

    def __init__(self, config: SandboxConfig, concurrency: int, num_cpus: int | None, temp_dir: str):
        import ray

        self._owns_ray = not ray.is_initialized()
        self._made_temp_dir = ""
        if self._owns_ray:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            if not temp_dir:
                # Ray puts unix sockets under its temp dir: keep the path short (107-byte limit).
                temp_dir = self._made_temp_dir = tempfile.mkdtemp(prefix="hl-ray-")
            ray.init(
                num_cpus=num_cpus or concurrency,
                include_dashboard=False,
                _temp_dir=temp_dir,
                log_to_driver=False,
                # Workers import this package by name; the repository is not installed.
                runtime_env={"env_vars": {"PYTHONPATH": _REPO_ROOT}},
            )
        total_cpus = num_cpus or concurrency
        actor_cls = ray.remote(num_cpus=total_cpus / concurrency)(_SandboxActor)
        self._actors = [actor_cls.remote(config) for _ in range(concurrency)]
        try:
            reports = ray.get([a.report.remote() for a in self._actors])
        except Exception:
            self._shutdown()
            raise
        # On a cluster the actors may land on different hosts: report the weakest.
        self.isolation = min(reports, key=lambda r: ISOLATION_ORDER.index(r.level))
        self._idle: asyncio.Queue = asyncio.Queue()
        for a in self._actors:
            self._idle.put_nowait(a)

    async def run(self, jobs: Sequence[SandboxJob]) -> list[SandboxResult]:
        return list(await asyncio.gather(*(self._run_one(j) for j in jobs)))

    async def _run_one(self, job: SandboxJob) -> SandboxResult:
        actor = await self._idle.get()
        try:
            return await actor.run.remote(job)
        finally:
            self._idle.put_nowait(actor)

    async def close(self) -> None:
        await asyncio.gather(*(a.close.remote() for a in self._actors))
        self._shutdown()

    def _shutdown(self) -> None:
        import ray

        for a in self._actors:
            ray.kill(a)
        if self._owns_ray:
            ray.shutdown()
            if self._made_temp_dir:
                # Ray's session files only; a directory the user configured is left alone.
                shutil.rmtree(self._made_temp_dir, ignore_errors=True)


def make_pool(config: RewardConfig) -> SandboxPool:
    """The sandbox backend the configuration names (the one place that branches on it)."""
    if config.backend == "ray":
        return RayPool(config.sandbox, config.concurrency, config.ray_num_cpus, config.ray_temp_dir)
    return LocalPool(config.sandbox, config.concurrency)
