"""Scorers: code extraction, code_tests statuses and rewards, rules, user functions."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from services.reward.config import RegexRule, RewardConfig, SandboxConfig
from services.reward.pool import LocalPool, SandboxPool
from services.reward.sandbox import SandboxJob, SandboxResult
from services.reward.scorers import (
    CodeTestsScorer, PythonScorer, RegexScorer, build_scorers, cases_for, extract_code,
)
from services.reward.types import CODE_PREFIX_KEY, ScoreInput, TaskSpec

from .conftest import LIMITS

ADD_TASK = TaskSpec("add", entry_point="add",
                    test_cases=("assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"))


class NoPool(SandboxPool):
    """A pool that must not be reached: the input is decided before any code runs."""

    isolation = None  # type: ignore[assignment]

    async def run(self, jobs: Sequence[SandboxJob]) -> list[SandboxResult]:
        assert not jobs, f"unexpected sandbox jobs: {jobs}"
        return []

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def pool():
    # LocalPool binds to no event loop, so one pool serves every test's loop.
    p = LocalPool(SandboxConfig(isolation="process", **LIMITS), concurrency=2)
    yield p
    asyncio.run(p.close())


# ---- extraction ---------------------------------------------------------------------------


def test_extract_fenced_python_block():
    text = "Here:\n```python\ndef f():\n    return 1\n```\nDone."
    assert extract_code(text).code == "def f():\n    return 1" and extract_code(text).fenced


def test_extract_prefers_the_block_defining_the_entry_point():
    text = "```python\nprint(add(1, 2))\n```\nand\n```py\ndef add(a, b):\n    return a + b\n```"
    assert extract_code(text, "add").code.startswith("def add")
    assert extract_code(text).code == "print(add(1, 2))"


def test_extract_unclosed_block_takes_the_rest():
    assert extract_code("```python\ndef f():\n    return 1\n").code == "def f():\n    return 1\n"


def test_extract_skips_other_languages_and_accepts_bare_fences():
    assert extract_code("```bash\nls\n```\n```\nx = 1\n```").code == "x = 1"


def test_extract_raw_text_and_empty():
    assert extract_code("def f(): return 2") == type(extract_code(""))("def f(): return 2", False)
    assert extract_code("  \n").code is None


def test_cases_for_humaneval_style_block_calls_check():
    spec = TaskSpec(tests="def check(candidate):\n    assert candidate(1) == 2\n", entry_point="inc",
                    test_cases=("assert inc(0) == 1",))
    cases = cases_for(spec)
    assert cases[0] == "assert inc(0) == 1" and cases[1].rstrip().endswith("check(inc)")
    assert cases_for(TaskSpec(tests="assert f(1)\n", entry_point="f")) == ["assert f(1)\n"]


# ---- code_tests ---------------------------------------------------------------------------


async def test_reward_is_the_fraction_of_cases_passed(pool):
    scorer = CodeTestsScorer(pool)
    items = [
        ScoreInput("right", "p", "```python\ndef add(a, b):\n    return a + b\n```", ADD_TASK),
        ScoreInput("third", "p", "```python\ndef add(a, b):\n    return a * b\n```", ADD_TASK),
        ScoreInput("raw", "p", "def add(a, b):\n    return a + b\n", ADD_TASK),
        ScoreInput("loop", "p", "```python\nwhile True:\n    pass\n```", ADD_TASK),
    ]
    right, third, raw, loop = await scorer.score(items)
    assert (right.id, right.reward, right.passed, right.failed, right.status) == ("right", 1.0, 3, 0, "ok")
    assert (third.reward, third.passed, third.failed, third.status) == (pytest.approx(1 / 3), 1, 2, "ok")
    # the tests' process says what came back
    assert third.error == "test case 0: AssertionError: add(1, 2) returned 2, expected 3"
    assert (raw.reward, raw.status) == (1.0, "ok")
    assert (loop.reward, loop.status, loop.timed_out) == (0.0, "timeout", True)


async def test_decided_before_running_code():
    scorer = CodeTestsScorer(NoPool())
    no_code, syntax, prose, no_tests, bad_entry = await scorer.score([
        ScoreInput("a", "p", "", ADD_TASK),
        ScoreInput("b", "p", "```python\ndef add(a, b) return a\n```", ADD_TASK),
        ScoreInput("c", "p", "I would write a function that adds.", ADD_TASK),
        ScoreInput("d", "p", "```python\ndef add(a, b):\n    return a + b\n```", TaskSpec("t0", entry_point="add")),
        ScoreInput("e", "p", "x = 1", TaskSpec("t1", entry_point="not valid", test_cases=("assert True",))),
    ])
    assert (no_code.status, no_code.reward, no_code.failed) == ("no_code", 0.0, 3)
    assert syntax.status == "syntax_error" and "SyntaxError" in syntax.error
    assert prose.status == "no_code" and "not Python" in prose.error
    assert no_tests.status == "scorer_error" and "no tests" in no_tests.error
    assert bad_entry.status == "scorer_error" and "identifier" in bad_entry.error


async def test_humaneval_style_task_with_prefix(pool):
    from hotloop.tasks import load_tasks
    from services.reward.types import task_spec_from_code_task

    task = load_tasks("humaneval", "test")[0]
    spec = task_spec_from_code_task(task)
    assert spec.extra[CODE_PREFIX_KEY] == task.prefix
    scorer = CodeTestsScorer(pool)
    body_only, full_fn, wrong = await scorer.score([
        ScoreInput("body", task.prompt, task.solution, spec),  # a raw continuation of the stub
        ScoreInput("full", task.prompt, f"```python\n{task.prefix}{task.solution}```", spec),
        ScoreInput("wrong", task.prompt, f"```python\ndef {task.entry_point}(*a):\n    return None\n```", spec),
    ])
    assert (body_only.reward, body_only.status) == (1.0, "ok"), body_only.error
    assert (full_fn.reward, full_fn.status) == (1.0, "ok"), full_fn.error
    assert (wrong.reward, wrong.passed, wrong.failed) == (0.0, 0, 1)


# ---- HumanEval and values across the boundary ---------------------------------------------


@pytest.mark.timeout(120)
async def test_every_humaneval_canonical_solution_passes_and_every_empty_one_fails(pool):
    """The tests run in their own process and call the code through proxies: every check
    block of HumanEval (loops, helpers from the prompt such as `poly`, floats, exceptions)
    still gives the canonical solutions full reward, and a body that returns None none."""
    from hotloop.tasks import load_tasks
    from services.reward.types import task_spec_from_code_task

    tasks = load_tasks("humaneval", "test")
    specs = [task_spec_from_code_task(t) for t in tasks]
    scorer = CodeTestsScorer(pool)
    right = await scorer.score([ScoreInput(t.task_id, t.prompt, t.solution, s) for t, s in zip(tasks, specs)])
    assert [(o.id, o.error) for o in right if (o.status, o.reward) != ("ok", 1.0)] == []
    empty = await scorer.score([ScoreInput(t.task_id, t.prompt, "    return None\n", s) for t, s in zip(tasks, specs)])
    assert [o.id for o in empty if o.reward > 0] == []


async def test_the_prompts_helpers_are_the_tasks_not_the_samples(pool):
    """HumanEval/38's test encodes with the prompt's `encode_cyclic` and expects the sample's
    `decode_cyclic` to invert it. A sample that redefines both as the identity would pass
    if the tests took `encode_cyclic` from the sample."""
    from hotloop.tasks import load_tasks
    from services.reward.types import task_spec_from_code_task

    task = next(t for t in load_tasks("humaneval", "test") if t.task_id == "HumanEval/38")
    hack = "def encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s\n"
    right = f"```python\n{task.prefix}{task.solution}```"
    (out, ok) = await CodeTestsScorer(pool).score([
        ScoreInput("hack", task.prompt, f"```python\n{hack}```", task_spec_from_code_task(task)),
        ScoreInput("right", task.prompt, right, task_spec_from_code_task(task)),
    ])
    assert (out.reward, ok.reward) == (0.0, 1.0), (out, ok)


async def test_legit_solutions_and_plain_equality(pool):
    task = TaskSpec("f", entry_point="f", test_cases=(
        "assert f(1) == [1, (2.0, 'x'), {'k': {3}}, b'\\x00', None, True, 1j]",
        "assert f(2) == 1",        # returns True: 1 == True, as == says
        "assert f(3) == 0.0",      # returns -0.0
        "assert f(4) == 1e999",    # returns inf
        "assert f(5) == 10 ** 30",  # returns a big int
        "assert f(6) == (1, 2)",   # returns [1, 2]: a list is not a tuple, as == says
        "assert f(7) != f(7)",     # returns nan: nan != nan
    ))
    code = (
        "def f(i):\n"
        "    return {1: [1, (2.0, 'x'), {'k': {3}}, b'\\x00', None, True, 1j], 2: True, 3: -0.0,\n"
        "            4: float('inf'), 5: 10 ** 30, 6: [1, 2], 7: float('nan')}[i]\n"
    )
    (out,) = await CodeTestsScorer(pool).score([ScoreInput("ok", "p", f"```python\n{code}```", task)])
    assert (out.passed, out.failed, out.status) == (6, 1, "ok"), out
    assert out.error == "test case 5: AssertionError: f(6) returned [1, 2], expected (1, 2)"


async def test_the_codes_own_objects_work_through_proxies(pool):
    """Classes, methods, attributes, iteration, exceptions and generators of the code, used
    by tests as they would be in one process; only equality stays with the tests."""
    code = (
        "class Stack:\n"
        "    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n        return self\n"
        "    def pop(self):\n"
        "        if not self.items:\n            raise IndexError('empty')\n"
        "        return self.items.pop()\n"
        "    def __len__(self):\n        return len(self.items)\n"
        "    def __iter__(self):\n        return iter(self.items)\n"
        "    def __getitem__(self, i):\n        return self.items[i]\n"
        "class Bad(ValueError):\n    pass\n"
        "def count(n):\n    yield from range(n)\n"
        "def check_positive(x):\n"
        "    if x < 0:\n        raise Bad('negative')\n    return x\n"
    )
    task = TaskSpec("stack", test_cases=(
        "s = Stack()\ns.push(1).push(2)\nassert len(s) == 2 and s.pop() == 2 and list(s) == [1]",
        "s = Stack()\ntry:\n    s.pop()\n    raised = False\nexcept IndexError as e:\n    raised = 'empty' in str(e)\nassert raised",
        "s = Stack()\ns.push(5)\nassert s.items == [5] and s[0] == 5 and s is s and s != Stack()",
        "assert sum(count(4)) == 6 and list(count(3)) == [0, 1, 2]",
        "try:\n    check_positive(-1)\n    ok = False\nexcept ValueError:\n    ok = True\nassert ok",
        "s = Stack()\ns.label = 'x'\nassert s.label == 'x' and Stack.__name__ == 'Stack'",
    ))
    (out,) = await CodeTestsScorer(pool).score([ScoreInput("o", "p", f"```python\n{code}```", task)])
    assert (out.passed, out.failed, out.status) == (6, 0, "ok"), out


async def test_values_that_cannot_cross_fail_their_case_with_a_reason(pool):
    task = TaskSpec("f", entry_point="f", test_cases=(
        "assert f(0) == 0",   # too deep
        "assert f(1) == 0",   # too large
        "assert f(2) == 0",   # raises
        "assert f(3) == 3",   # fine
    ))
    code = (
        "def f(i):\n"
        "    if i == 0:\n        v = []\n        for _ in range(200):\n            v = [v]\n        return v\n"
        "    if i == 1:\n        return 'x' * (2 << 20)\n"
        "    if i == 2:\n        raise KeyError('nope')\n"
        "    return 3\n"
    )
    (out,) = await CodeTestsScorer(pool).score([ScoreInput("v", "p", f"```python\n{code}```", task)])
    assert (out.passed, out.failed) == (1, 3), out
    assert out.error.startswith("test case 0: CandidateFailure: the value cannot be sent: nested deeper than")


# ---- rules and user functions -------------------------------------------------------------


async def test_format_rule():
    scorer = RegexScorer("format", RewardConfig().rules["format"])
    hit, miss = await scorer.score([
        ScoreInput("1", "p", "```python\nx = 1\n```"), ScoreInput("2", "p", "x = 1"),
    ])
    assert (hit.reward, hit.status, miss.reward, miss.status) == (1.0, "ok", 0.0, "ok")
    assert "not found" in miss.error


async def test_custom_rule_rewards():
    scorer = RegexScorer("short", RegexRule(pattern=r"^.{0,5}$", match_reward=0.5, miss_reward=-1.0))
    short, long = await scorer.score([ScoreInput("1", "p", "abc"), ScoreInput("2", "p", "abcdefgh")])
    assert (short.reward, long.reward) == (0.5, -1.0)


async def test_python_scorers_by_import_path():
    ok = PythonScorer.load("python:tests.reward.scorer_fixtures:length")
    is_async = PythonScorer.load("python:tests.reward.scorer_fixtures:async_has_def")
    boom = PythonScorer.load("python:tests.reward.scorer_fixtures:boom")
    nan = PythonScorer.load("python:tests.reward.scorer_fixtures:not_a_number")
    item = ScoreInput("x", "p", "def f(): pass")
    (a,), (b,), (c,), (d,) = [await s.score([item]) for s in (ok, is_async, boom, nan)]
    assert (a.reward, a.status) == (13.0, "ok")
    assert (b.reward, b.status) == (1.0, "ok")
    assert (c.status, c.reward) == ("scorer_error", 0.0) and "ValueError: boom on x" in c.error
    assert d.status == "scorer_error" and "'high'" in d.error


def test_python_scorer_import_errors_surface_at_startup():
    with pytest.raises(ModuleNotFoundError):
        PythonScorer.load("python:tests.reward.no_such_module:fn")
    with pytest.raises(ValueError, match="not callable"):
        PythonScorer.load("python:tests.reward.scorer_fixtures:NOT_CALLABLE")


def test_build_scorers_imports_before_making_the_pool():
    made = []
    cfg = RewardConfig(scorers=["code_tests", "python:tests.reward.no_such_module:fn"])
    with pytest.raises(ModuleNotFoundError):
        build_scorers(cfg, lambda: made.append(1) or NoPool())
    assert made == []
    scorers, pool = build_scorers(RewardConfig(scorers=["format"], default_scorer="format"), NoPool)
    assert list(scorers) == ["format"] and pool is None
    scorers, pool = build_scorers(RewardConfig(), NoPool)
    assert sorted(scorers) == ["code_tests", "format"] and isinstance(pool, NoPool)


async def test_a_huge_or_deep_returned_value_fails_its_sample_not_the_request(pool):
    """An int past Python's 4300-digit repr limit once failed the whole Score call (the error
    message repr'd it), ending a demo run; the tests' process describes it instead, and the
    other samples of the batch are scored."""
    task = TaskSpec("f", entry_point="f", test_cases=("assert f() == 3",))
    huge = "def f():\n    return 10 ** 5000\n"
    fine = "def f():\n    return 3\n"
    big, ok = await CodeTestsScorer(pool).score([
        ScoreInput("big", "p", f"```python\n{huge}```", task),
        ScoreInput("ok", "p", f"```python\n{fine}```", task),
    ])
    assert (big.reward, big.status) == (0.0, "ok"), big
    assert big.error == "test case 0: AssertionError: f() returned an int of about 5001 digits, expected 3"
    assert (ok.reward, ok.status) == (1.0, "ok")
