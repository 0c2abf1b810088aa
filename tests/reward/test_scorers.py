"""Scorers: code extraction, code_tests statuses and rewards, rules, user functions."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from services.reward.config import RegexRule, RewardConfig, SandboxConfig
from services.reward.pool import LocalPool, SandboxPool
from services.reward.sandbox import SandboxJob, SandboxResult, ValueCase
from services.reward.scorers import (
    CodeTestsScorer, Comparison, PythonScorer, RegexScorer, build_scorers, cases_for, check_block_comparisons,
    comparison_of, extract_code,
)
from services.reward.strict import Returned
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
    # `assert add(..) == <literal>` cases are compared outside the sandbox; the error says how
    assert third.error == "test case 0: add(1, 2) returned 2, expected 3"
    assert (third.cases_compared_trusted, third.cases_in_sandbox) == (3, 0)
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


# ---- trusted comparison of `assert f(x) == <literal>` ---------------------------------------


def test_which_cases_are_compared_outside_the_sandbox():
    assert comparison_of("assert add(1, 2) == 3") == Comparison("add(1, 2)", 3)
    assert comparison_of("assert [1, -2.5] == f(x=[1, 2])") == Comparison("f(x=[1, 2])", [1, -2.5])
    assert comparison_of("assert f('a') == {'a': (1, None)}, 'with a message'") == \
        Comparison("f('a')", {"a": (1, None)})
    assert comparison_of("assert f() == {1, 2}") == Comparison("f()", {1, 2})
    for other in (
        "assert f(1) != 3",                 # not ==
        "assert f(1) is None",
        "assert f(1) == g(2)",              # expected is not a literal
        "assert f(1) == float('nan')",      # not a literal either: judged inside, nan != nan
        "assert f(1) == 1j",                # a literal, but not plain data
        "assert f(1) == 2 == 2",            # chained
        "assert f",
        "x = f(1)\nassert x == 2",          # two statements
        "assert f(1) == 3 and f(2) == 4",
        "assert f.x == 3",                  # not a call
        "def check(candidate):\n    assert candidate(1) == 2\n",
        "assert f(1 ==",                    # does not parse: the sandbox reports it
    ):
        assert comparison_of(other) is None, other


def test_which_check_blocks_are_compared_outside_the_sandbox():
    block = (
        "METADATA = {'author': 'x'}\n\n"
        "def check(candidate):\n"
        "    'docstring'\n"
        "    assert candidate([1, 2], 3) == 3\n"
        "    assert True, 'debugging aid'\n"
        "    assert [1] == candidate(candidate([], 0), 1), 'a message'\n"
    )
    assert check_block_comparisons(block, "f") == (
        Comparison("f([1, 2], 3)", 3), Comparison("f(f([], 0), 1)", [1]),
    )
    loop = "def check(candidate):\n    for x in range(3):\n        assert candidate(x) == x\n"
    close = "def check(candidate):\n    assert abs(candidate(1) - 0.5) < 1e-6\n"
    helper = "import math\ndef check(candidate):\n    assert candidate(1) == 1\n"
    other_arg = "def check(f):\n    assert f(1) == 1\n"
    only_true = "def check(candidate):\n    assert True\n"
    for other in (loop, close, helper, other_arg, only_true, "assert f(1) == 1"):
        assert check_block_comparisons(other, "f") is None, other


@pytest.mark.timeout(120)
async def test_every_humaneval_canonical_solution_still_passes(pool):
    """The check blocks compared outside the sandbox (most of HumanEval) give the canonical
    solutions the same full reward as running `check` inside did."""
    from hotloop.tasks import load_tasks
    from services.reward.types import task_spec_from_code_task

    tasks = load_tasks("humaneval", "test")
    items = [ScoreInput(t.task_id, t.prompt, t.solution, task_spec_from_code_task(t)) for t in tasks]
    outs = await CodeTestsScorer(pool).score(items)
    assert [o for o in outs if (o.status, o.reward) != ("ok", 1.0)] == []
    assert sum(o.cases_compared_trusted for o in outs) >= 100  # 112 of 164 blocks today
    assert sum(o.cases_compared_trusted + o.cases_in_sandbox for o in outs) == len(tasks)


async def test_an_object_equal_to_anything_fails_a_humaneval_check_block(pool):
    from hotloop.tasks import load_tasks
    from services.reward.types import task_spec_from_code_task

    task = load_tasks("humaneval", "test")[0]
    spec = task_spec_from_code_task(task)
    hack = EQ_HACKS["eq"] + f"def {task.entry_point}(*args):\n    return Yes()\n"
    (out,) = await CodeTestsScorer(pool).score([ScoreInput("hack", task.prompt, f"```python\n{hack}```", spec)])
    assert (out.reward, out.status, out.cases_compared_trusted) == (0.0, "ok", 1), out
    assert "is not plain data" in out.error


EQ_HACKS = {
    "eq": "class Yes:\n    def __eq__(self, other):\n        return True\n",
    # a subclass of int: hashes and prints like the int, equals anything
    "int_subclass": "class Yes(int):\n    def __eq__(self, other):\n        return True\n"
                    "    __hash__ = int.__hash__\n",
    # the __ne__/__hash__ variant, as a str subclass, for `!=` and dict/set lookups too
    "ne_hash": "class Yes(str):\n    def __eq__(self, other):\n        return True\n"
               "    def __ne__(self, other):\n        return False\n"
               "    def __hash__(self):\n        return 0\n",
}


@pytest.mark.parametrize("hack", sorted(EQ_HACKS))
async def test_objects_that_equal_anything_do_not_pass(pool, hack):
    code = EQ_HACKS[hack] + "def add(a, b):\n    return Yes()\n"
    # Both orders of the comparison: `3 == Yes()` falls back to Yes.__eq__ inside Python too.
    task = TaskSpec("add", entry_point="add", test_cases=ADD_TASK.test_cases + ("assert 5 == add(2, 3)",))
    (out,) = await CodeTestsScorer(pool).score([ScoreInput("hack", "p", f"```python\n{code}```", task)])
    assert (out.reward, out.passed, out.failed, out.status) == (0.0, 0, 4, "ok"), out
    assert "is not plain data" in out.error and "Yes" in out.error
    assert (out.cases_compared_trusted, out.cases_in_sandbox) == (4, 0)


async def test_the_hack_is_real_where_a_case_is_judged_inside_the_sandbox(pool):
    """The residual risk, kept visible: a case of another shape still asks the code's object."""
    code = EQ_HACKS["eq"] + "def add(a, b):\n    return Yes()\n"
    task = TaskSpec("add", entry_point="add", test_cases=("assert add(1, 2) == 3 and True",))
    (out,) = await CodeTestsScorer(pool).score([ScoreInput("hack", "p", f"```python\n{code}```", task)])
    assert (out.reward, out.cases_compared_trusted, out.cases_in_sandbox) == (1.0, 0, 1)


