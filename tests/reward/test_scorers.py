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
    assert "AssertionError" in third.error
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
