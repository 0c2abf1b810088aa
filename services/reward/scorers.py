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

Test cases of the shape `assert <call> == <literal>` (or `<literal> == <call>`) are not judged
inside the sandbox: the call's value comes out strictly encoded (plain data of exact builtin
types, see `strict.py`) and is compared with the literal here, so a returned object whose
`__eq__` always says True, or a subclass of int or str that overrides it, fails instead of
passing every case. A HumanEval-style `check(candidate)` block made only of such asserts is
compared the same way, assert by assert, and still counts as one case. Any other case
(several statements, `is`, `<`, a non-literal expected value, a block with a loop) runs
inside the sandbox as before; each output counts how many cases went each way
(`cases_compared_trusted`, `cases_in_sandbox`); the gRPC result has no field for them, so
the service logs them per batch (debug level).

Failures are outputs, never exceptions: no code -> `no_code`, unparsable code ->
`syntax_error`, sandbox outcomes -> `timeout`/`oom`/`crash`, a task without tests or a user
scorer that raises -> `scorer_error` with the reason in `error` (reward 0, but marked, so a
trainer can tell a broken scorer from a bad sample). A composite with a part in
`scorer_error` is in `scorer_error` itself (see `CompositeScorer`).
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import logging
import math
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import strict
from .config import PYTHON_SCORER_PREFIX, LengthRule, RegexRule, RewardConfig
from .pool import SandboxPool
from .sandbox import SandboxJob, SandboxResult, ValueCase
from .types import CODE_PREFIX_KEY, ScoreInput, ScoreOutput, ScoreStatus, TaskSpec

