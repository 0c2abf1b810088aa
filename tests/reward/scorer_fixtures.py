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