async def test_a_forged_report_cannot_pass_cases_compared_outside(pool):
    """The known residual risk (code reads the nonce from the harness frame and writes its
    own report) still passes cases judged inside; compared cases need the right values,
    which never enter the sandbox."""
    forge = (
        "import os, sys\n"
        "nonce = sys._getframe(1).f_locals['nonce']\n"
        "n = len(sys._getframe(1).f_locals['cases'])\n"
        "fields = [nonce, 'result', '1' * n, '0'] + [\"=['T']\"] * n + ['']\n"
        "os.write(3, ('\\t'.join(fields) + '\\n').encode())\n"
        "os._exit(0)\n"
    )
    inside = TaskSpec("add", entry_point="add", test_cases=tuple(f"{c} and True" for c in ADD_TASK.test_cases))
    forged_inside, forged_outside = await CodeTestsScorer(pool).score([
        ScoreInput("inside", "p", f"```python\n{forge}```", inside),
        ScoreInput("outside", "p", f"```python\n{forge}```", ADD_TASK),
    ])
    assert (forged_inside.reward, forged_inside.cases_in_sandbox) == (1.0, 3)  # the residual risk
    assert (forged_outside.reward, forged_outside.cases_compared_trusted) == (0.0, 3), forged_outside
    assert forged_outside.error == "test case 0: add(1, 2) returned True, expected 3"


async def test_patched_builtins_do_not_change_the_strict_encoding(pool):
    code = (
        "import builtins\n"
        "class Yes(int):\n    def __eq__(self, other):\n        return True\n"
        "real_type = type\n"
        "builtins.type = lambda x: int if real_type(x) is Yes else real_type(x)\n"
        "builtins.repr = lambda x: '3'\n"
        "def add(a, b):\n    return Yes(0)\n"
    )
    (out,) = await CodeTestsScorer(pool).score([ScoreInput("hack", "p", f"```python\n{code}```", ADD_TASK)])
    assert (out.reward, out.passed) == (0.0, 0), out