# A fence line, an optional language tag, the body, and the closing fence or the end of the
# text (a completion cut off by max_tokens often never closes its block).
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:\n?```|\Z)", re.DOTALL)
log = logging.getLogger(__name__)
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
        ast.parse(code)
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


@dataclass(frozen=True)
class Comparison:
    """A case compared in this process: `expression`'s value in the sandbox == `expected`."""

    expression: str
    expected: object


def comparison_of(case: str) -> Comparison | None:
    """The trusted comparison a case asks for, or None when it has another shape.

    The shape is `assert <call> == <literal>` (either side), one statement, where the
    literal is plain data by `ast.literal_eval` (not `float('nan')`, not a complex number).
    Parsed with `ast`, never evaluated here beyond `literal_eval`. An assert message is not
    needed for the comparison and is dropped.
    """
    tree = _parse(case)
    if tree is None or len(tree.body) != 1:
        return None
    return _assert_comparison(tree.body[0])


def check_block_comparisons(block: str, entry_point: str) -> tuple[Comparison, ...] | None:
    """A HumanEval-style block as trusted comparisons, or None when it has another shape.

    The block may hold literal assignments (METADATA = {...}), docstrings and one
    `def check(candidate):` whose body is only `assert candidate(...) == <literal>` (either
    side; `assert True` lines are skipped). Each becomes `<entry_point>(...)` compared here;
    the block, still one case, passes when all of them do. Anything else (a loop, a helper,
    an import, `abs(candidate(x) - y) < 1e-6`) keeps the whole block inside the sandbox.
    """
    tree = _parse(block)
    if tree is None or not entry_point.isidentifier():
        return None
    checks = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            checks.append(node)
        elif not (_is_docstring(node) or _is_literal_assignment(node)):
            return None
    if len(checks) != 1:
        return None
    check = checks[0]
    a = check.args
    if (check.decorator_list or a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults
            or [x.arg for x in a.args] != ["candidate"]):
        return None
    out = []
    for node in check.body:
        if _is_docstring(node):
            continue
        if isinstance(node, ast.Assert) and isinstance(node.test, ast.Constant) and node.test.value is True:
            continue
        if not isinstance(node, ast.Assert):
            return None
        node = _Rename("candidate", entry_point).visit(node)
        c = _assert_comparison(node)
        if c is None:
            return None
        out.append(c)
    return tuple(out) or None


def _parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None


def _assert_comparison(node: ast.stmt) -> Comparison | None:
    if not isinstance(node, ast.Assert):
        return None
    test = node.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    for call, literal in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
        if not isinstance(call, ast.Call):
            continue
        try:
            expected = ast.literal_eval(literal)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if strict.is_plain(expected):
            return Comparison(ast.unparse(call), expected)
    return None


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _is_literal_assignment(node: ast.stmt) -> bool:
    if not (isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets)):
        return False
    try:
        ast.literal_eval(node.value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


class _Rename(ast.NodeTransformer):
    """`candidate` -> the entry point's name: what `check(<entry_point>)` would have passed."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.copy_location(ast.Name(self.new, node.ctx), node) if node.id == self.old else node


def comparisons_for(task: TaskSpec) -> list[tuple[Comparison, ...] | None]:
    """Per case of `cases_for(task)`, in the same order: the comparisons that decide it in
    this process, or None when it is judged inside the sandbox."""
    out: list[tuple[Comparison, ...] | None] = []
    for case in task.test_cases:
        c = comparison_of(case)
        out.append((c,) if c else None)
    if task.tests.strip():
        defines_check = task.entry_point and _DEFINES_CHECK.search(task.tests)
        out.append(check_block_comparisons(task.tests, task.entry_point) if defines_check else None)
    return out


def _first_difference(value: object, expected: object) -> str:
    def short(v: object) -> str:
        if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 256:
            # repr of an int past 4300 digits raises (sys.get_int_max_str_digits), and a
            # generated function may well return one: describe it instead
            return f"an int of about {int(v.bit_length() * 0.30103) + 1} digits"
        try:
            text = repr(v)
        except Exception as e:  # plain data, but deeper or larger than repr allows
            return f"a {type(v).__name__} that cannot be shown ({type(e).__name__})"
        return text if len(text) <= 80 else text[:77] + "..."

    return f"returned {short(value)}, expected {short(expected)}"


def _output(item: ScoreInput, start: float, **fields) -> ScoreOutput:
    return ScoreOutput(id=item.id, seconds=time.perf_counter() - start, **fields)


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

    def prepare(
        self, item: ScoreInput
    ) -> tuple[SandboxJob, tuple[tuple[Comparison, ...] | None, ...]] | ScoreOutput:
        """The sandbox job for an input and, per case, its trusted comparisons (None: judged
        inside the sandbox; a check block may need several, each one value case of the job);
        or the output when it never reaches the sandbox."""
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
        comparisons = tuple(comparisons_for(task))
        job_cases: list[str | ValueCase] = []
        for case, compare in zip(cases, comparisons):
            job_cases.extend([ValueCase(c.expression) for c in compare] if compare else [case])
        return SandboxJob(program, tuple(job_cases)), comparisons

    async def score(self, items: Sequence[ScoreInput]) -> list[ScoreOutput]:
        prepared = [self.prepare(item) for item in items]
        jobs = [p[0] for p in prepared if not isinstance(p, ScoreOutput)]
        results = iter(await self._pool.run(jobs))
        out: list[ScoreOutput] = []
        for item, p in zip(items, prepared):
            out.append(p if isinstance(p, ScoreOutput) else self._judged(item, next(results), p[1]))
        trusted = sum(o.cases_compared_trusted for o in out)
        log.debug("code_tests: %d samples, %d cases compared here, %d judged in the sandbox",
                  len(out), trusted, sum(o.cases_in_sandbox for o in out))
        return out

    @classmethod
    def _judged(cls, item: ScoreInput, r: SandboxResult,
                comparisons: tuple[tuple[Comparison, ...] | None, ...]) -> ScoreOutput:
        """`_to_output`, where judging one sample's values can never fail the whole request:
        what it raises (a value too deep to compare, say) is that sample's scorer error."""
        try:
            return cls._to_output(item, r, comparisons)
        except Exception as e:
            log.warning("judging %s failed: %r", item.id, e)
            return ScoreOutput(id=item.id, reward=0.0, passed=0, failed=len(comparisons),
                               timed_out=r.timed_out, status="scorer_error",
                               error=f"judging the returned values failed: {type(e).__name__}: {e}"[:300],
                               seconds=r.seconds)

    @staticmethod
    def _to_output(
        item: ScoreInput, r: SandboxResult, comparisons: tuple[tuple[Comparison, ...] | None, ...]
    ) -> ScoreOutput:
        total = len(comparisons)
        n_trusted = sum(c is not None for c in comparisons)
        passed, error = 0, r.error
        if r.case_passed:
            # The job's cases are the task's, with each compared case split into its value
            # cases. The sandbox counts a value case as passed when it produced a plain value;
            # whether that value is right is decided here. The first failing case, in case
            # order, gives the error: for one that failed inside the sandbox (an assert, an
            # exception, code that did not load) that is the sandbox's own first error.
            error, j = "", 0
            for i, compare in enumerate(comparisons):
                ok, why = True, ""
                for c in compare or (None,):
                    v = r.values[j]
                    if c is None or v is None or v.raised:
                        sub_ok, sub_why = r.case_passed[j], r.error
                    elif v.refused:
                        sub_ok, sub_why = False, f"test case {i}: {c.expression}: {v.refused}"
                    else:
                        sub_ok = v.value == c.expected  # plain data on both sides: Python's own ==
                        sub_why = f"test case {i}: {c.expression} {_first_difference(v.value, c.expected)}"
                    if ok and not sub_ok:
                        ok, why = False, sub_why
                    j += 1
                passed += ok
                error = error or why
        return ScoreOutput(
            id=item.id, reward=passed / total if total else 0.0, passed=passed, failed=total - passed,
            timed_out=r.timed_out, error=error, status=_SANDBOX_STATUS[r.status],
            seconds=r.seconds,  # the run itself; time queued behind other runs is not the sample's
            cases_compared_trusted=n_trusted, cases_in_sandbox=total - n_trusted,
        )


class RegexScorer(Scorer):
    """A rule: one reward when the pattern is found in the completion, another when not."""

    def __init__(self, name: str, rule: RegexRule):
        self.name = name
        self._rule = rule
        self._pattern = re.compile(rule.pattern, re.DOTALL if rule.dotall else 0)

    async def score(self, items: Sequence[ScoreInput]) -> list[ScoreOutput]:
        out = []
        for item in items:
            start = time.perf_counter()
            hit = self._pattern.search(item.completion) is not None
            out.append(_output(
                item, start, reward=self._rule.match_reward if hit else self._rule.miss_reward,
                passed=int(hit), failed=int(not hit),
                error="" if hit else f"pattern {self._rule.pattern!r} not found",
            ))
        return out


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
        out = []
        for item in items:
            start = time.perf_counter()
            words = len(item.completion.split())
            under = words <= self._rule.max_words
            out.append(_output(
                item, start, reward=self._rule.reward_under if under else self._rule.reward_over,
                passed=int(under), failed=int(not under),
                error="" if under else f"{words} words > max_words {self._rule.max_words}",
            ))
        return out


class CompositeScorer(Scorer):
    """A weighted sum of other scorers, each given the same items, all running at once.

    Per item, in the order of `parts`:
    - any part in `scorer_error` -> the composite is `scorer_error`, reward 0, with the first
      such part's reason (`<part>: <error>`): a broken part never yields a partial reward;
    - otherwise reward = sum(weight * part reward), and the status is the first part status
      that is not `ok` (e.g. `no_code`, `timeout` from code_tests). Those are verdicts on the
      sample, already priced into that part's reward (a sample with no code passes no test),
      so the other parts still count; the status says what happened.
    `error` joins the parts' errors as `<part>: <error>`; `passed`/`failed`, the case counts
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
            cases_compared_trusted=sum(o.cases_compared_trusted for o in outs),
            cases_in_sandbox=sum(o.cases_in_sandbox for o in outs),
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
