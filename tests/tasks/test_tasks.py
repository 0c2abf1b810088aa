"""Task sources: the built-in suite, JSONL files, HumanEval, and `load_tasks`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import hotloop.tasks
from hotloop.tasks import CodeTask, load_tasks
from hotloop.tasks.builtin import TEST_TEMPLATES, TRAIN_TEMPLATES, builtin_tasks, reference_tasks
from hotloop.tasks.jsonl import load_jsonl
from hotloop.tasks.task import CODE_BLOCK_INSTRUCTION

EXAMPLE = Path(hotloop.tasks.__file__).parent / "data" / "example.jsonl"


def _template(task: CodeTask) -> str:
    return task.task_id.split("/")[1]


# ---- built-in suite -----------------------------------------------------------------------


def test_builtin_sizes_and_splits():
    train, test = load_tasks("builtin", "train"), load_tasks("builtin", "test")
    # 128 held-out tasks: enough for the demo's paired before/after to resolve 10 points
    assert len(train) == 500 and len(test) == 128
    assert len({t.task_id for t in train + test}) == 628
    assert len(load_tasks("builtin", "all")) == 628
    # Disjoint by template, and every template is used.
    assert {_template(t) for t in train} == {t.key for t in TRAIN_TEMPLATES}
    assert {_template(t) for t in test} == {t.key for t in TEST_TEMPLATES}
    assert not {t.key for t in TRAIN_TEMPLATES} & {t.key for t in TEST_TEMPLATES}
    with pytest.raises(ValueError, match="splits"):
        load_tasks("builtin", "validation")


def test_heldout_templates_are_new_operations_spread_evenly():
    test = load_tasks("builtin", "test")
    per_template = {}
    for t in test:
        per_template[_template(t)] = per_template.get(_template(t), 0) + 1
    assert len(TEST_TEMPLATES) == 16 and set(per_template.values()) == {8}
    # Disjoint from training by operation, not only by key: no held-out reference body is a
    # training template's body, and no held-out function name pattern is a training one.
    train_bodies = {t.body for t in TRAIN_TEMPLATES}
    train_names = {n for t in TRAIN_TEMPLATES for n in t.names}
    for t in TEST_TEMPLATES:
        assert t.body not in train_bodies, t.key
        assert not set(t.names) & train_names, t.key
    train_prompts = {t.prompt for t in load_tasks("builtin", "train")}
    assert not train_prompts & {t.prompt for t in test}


def test_builtin_train_split_is_unchanged_by_heldout_templates():
    # Adding held-out templates must not move the training split (runs resume by position).
    import hashlib

    ids = "".join(t.task_id for t in builtin_tasks("train"))
    assert hashlib.sha1(ids.encode()).hexdigest() == "f8d4dddd5dc8afd12ff4e4e48ac80cab45d13b5c"


def test_builtin_is_deterministic_per_seed():
    assert builtin_tasks("test", seed=0) == builtin_tasks("test", seed=0)
    assert builtin_tasks("train", seed=0) == builtin_tasks("train", seed=0)
    assert [t.task_id for t in builtin_tasks("train", seed=1)] != [t.task_id for t in builtin_tasks("train", seed=0)]


def test_builtin_tasks_are_well_formed_and_short():
    for t in builtin_tasks("all"):
        assert t.problems() == [], (t.task_id, t.problems())
        assert len(t.tests) == 4 and all(c.startswith(f"assert {t.entry_point}(") for c in t.tests)
        assert f"`{t.entry_point}(" in t.prompt and CODE_BLOCK_INSTRUCTION in t.prompt
        assert len(t.prompt) < 400


def test_builtin_reference_solutions_pass_and_constants_fail_in_process():
    # Our own reference code (trusted), run here to check the generator's bookkeeping.
    for t in builtin_tasks("all"):
        ns: dict = {}
        exec(t.solution, ns)
        for case in t.tests:
            exec(case, ns)
        first_expected = t.tests[0].split(" == ", 1)[1]
        ns_const: dict = {}
        exec(f"def {t.entry_point}(*args):\n    return {first_expected}\n", ns_const)
        failures = 0
        for case in t.tests:
            try:
                exec(case, ns_const)
            except AssertionError:
                failures += 1
        assert failures >= 1, f"{t.task_id}: a constant function passes every test"


@pytest.mark.timeout(120)
def test_one_reference_solution_per_template_passes_in_the_sandbox_and_a_wrong_one_fails():
    from services.reward.config import SandboxConfig
    from services.reward.pool import LocalPool
    from services.reward.scorers import CodeTestsScorer
    from services.reward.types import ScoreInput, task_spec_from_code_task

    tasks = reference_tasks()
    assert len(tasks) == len(TRAIN_TEMPLATES) + len(TEST_TEMPLATES)
    items = []
    for t in tasks:
        spec = task_spec_from_code_task(t)
        items.append(ScoreInput(f"{t.task_id}:right", t.prompt, f"```python\n{t.solution}```", spec))
        wrong = f"```python\ndef {t.entry_point}(*args):\n    return None\n```"
        items.append(ScoreInput(f"{t.task_id}:wrong", t.prompt, wrong, spec))

    async def score():
        pool = LocalPool(SandboxConfig(wall_seconds=5.0), concurrency=2)
        try:
            return await CodeTestsScorer(pool).score(items)
        finally:
            await pool.close()

    outs = asyncio.run(score())
    for out in outs:
        if out.id.endswith(":right"):
            assert (out.status, out.reward) == ("ok", 1.0), out
        else:
            assert (out.status, out.reward, out.passed) == ("ok", 0.0, 0), out


# ---- JSONL --------------------------------------------------------------------------------


def test_example_jsonl_loads():
    tasks = load_jsonl(EXAMPLE)
    by_id = {t.task_id: t for t in tasks}
    assert list(by_id) == ["example/add", "example/shout", "example/evens"]
    assert len(by_id["example/add"].tests) == 3
    # A string of top-level asserts becomes one case per assert.
    assert by_id["example/shout"].tests == ("assert shout('hi') == 'HI!'", "assert shout('') == '!'")
    # A check(candidate) block is one HumanEval-style case.
    assert by_id["example/evens"].tests == () and "def check" in by_id["example/evens"].test_block
    assert [t.task_id for t in load_tasks(str(EXAMPLE), "test")] == ["example/evens"]
    assert len(load_tasks(str(EXAMPLE), "train")) == 2


def test_example_jsonl_solutions_pass_in_the_sandbox():
    from services.reward.config import SandboxConfig
    from services.reward.pool import LocalPool
    from services.reward.scorers import CodeTestsScorer
    from services.reward.types import ScoreInput, task_spec_from_code_task

    tasks = load_jsonl(EXAMPLE)
    items = [ScoreInput(t.task_id, t.prompt, f"```python\n{t.solution}```", task_spec_from_code_task(t))
             for t in tasks]

    async def score():
        pool = LocalPool(SandboxConfig(wall_seconds=5.0), concurrency=2)
        try:
            return await CodeTestsScorer(pool).score(items)
        finally:
            await pool.close()

    assert [(o.status, o.reward) for o in asyncio.run(score())] == [("ok", 1.0)] * 3


def test_bad_jsonl_lines_are_reported_with_line_numbers(tmp_path):
    good = {"task_id": "a", "prompt": "p", "tests": ["assert f() == 1"], "entry_point": "f"}
    lines = [
        json.dumps(good),                                            # 1 ok
        "{not json",                                                  # 2
        json.dumps({k: v for k, v in good.items() if k != "prompt"} | {"task_id": "b"}),  # 3 missing
        json.dumps(good),                                            # 4 duplicate id
        json.dumps(good | {"task_id": "c", "entry_point": "f g"}),   # 5 bad identifier
        json.dumps(good | {"task_id": "d", "test": "x"}),            # 6 unknown field
        json.dumps(good | {"task_id": "e", "tests": ["assert f(("]}),  # 7 test does not parse
        json.dumps(good | {"task_id": "g", "tests": []}),            # 8 no tests
        "",                                                           # 9 blank: skipped
        json.dumps([1, 2]),                                           # 10 not an object
        json.dumps(good | {"task_id": "h", "tests": 3}),             # 11 wrong type
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as info:
        load_jsonl(path)
    msg = str(info.value)
    for lineno, words in [(2, "not valid JSON"), (3, "missing field 'prompt'"), (4, "duplicate task_id 'a'"),
                          (5, "not a Python identifier"), (6, "unknown field"), (7, "does not parse"),
                          (8, "no tests"), (10, "JSON object"), (11, "field 'tests' has type int")]:
        assert f"{path}:{lineno}: " in msg and words in msg, (lineno, words, msg)
    assert f"{path}:1:" not in msg and f"{path}:9:" not in msg


def test_jsonl_without_split_fields_needs_split_all(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"task_id": "a", "prompt": "p", "tests": "assert f()", "entry_point": "f"}) + "\n")
    assert len(load_tasks(str(path), "all")) == 1
    with pytest.raises(ValueError, match="split='all'"):
        load_tasks(str(path), "train")


# ---- HumanEval and dispatch ---------------------------------------------------------------


def test_humaneval_tasks():
    tasks = load_tasks("humaneval", "test")
    assert len(tasks) == 164 and tasks[0].task_id == "HumanEval/0"
    for t in tasks:
        assert t.problems() == [], t.task_id
        assert t.prefix and t.prefix in t.prompt and "def check" in t.test_block and t.solution
    with pytest.raises(ValueError, match="only a test split"):
        load_tasks("humaneval", "train")


def test_humaneval_canonical_solutions_pass_in_the_sandbox():
    from services.reward.config import SandboxConfig
    from services.reward.pool import LocalPool
    from services.reward.scorers import CodeTestsScorer
    from services.reward.types import ScoreInput, task_spec_from_code_task

    tasks = load_tasks("humaneval", "test")[::20]  # 9 problems across the set
    items = [ScoreInput(t.task_id, t.prompt, t.solution, task_spec_from_code_task(t)) for t in tasks]
    items.append(ScoreInput("wrong", tasks[0].prompt, "    return None\n", task_spec_from_code_task(tasks[0])))

    async def score():
        pool = LocalPool(SandboxConfig(wall_seconds=10.0), concurrency=2)
        try:
            return await CodeTestsScorer(pool).score(items)
        finally:
            await pool.close()

    outs = asyncio.run(score())
    assert [(o.status, o.reward) for o in outs[:-1]] == [("ok", 1.0)] * len(tasks), [o for o in outs if o.reward < 1]
    assert (outs[-1].reward, outs[-1].passed) == (0.0, 0)


def test_load_tasks_rejects_unknown_sources():
    with pytest.raises(ValueError, match="not 'builtin', 'humaneval' or a JSONL file"):
        load_tasks("mbpp", "test")
