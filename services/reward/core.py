"""The reward service's core: score inputs with the configured scorers, batch or streaming.

Owns: routing each input to its scorer (by name; empty means the default), the batch call
`score(inputs)`, and `score_stream(inputs)`, which yields outputs as they complete while
keeping at most `max_in_flight` inputs outstanding (read but not yet taken by the consumer):
the backpressure the gRPC bidi stream relies on. No sockets, no protos.
Does not own: scoring itself (`scorers.py`), where code runs (`pool.py`), the wire (`server.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Sequence

from .config import RewardConfig
from .pool import SandboxPool, make_pool
from .sandbox import IsolationReport
from .scorers import Scorer, build_scorers
from .types import ScoreInput, ScoreOutput


class RewardCore:
    def __init__(
        self, scorers: dict[str, Scorer], default_scorer: str, max_in_flight: int,
        pool: SandboxPool | None = None,
    ):
        if default_scorer not in scorers:
            raise ValueError(f"default scorer {default_scorer!r} is not among {sorted(scorers)}")
        self._scorers = scorers
        self._default = default_scorer
        self._max_in_flight = max_in_flight
        self._pool = pool

    @classmethod
    def from_config(cls, config: RewardConfig) -> "RewardCore":
        """Build scorers and, when `code_tests` is enabled, the sandbox pool (isolation is
        detected here; `IsolationUnavailable` stops start-up)."""
        scorers, pool = build_scorers(config, lambda: make_pool(config))
        return cls(scorers, config.default_scorer, config.max_in_flight, pool)

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
                outputs[i] = ScoreOutput(
                    id=item.id, reward=0.0, status="scorer_error",
                    error=f"unknown scorer {name!r}; this service has {sorted(self._scorers)}",
                )

        async def run(name: str, idx: list[int]) -> None:
            for i, out in zip(idx, await self._scorers[name].score([inputs[i] for i in idx])):
                outputs[i] = out

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