async def test_legit_solutions_and_plain_equality(pool):
    task = TaskSpec("f", entry_point="f", test_cases=(
        "assert f(1) == [1, (2.0, 'x'), {'k': {3}}, b'\\x00', None, True]",
        "assert f(2) == 1",        # returns True: 1 == True, as == says
        "assert f(3) == 0.0",      # returns -0.0
        "assert f(4) == 1e999",    # returns inf
        "assert f(5) == 10 ** 30",  # returns a big int (a literal expression)
        "assert f(6) == (1, 2)",   # returns [1, 2]: a list is not a tuple, as == says
    ))
    code = (
        "def f(i):\n"
        "    return {1: [1, (2.0, 'x'), {'k': {3}}, b'\\x00', None, True], 2: True, 3: -0.0,\n"
        "            4: float('inf'), 5: 10 ** 30, 6: [1, 2]}[i]\n"
    )
    (out,) = await CodeTestsScorer(pool).score([ScoreInput("ok", "p", f"```python\n{code}```", task)])
    assert (out.passed, out.failed, out.status) == (5, 1, "ok"), out
    assert out.error == "test case 5: f(6) returned [1, 2], expected (1, 2)"


async def test_nan_follows_plain_equality(pool):
    task = TaskSpec("f", entry_point="f", test_cases=(
        "assert f() == 1.0",              # compared here: nan != 1.0
        "assert f() == float('nan')",     # judged inside the sandbox: nan != nan there too
        "assert [f()] == [f()] or True",  # another shape, passes inside
        "assert g() == [1.5]",            # a list holding nan is not [1.5] either
    ))
    code = "def f():\n    return float('nan')\ndef g():\n    return [float('nan')]\n"
    (out,) = await CodeTestsScorer(pool).score([ScoreInput("nan", "p", f"```python\n{code}```", task)])
    assert (out.passed, out.failed) == (1, 3), out
    assert out.error == "test case 0: f() returned nan, expected 1.0"
    assert (out.cases_compared_trusted, out.cases_in_sandbox) == (2, 2)


async def test_mixed_shapes_are_counted_both_ways(pool):
    task = TaskSpec(
        "add", entry_point="add",
        test_cases=("assert add(1, 2) == 3", "assert add(1, 2) > 2", "x = add(2, 2)\nassert x == 4",
                    "assert add(0, 0) == 0"),
        tests="def check(candidate):\n    assert candidate(5, 5) == 10\n",
    )
    right, wrong = await CodeTestsScorer(pool).score([
        ScoreInput("right", "p", "```python\ndef add(a, b):\n    return a + b\n```", task),
        ScoreInput("wrong", "p", "```python\ndef add(a, b):\n    return a - b\n```", task),
    ])
    # cases 0, 3 and the check block (only `assert candidate(..) == <literal>`) compared here
    assert (right.reward, right.cases_compared_trusted, right.cases_in_sandbox) == (1.0, 3, 2)
    # a - b: case 0 differs, 1 and 2 fail inside, case 3 passes, the block's value differs
    assert (wrong.passed, wrong.failed, wrong.cases_compared_trusted, wrong.cases_in_sandbox) == (1, 4, 3, 2)
    assert wrong.error == "test case 0: add(1, 2) returned -1, expected 3"


async def test_values_that_cannot_be_sent_strictly_fail_with_a_reason(pool):
    task = TaskSpec("f", entry_point="f", test_cases=(
        "assert f(0) == 0",   # too deep
        "assert f(1) == 0",   # too large
        "assert f(2) == 0",   # raises: the sandbox's error
        "assert f(3) == 3",   # fine
    ))
    code = (
        "def f(i):\n"
        "    if i == 0:\n        v = []\n        for _ in range(200):\n            v = [v]\n        return v\n"
        "    if i == 1:\n        return 'x' * (1 << 20)\n"
        "    if i == 2:\n        raise KeyError('nope')\n"
        "    return 3\n"
    )
    (out,) = await CodeTestsScorer(pool).score([ScoreInput("v", "p", f"```python\n{code}```", task)])
    assert (out.passed, out.failed) == (1, 3), out
    assert out.error.startswith("test case 0: f(0): nested deeper than")
    (run,) = await pool.run([SandboxJob(code, tuple(ValueCase(f"f({i})") for i in range(4)))])
    assert "larger than" in run.values[1].refused and run.values[2].raised
    assert "KeyError" in run.error and run.values[3] == Returned(3)


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
    message repr'd it), ending a demo run; now it is described, and whatever else judging one
    sample raises is that sample's scorer_error, with the other samples of the batch scored."""
    task = TaskSpec("f", entry_point="f", test_cases=("assert f() == 3",))
    huge = "def f():\n    return 10 ** 5000\n"
    fine = "def f():\n    return 3\n"
    big, ok = await CodeTestsScorer(pool).score([
        ScoreInput("big", "p", f"```python\n{huge}```", task),
        ScoreInput("ok", "p", f"```python\n{fine}```", task),
    ])
    assert (big.reward, big.status) == (0.0, "ok"), big
    assert big.error == "test case 0: f() returned an int of about 5001 digits, expected 3"
    assert (ok.reward, ok.status) == (1.0, "ok")
