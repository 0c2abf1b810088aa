"""Code tasks for RL and evaluation: a built-in suite, HumanEval, and users' JSONL files.

Public API: `CodeTask` and `load_tasks(name_or_path, split)`. Does not own scoring (the
reward service runs completions against `CodeTask.tests`).
"""

from __future__ import annotations

from pathlib import Path

from .builtin import builtin_tasks
from .humaneval import humaneval_tasks
from .jsonl import load_jsonl
from .task import CodeTask

__all__ = ["CodeTask", "load_tasks", "builtin_tasks", "humaneval_tasks", "load_jsonl"]


def load_tasks(name_or_path: str, split: str) -> list[CodeTask]:
    """Tasks by source: `builtin` (splits train/test/all), `humaneval` (test/all), or the path
    of a JSONL file (split `all`, or a value of its lines' `split` field)."""
    if name_or_path == "builtin":
        return builtin_tasks(split)
    if name_or_path == "humaneval":
        return humaneval_tasks(split)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"task source {name_or_path!r} is not 'builtin', 'humaneval' or a JSONL file")
    return load_jsonl(path, split)
