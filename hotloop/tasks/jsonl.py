"""Users' own code tasks from a JSONL file (format: `hotloop/tasks/README.md`).

Owns parsing and validation: every bad line is reported with its line number, all at once,
and nothing is loaded from a file with a bad line (a half-loaded task set would skew a run
silently). Does not own the `CodeTask` rules themselves (`task.py`).
"""

from __future__ import annotations

import ast
import gzip
import json
import re
from pathlib import Path

from hotloop import pyast

from .task import CodeTask

REQUIRED = {"task_id": str, "prompt": str, "tests": (list, str), "entry_point": str}
OPTIONAL = {"prefix": str, "solution": str, "split": str}
_DEFINES_CHECK = re.compile(r"^def\s+check\s*\(", re.MULTILINE)


def split_test_string(block: str) -> tuple[tuple[str, ...], str]:
    """(cases, test_block) for a `tests` string.

    A block that defines `check(candidate)` is HumanEval style: one case. A block made only
    of top-level asserts becomes one case per assert (partial credit). Anything else (helpers,
    loops) is one case, since its asserts may depend on each other.
    """
    if _DEFINES_CHECK.search(block):
        return (), block
    tree = pyast.parse(block)  # the caller has checked that it parses
    if tree.body and all(isinstance(node, ast.Assert) for node in tree.body):
        return tuple(ast.get_source_segment(block, node) for node in tree.body), ""
    return (), block


def _parse_line(raw: str) -> tuple[CodeTask | None, str | None, list[str]]:
    """(task, split, problems) for one line."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return None, None, [f"not valid JSON ({e.msg} at column {e.colno})"]
    if not isinstance(obj, dict):
        return None, None, [f"expected a JSON object, got {type(obj).__name__}"]
    problems = []
    for key, kind in REQUIRED.items():
        if key not in obj:
            problems.append(f"missing field {key!r}")
        elif not isinstance(obj[key], kind):
            problems.append(f"field {key!r} has type {type(obj[key]).__name__}")
    for key, kind in OPTIONAL.items():
        if key in obj and not isinstance(obj[key], kind):
            problems.append(f"field {key!r} has type {type(obj[key]).__name__}")
    unknown = sorted(set(obj) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        problems.append(f"unknown field(s) {unknown} (allowed: {sorted({**REQUIRED, **OPTIONAL})})")
    if problems:
        return None, None, problems
    tests = obj["tests"]
    if isinstance(tests, list):
        if not all(isinstance(t, str) for t in tests):
            return None, None, ["field 'tests' must be a list of strings"]
        cases, block = tuple(tests), ""
    else:
        try:
            pyast.parse(tests)
        except (SyntaxError, ValueError) as e:
            return None, None, [f"the tests do not parse: {type(e).__name__}: {e}"]
        cases, block = split_test_string(tests)
    task = CodeTask(
        task_id=obj["task_id"], prompt=obj["prompt"], tests=cases, entry_point=obj["entry_point"],
        test_block=block, prefix=obj.get("prefix", ""), solution=obj.get("solution", ""),
    )
    return task, obj.get("split"), task.problems()


def load_jsonl(path: str | Path, split: str = "all") -> list[CodeTask]:
    """All tasks of the file (`split='all'`), or those whose `split` field equals `split`."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    tasks: list[tuple[CodeTask, str | None]] = []
    errors: list[str] = []
    first_line: dict[str, int] = {}
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            task, task_split, problems = _parse_line(raw)
            if task is not None and task.task_id in first_line:
                problems.append(f"duplicate task_id {task.task_id!r} (first on line {first_line[task.task_id]})")
            errors.extend(f"{path}:{lineno}: {p}" for p in problems)
            if task is not None and not problems:
                first_line[task.task_id] = lineno
                tasks.append((task, task_split))
    if errors:
        raise ValueError(f"{len(errors)} problem(s) in {path}:\n" + "\n".join(errors))
    if split == "all":
        return [t for t, _ in tasks]
    if not any(s is not None for _, s in tasks):
        raise ValueError(f"{path} has no `split` fields: load it with split='all'")
    return [t for t, s in tasks if s == split]
