"""RewardCore: routing by scorer name, batch order, streaming with bounded in-flight work."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from services.reward.config import RewardConfig, SandboxConfig
from services.reward.core import RewardCore
from services.reward.scorers import RegexScorer, Scorer
from services.reward.types import ScoreInput, ScoreOutput, TaskSpec

from .conftest import LIMITS


class GatedScorer(Scorer):
    """Finishes an input only when the test releases its id; records how many are running."""

    name = "gated"

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.started: list[str] = []

    def gate(self, key: str) -> asyncio.Event:
        return self.gates.setdefault(key, asyncio.Event())

    async def score(self, items: Sequence[ScoreInput]) -> list[ScoreOutput]:
        out = []
        for item in items:
            self.started.append(item.id)
            await self.gate(item.id).wait()
            out.append(ScoreOutput(id=item.id, reward=float(item.id)))
        return out


def core_with(scorer: Scorer, max_in_flight: int) -> RewardCore:
    from services.reward.config import RegexRule

    return RewardCore({scorer.name: scorer, "format": RegexScorer("format", RegexRule(pattern="x"))},
                      scorer.name, max_in_flight)


async def test_batch_routes_by_scorer_and_keeps_order():
    core = RewardCore.from_config(RewardConfig(concurrency=2, sandbox=SandboxConfig(**LIMITS)))
    try:
        task = TaskSpec("t", entry_point="f", test_cases=("assert f() == 1",))
        outs = await core.score([
            ScoreInput("a", "p", "```python\ndef f():\n    return 1\n```", task),
            ScoreInput("b", "p", "no block here", scorer="format"),
            ScoreInput("c", "p", "def f():\n    return 2\n", task, scorer="code_tests"),
            ScoreInput("d", "p", "x", scorer="missing"),
        ])
        assert [o.id for o in outs] == ["a", "b", "c", "d"]
        assert [(o.status, o.reward) for o in outs] == [
            ("ok", 1.0), ("ok", 0.0), ("ok", 0.0), ("scorer_error", 0.0)]
        assert "unknown scorer 'missing'" in outs[3].error
        assert core.isolation is not None
    finally:
        await core.close()


async def test_stream_reads_at_most_max_in_flight_ahead():
    scorer = GatedScorer()
    core = core_with(scorer, max_in_flight=3)
    pulled: list[int] = []

    async def inputs():
        for i in range(8):
            pulled.append(i)
            yield ScoreInput(str(i), "p", "c")

    stream = core.score_stream(inputs())
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.05)
    # Three in flight, the fourth read is waiting for a slot.
    assert scorer.started == ["0", "1", "2"] and len(pulled) == 4
    scorer.gate("2").set()
    assert (await first).id == "2"  # completion order, not input order
    await asyncio.sleep(0.05)
    assert scorer.started == ["0", "1", "2", "3"]
    for i in range(8):
        scorer.gate(str(i)).set()
    rest = [o.id async for o in stream]
    assert sorted(rest) == ["0", "1", "3", "4", "5", "6", "7"]


async def test_an_unread_output_holds_its_slot():
    scorer = GatedScorer()
    core = core_with(scorer, max_in_flight=2)
    for i in range(6):
        scorer.gate(str(i)).set()  # everything finishes at once

    async def inputs():
        for i in range(6):
            yield ScoreInput(str(i), "p", "c")

    stream = core.score_stream(inputs())
    await stream.__anext__()
    await asyncio.sleep(0.05)
    # One output taken, one finished but unread, one more admitted: never more than 2 + taken.
    assert len(scorer.started) <= 3
    rest = [o.id async for o in stream]
    assert len(rest) == 5


async def test_stream_propagates_input_errors_and_cancels_pending_work():
    scorer = GatedScorer()
    core = core_with(scorer, max_in_flight=4)

    async def inputs():
        yield ScoreInput("0", "p", "c")
        await asyncio.sleep(0.01)
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError, match="client went away"):
        async for _ in core.score_stream(inputs()):
            pass
    assert scorer.started == ["0"] and not scorer.gate("0").is_set()


async def test_closing_the_stream_early_cancels_outstanding_inputs():
    scorer = GatedScorer()
    core = core_with(scorer, max_in_flight=4)
    scorer.gate("0").set()

    async def inputs():
        for i in range(10):
            yield ScoreInput(str(i), "p", "c")

    stream = core.score_stream(inputs())
    assert (await stream.__anext__()).id == "0"
    await stream.aclose()
    assert len(scorer.started) <= 5  # nothing was read after the close


def test_default_scorer_must_exist():
    with pytest.raises(ValueError, match="default scorer"):
        RewardCore({}, "code_tests", 4)
