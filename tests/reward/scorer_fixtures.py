"""User scorer functions loaded by import path (`python:tests.reward.scorer_fixtures:<fn>`)."""

from services.reward.types import ScoreInput


def length(item: ScoreInput) -> float:
    return float(len(item.completion))


async def async_has_def(item: ScoreInput) -> bool:
    return "def " in item.completion


def boom(item: ScoreInput) -> float:
    raise ValueError(f"boom on {item.id}")


def not_a_number(item: ScoreInput):
    return "high"


NOT_CALLABLE = 3


# meet_a and meet_b score 1.0 only when both are running for the same item at the same time:
# a composite that ran its parts one after another would make the first one time out.
_arrived: dict[str, set[str]] = {}


async def _meet(item: ScoreInput, who: str) -> float:
    import asyncio

    arrived = _arrived.setdefault(item.id, set())
    arrived.add(who)
    for _ in range(500):
        if len(arrived) == 2:
            return 1.0
        await asyncio.sleep(0.01)
    raise TimeoutError(f"{who}: the other part did not run alongside it within 5 s")


async def meet_a(item: ScoreInput) -> float:
    return await _meet(item, "a")


async def meet_b(item: ScoreInput) -> float:
    return await _meet(item, "b")
