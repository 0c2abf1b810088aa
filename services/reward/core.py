"""The reward service's core: score inputs with the configured scorers, batch or streaming.

Owns: routing each input to its scorer (by name; empty means the default), the batch call
`score(inputs)`, and `score_stream(inputs)`, which yields outputs as they complete while
keeping at most `max_in_flight` inputs outstanding (read but not yet taken by the consumer):
the backpressure the gRPC bidi stream relies on; and the service's Prometheus metrics
(`RewardMetrics`: samples by scorer and status, sandbox runs by status, the isolation level).
No sockets, no protos.
Does not own: scoring itself (`scorers.py`), where code runs (`pool.py`), the wire (`server.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, Info

from hotloop.metrics import LATENCY_BUCKETS

from .config import RewardConfig
from .pool import SandboxPool, make_pool
from .sandbox import IsolationReport, SandboxJob, SandboxResult
from .scorers import Scorer, build_scorers
from .types import ScoreInput, ScoreOutput


class RewardMetrics:
    """The reward service's Prometheus metrics, on `registry` (a private one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.samples = Counter(
            "hotloop_reward_samples", "Samples scored, by scorer and status (ok, no_code, "
            "syntax_error, timeout, oom, crash, scorer_error; ok includes failed tests).",
            ["scorer", "status"], registry=self.registry)
        self.score_seconds = Histogram(
            "hotloop_reward_score_seconds", "Seconds a scorer worked on one sample (for "
            "code_tests its sandbox run, not the wait for a free sandbox).", ["scorer"],
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.sandbox_runs = Counter(
            "hotloop_reward_sandbox_runs", "Sandbox runs, by how they ended: ok (every case "
            "passed), failed (some did not), timeout, oom, crash (the code's or the tests' "
            "process died), error (the sandbox itself failed: the host's fault).", ["status"],
            registry=self.registry)
        self.sandbox_seconds = Histogram(
            "hotloop_reward_sandbox_run_seconds", "Wall-clock seconds of one sandbox run.",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self._isolation = Info(
            "hotloop_reward_sandbox_isolation", "The isolation the sandboxes got on this host "
            "(detected at start-up; the service refuses to start with less than configured).",
            registry=self.registry)

    def isolation(self, report: IsolationReport) -> None:
        self._isolation.info({
            "level": report.level, "namespaces": str(report.namespaces).lower(),
            "user_namespace": str(report.user_namespace).lower(),
            "cgroups": str(report.cgroups).lower(), "fork_server": str(report.fork_server).lower()})


class _MeteredPool(SandboxPool):
    """A pool that counts its runs: the scorers see the same interface, the count is kept
    where every run comes back (one place for both backends)."""

    def __init__(self, pool: SandboxPool, metrics: RewardMetrics):
        self._pool, self._metrics = pool, metrics
        self.isolation = pool.isolation
        metrics.isolation(pool.isolation)

    async def run(self, jobs: Sequence[SandboxJob]) -> list[SandboxResult]:
        results = await self._pool.run(jobs)
        for r in results:
            self._metrics.sandbox_runs.labels(r.status).inc()
            self._metrics.sandbox_seconds.observe(r.seconds)
        return results

    async def close(self) -> None:
        await self._pool.close()


class RewardCore:
    def __init__(
        self, scorers: dict[str, Scorer], default_scorer: str, max_in_flight: int,
        pool: SandboxPool | None = None, metrics: RewardMetrics | None = None,
    ):
        """`metrics`: where samples are counted (its registry is the process's in a service);
        a pool built by `from_config` counts its sandbox runs there too."""
        if default_scorer not in scorers:
            raise ValueError(f"default scorer {default_scorer!r} is not among {sorted(scorers)}")
        self._scorers = scorers
        self._default = default_scorer
        self._max_in_flight = max_in_flight
        self._pool = pool
        self.metrics = metrics if metrics is not None else RewardMetrics()

    @classmethod
    def from_config(cls, config: RewardConfig,
                    registry: CollectorRegistry | None = None) -> "RewardCore":
        """Build scorers and, when `code_tests` is enabled, the sandbox pool (isolation is
        detected here; `IsolationUnavailable` stops start-up). Metrics go to `registry`."""
        metrics = RewardMetrics(registry)
        scorers, pool = build_scorers(config, lambda: _MeteredPool(make_pool(config), metrics))
        return cls(scorers, config.default_scorer, config.max_in_flight, pool, metrics)

    @property
    def isolation(self) -> IsolationReport | None:
        return self._pool.isolation if self._pool is not None else None

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    async def score(self, inputs: Sequence[ScoreInput]) -> list[ScoreOutput]:
        """Score a batch; outputs in input order. Each scorer gets its share as one batch."""
        outputs: list[ScoreOutput | None] = [None] * len(inputs)
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(inputs):
            name = item.scorer or self._default
            if name in self._scorers:
                groups.setdefault(name, []).append(i)
            else:
                # not the requested name: a label per name a client makes up would grow forever
                self.metrics.samples.labels("unknown", "scorer_error").inc()
                outputs[i] = ScoreOutput(
                    id=item.id, reward=0.0, status="scorer_error",
                    error=f"unknown scorer {name!r}; this service has {sorted(self._scorers)}",
                )

        async def run(name: str, idx: list[int]) -> None:
            for i, out in zip(idx, await self._scorers[name].score([inputs[i] for i in idx])):
                outputs[i] = out
                self.metrics.samples.labels(name, out.status).inc()
                self.metrics.score_seconds.labels(name).observe(out.seconds)

        await asyncio.gather(*(run(name, idx) for name, idx in groups.items()))
        return outputs  # type: ignore[return-value]  # every slot was filled above

    async def score_stream(self, inputs: AsyncIterable[ScoreInput]) -> AsyncIterator[ScoreOutput]:
        """Yield outputs in completion order, reading inputs only while fewer than
        `max_in_flight` are outstanding. A slot frees when the consumer takes an output, so a
        consumer that stops reading stops the intake too.

        Errors of the input iterator propagate; closing the generator cancels pending work.
        """
        slots = asyncio.Semaphore(self._max_in_flight)
        finished: asyncio.Queue[asyncio.Task] = asyncio.Queue()
        pending: set[asyncio.Task] = set()

        async def feed() -> None:
            async for item in inputs:
                await slots.acquire()
                task = asyncio.create_task(self._score_one(item))
                pending.add(task)
                task.add_done_callback(finished.put_nowait)

        feeder = asyncio.create_task(feed())
        feeder.add_done_callback(finished.put_nowait)
        fed_all = False
        try:
            while not fed_all or pending:
                task = await finished.get()
                if task is feeder:
                    task.result()  # re-raise an error of the input stream
                    fed_all = True
                    continue
                pending.discard(task)
                out = task.result()
                slots.release()
                yield out
        finally:
            feeder.cancel()
            for task in pending:
                task.cancel()
            await asyncio.gather(feeder, *pending, return_exceptions=True)

    async def _score_one(self, item: ScoreInput) -> ScoreOutput:
        (out,) = await self.score([item])
        return out
