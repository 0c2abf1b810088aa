"""Scorers: one interface, chosen by name from the configuration.

Owns: turning `ScoreInput`s into `ScoreOutput`s for each kind of scorer:
- `code_tests`: extract the code from the completion, run it against the task's tests in the
  sandbox pool, reward = fraction of test cases passed;
- regex rules (e.g. `format`: the completion has a fenced Python block);
- length rules (brevity: one reward up to `max_words` words, another beyond);
- `python:<module>:<function>`: a user's function, imported at start-up;
- composites: a weighted sum of other scorers, run concurrently;
and `build_scorers(config, pool)`, the one place that maps names to scorers (reward models,
a scorer kind of their own, live in `reward_model.py`).
Does not own: running code (`pool.py`, `sandbox.py`), request flow (`core.py`).

Every test case is judged in a process of its own, apart from the code's (`sandbox.py`):
the code can make its own answers wrong, but cannot make a test pass, read an expected
value or replace the task's helpers.

Failures are outputs, never exceptions: no code -> `no_code`, unparsable code ->
`syntax_error`, sandbox outcomes -> `timeout`/`oom`/`crash`, a task without tests or a user
scorer that raises -> `scorer_error` with the reason in `error` (reward 0, but marked, so a
trainer can tell a broken scorer from a bad sample). A composite with a part in
`scorer_error` is in `scorer_error` itself (see `CompositeScorer`).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hotloop import pyast

from .config import PYTHON_SCORER_PREFIX, LengthRule, RegexRule, RewardConfig
from .pool import SandboxPool
from .sandbox import SandboxJob, SandboxResult
from .types import CODE_PREFIX_KEY, ScoreInput, ScoreOutput, ScoreStatus, TaskSpec

# A fence line, an optional language tag, the body, and the closing fence or the end of the
# text (a completion cut off by max_tokens often never closes its block).
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:\n?```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}
_DEFINES_CHECK = re.compile(r"^def\s+check\s*\(", re.MULTILINE)


class Scorer(ABC):
    """Scores a batch; one output per input, same order, never raising for a bad sample."""

    name: str

    @abstractmethod
    async def score(self, items: Sequence[ScoreInput]) -> list[ScoreOutput]: ...


@dataclass(frozen=True)
class Extracted:
    code: str | None
    fenced: bool


def extract_code(completion: str, entry_point: str = "") -> Extracted:
    """The code in a completion: a fenced Python block, else the whole text.

    With several Python blocks, the first one that defines `entry_point` wins (models often
    add a usage example in a second block), else the first block.
    """
    blocks = [m.group(2) for m in _FENCE.finditer(completion) if m.group(1).lower() in _PYTHON_TAGS]
    if blocks:
        if entry_point:
            defines = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
            for block in blocks:
                if defines.search(block):
                    return Extracted(block, fenced=True)
        return Extracted(blocks[0], fenced=True)
    return Extracted(completion if completion.strip() else None, fenced=False)


def _parse_error(code: str) -> str | None:
    # ast.parse rather than compile: it does no constant folding, so nothing in the
    # completion is evaluated in this process.
    try:
        pyast.parse(code)
    except (SyntaxError, ValueError, RecursionError, OverflowError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def cases_for(task: TaskSpec) -> list[str]:
    """The cases a task is scored on: each `test_cases` entry, then the `tests` block as one."""
    cases = list(task.test_cases)
    if task.tests.strip():
        block = task.tests
        if task.entry_point and _DEFINES_CHECK.search(block):
            block += f"\n\ncheck({task.entry_point})\n"
        cases.append(block)
    return cases


def _output(item: ScoreInput, start: float, **fields) -> ScoreOutput:
    return ScoreOutput(id=item.id, seconds=time.perf_counter() - start, **fields)


def _by_rule(items: Sequence[ScoreInput], miss: Callable[[str], str], hit_reward: float,
             miss_reward: float) -> list[ScoreOutput]:
    """One pass/fail rule per completion: `miss(text)` is "" when it passes, else why not (the
    output's error)."""
    out = []
    for item in items:
        start = time.perf_counter()
        why = miss(item.completion)
        out.append(_output(item, start, reward=miss_reward if why else hit_reward,
                           passed=int(not why), failed=int(bool(why)), error=why))
    return out


_SANDBOX_STATUS: dict[str, ScoreStatus] = {
    "ok": "ok", "failed": "ok", "timeout": "timeout", "oom": "oom", "crash": "crash",
    "error": "scorer_error",
}


class CodeTestsScorer(Scorer):
    """Runs the completion's code against the task's tests; reward = passed / cases.

    A task with no tests at all is a `scorer_error` for that sample (not a stream failure):
    the request was malformed, and a zero reward would look like a wrong answer.
    """

    name = "code_tests"

    def __init__(self, pool: SandboxPool):
        self._pool = pool

    def prepare(self, item: ScoreInput) -> SandboxJob | ScoreOutput:
        """The sandbox job for an input, or the output when it never reaches the sandbox."""
        start = time.perf_counter()
        task = item.task
        cases = cases_for(task)
        if not cases:
            return _output(item, start, reward=0.0, status="scorer_error",
                           error=f"task {task.task_id!r} has no tests (set TaskSpec.tests or test_cases)")
        if task.entry_point and not task.entry_point.isidentifier():
            return _output(item, start, reward=0.0, status="scorer_error", failed=len(cases),
                           error=f"entry_point {task.entry_point!r} is not a Python identifier")
        prefix = task.extra.get(CODE_PREFIX_KEY, "")
        found = extract_code(item.completion, task.entry_point)
        if found.code is None:
            return _output(item, start, reward=0.0, status="no_code", failed=len(cases),
                           error="the completion is empty")
        program = f"{prefix}\n{found.code}" if prefix else found.code
        error = _parse_error(program)
        if error is not None:
            if not found.fenced and not prefix:
                return _output(item, start, reward=0.0, status="no_code", failed=len(cases),
                               error=f"no ```python block, and the text is not Python ({error})")
            return _output(item, start, reward=0.0, status="syntax_error", failed=len(cases), error=error)
        return SandboxJob(program, tuple(cases), prefix=prefix, entry_point=task.entry_point)

    async def score(self, items: Sequence[ScoreInput]) -> list[ScoreOutput]:
        prepared = [self.prepare(item) for item in items]
        results = iter(await self._pool.run([p for p in prepared if isinstance(p, SandboxJob)]))
        return [p if isinstance(p, ScoreOutput) else self._to_output(item, next(results))
                for item, p in zip(items, prepared)]

    @staticmethod
    def _to_output(item: ScoreInput, r: SandboxResult) -> ScoreOutput:
        total = r.passed + r.failed
        return ScoreOutput(
            id=item.id, reward=r.passed / total if total else 0.0, passed=r.passed, failed=r.failed,
            timed_out=r.timed_out, error=r.error, status=_SANDBOX_STATUS[r.status],
            seconds=r.seconds,  # the run itself; time queued behind other runs is not the sample's
        )


class RegexScorer(Scorer):
    """A rule: one reward when the pattern is found in the completion, another when not."""

    def __init__(self, name: str, rule: RegexRule):
        self.name = name
        self._rule = rule
        self._pattern = re.compile(rule.pattern, re.DOTALL if rule.dotall else 0)

    async def score(self, items: Sequence[ScoreInput]) -> list[ScoreOutput]:
        def miss(text: str) -> str:
            return "" if self._pattern.search(text) else f"pattern {self._rule.pattern!r} not found"

        return _by_rule(items, miss, self._rule.match_reward, self._rule.miss_reward)


class PythonScorer(Scorer):
    """A user's function `fn(item: ScoreInput) -> float` (sync or async), by import path.

    Sync functions run in a worker thread so a slow one does not stall other requests. What
    the function raises, or a result that is not a finite number, becomes a `scorer_error`
    output carrying the error text.
    """

    def __init__(self, name: str, fn: Callable):
        self.name = name
        self._fn = fn
        self._is_async = inspect.iscoroutinefunction(fn)

    @classmethod
    def load(cls, name: str) -> "PythonScorer":
        """`python:<module>:<function>`; import errors surface at start-up, not per request."""
        _, module, attr = name.split(":")
        fn = getattr(importlib.import_module(module), attr, None)
        if not callable(fn):
            raise ValueError(f"scorer {name!r}: {module}.{attr} is missing or not callable")
        return cls(name, fn)

    async def score(self, items: Sequence[ScoreInput]) -> list[ScoreOutput]:
        return list(await asyncio.gather(*(self._score_one(item) for item in items)))

    async def _score_one(self, item: ScoreInput) -> ScoreOutput:
        start = time.perf_counter()
        try:
            value = await self._fn(item) if self._is_async else await asyncio.to_thread(self._fn, item)
        except Exception as e:  # the user's scorer failed: recorded on the sample, not raised
            return _output(item, start, reward=0.0, status="scorer_error",
                           error=f"{self.name} raised {type(e).__name__}: {e}")
        # bool is an int: a rule function may return True/False
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return _output(item, start, reward=0.0, status="scorer_error",
                           error=f"{self.name} returned {value!r}; expected a finite number")
        return _output(item, start, reward=float(value))


class LengthScorer(Scorer):
    """Brevity: `reward_under` for at most `max_words` words, else `reward_over`."""

    def __init__(self, name: str, rule: LengthRule):
        self.name = name
        self._rule = rule

    async def score(self, items: Sequence[ScoreInput]) -> list[ScoreOutput]:
        def miss(text: str) -> str:
            words = len(text.split())
            return "" if words <= self._rule.max_words else f"{words} words > max_words {self._rule.max_words}"

        return _by_rule(items, miss, self._rule.reward_under, self._rule.reward_over)


class CompositeScorer(Scorer):
    """A weighted sum of other scorers, each given the same items, all running at once.

    Per item, in the order of `parts`:
    - any part in `scorer_error` -> the composite is `scorer_error`, reward 0, with the first
      such part's reason (`<part>: <error>`): a broken part never yields a partial reward;
    - otherwise reward = sum(weight * part reward), and the status is the first part status
      that is not `ok` (e.g. `no_code`, `timeout` from code_tests). Those are verdicts on the
      sample, already priced into that part's reward (a sample with no code passes no test),
      so the other parts still count; the status says what happened.
    `error` joins the parts' errors as `<part>: <error>`; `passed`/`failed`
    and `timed_out` add up over the parts; `seconds` is the slowest part's (they run at once).
    """

    def __init__(self, name: str, parts: Sequence[tuple[str, Scorer, float]]):
        self.name = name
        self._parts = list(parts)

    async def score(self, items: Sequence[ScoreInput]) -> list[ScoreOutput]:
        per_part = await asyncio.gather(*(scorer.score(items) for _, scorer, _ in self._parts))
        return [self._combine(item, [outs[i] for outs in per_part]) for i, item in enumerate(items)]

    def _combine(self, item: ScoreInput, outs: list[ScoreOutput]) -> ScoreOutput:
        seconds = max(o.seconds for o in outs)
        names = [name for name, _, _ in self._parts]
        for name, o in zip(names, outs):
            if o.status == "scorer_error":
                return ScoreOutput(id=item.id, reward=0.0, status="scorer_error", error=f"{name}: {o.error}",
                                   seconds=seconds)
        reward = sum(w * o.reward for (_, _, w), o in zip(self._parts, outs))
        if not math.isfinite(reward):  # finite parts and weights can still overflow
            return ScoreOutput(id=item.id, reward=0.0, status="scorer_error", seconds=seconds,
                               error=f"{self.name}: the weighted sum overflowed ({reward})")
        return ScoreOutput(
            id=item.id, reward=reward,
            status=next((o.status for o in outs if o.status != "ok"), "ok"),
            error="; ".join(f"{name}: {o.error}" for name, o in zip(names, outs) if o.error),
            passed=sum(o.passed for o in outs), failed=sum(o.failed for o in outs),
            timed_out=any(o.timed_out for o in outs), seconds=seconds,
        )


def build_scorers(
    config: RewardConfig, make_pool: Callable[[], SandboxPool]
) -> tuple[dict[str, Scorer], SandboxPool | None]:
    """Every scorer a request may name, by name, and the sandbox pool if one is needed.

    Builds what `config.scorers` names and, for composites, their parts (listed or not); a
    part is built once however many composites use it. User functions are imported and
    reward models loaded before the pool starts, so a bad import path or model directory
    fails start-up without leaving a pool (threads, cgroups, a Ray instance) behind.
    """
    # Imported here: reward_model.py subclasses `Scorer` from this module.
    from .reward_model import RewardModelScorer

    needed = config.needed_scorers()  # parts come before the composites that use them
    built: dict[str, Scorer] = {}
    for name in needed:
        if name in config.rules:
            built[name] = RegexScorer(name, config.rules[name])
        elif name in config.length_rules:
            built[name] = LengthScorer(name, config.length_rules[name])
        elif name in config.reward_models:
            built[name] = RewardModelScorer.load(name, config.reward_models[name])
        elif name.startswith(PYTHON_SCORER_PREFIX):
            built[name] = PythonScorer.load(name)
        elif name != "code_tests" and name not in config.composites:
            raise ValueError(f"unknown scorer {name!r}")  # RewardConfig validates names; reaching this is a bug
    pool = None
    if "code_tests" in needed:
        pool = make_pool()
        built["code_tests"] = CodeTestsScorer(pool)
    for name in needed:
        if name in config.composites:
            parts = config.composites[name].parts
            built[name] = CompositeScorer(name, [(part, built[part], w) for part, w in parts.items()])
    return {name: built[name] for name in config.scorers}, pool
