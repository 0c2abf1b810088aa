"""The reward service's messages as plain dataclasses (the proto types stop at `server.py`).

Owns: `TaskSpec`, `ScoreInput`, `ScoreOutput` and their field meanings; they mirror
`protos/hotloop/proto/v1/reward.proto` field for field. Does not own: how tasks are made
(`hotloop.tasks`) or scored (`scorers.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ScoreStatus = Literal["ok", "no_code", "syntax_error", "timeout", "oom", "crash", "scorer_error"]

CODE_PREFIX_KEY = "code_prefix"
"""`TaskSpec.extra` key: code placed before the completion's code (e.g. a HumanEval prompt
with its imports and the function stub the completion continues)."""


@dataclass(frozen=True)
class TaskSpec:
    """What a scorer needs to know about a task."""

    task_id: str = ""
    tests: str = ""
    """A test block run after the code, counted as one case. If it defines `check(candidate)`
    (HumanEval style) and `entry_point` is set, `check(<entry_point>)` is called too."""
    entry_point: str = ""
    """The function the tests call."""
    test_cases: tuple[str, ...] = ()
    """Test cases scored separately (typically one assert each)."""
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreInput:
    id: str
    prompt: str
    completion: str
    task: TaskSpec = TaskSpec()
    scorer: str = ""
    """Empty: the service's default scorer."""


@dataclass(frozen=True)
class ScoreOutput:
    id: str
    reward: float
    passed: int = 0
    failed: int = 0
    timed_out: bool = False
    error: str = ""
    """Why the sample did not get full reward (first failing test, limit hit, parse error, ...),
    or the error of a scorer that failed."""
    status: ScoreStatus = "ok"
    seconds: float = 0.0


def task_spec_from_code_task(task) -> TaskSpec:
    """A `hotloop.tasks.CodeTask` as the reward service sees it."""
    extra = {CODE_PREFIX_KEY: task.prefix} if task.prefix else {}
    return TaskSpec(
        task_id=task.task_id, tests=task.test_block, entry_point=task.entry_point,
        test_cases=tuple(task.tests), extra=extra,
    )
