"""`CodeTask`: one programming task with its tests, as every task source produces it.

Owns the dataclass and the rules every source shares (a task has tests, the entry point is
an identifier, test code parses). Does not own: where tasks come from (`builtin.py`,
`jsonl.py`, `humaneval.py`) or how completions are scored (the reward service).
"""

from __future__ import annotations

from dataclasses import dataclass

from hotloop import pyast

CODE_BLOCK_INSTRUCTION = "Put your code in a ```python block."


@dataclass(frozen=True)
class CodeTask:
    task_id: str
    prompt: str
    """What the model is asked (plain text; the chat template is the caller's business)."""
    tests: tuple[str, ...]
    """Test cases, one assert each, scored separately (reward = fraction passed)."""
    entry_point: str
    """The function the tests call."""
    test_block: str = ""
    """A test program counted as one case; if it defines `check(candidate)` (HumanEval),
    `check(<entry_point>)` is called after it."""
    prefix: str = ""
    """Code placed before the completion's code (HumanEval: imports and the function stub)."""
    solution: str = ""
    """A completion known to pass (built-in reference solutions, HumanEval canonical ones);
    empty when the source has none. Used to check task suites, never shown to the model."""

    def problems(self) -> list[str]:
        """What is wrong with this task; empty when it is usable."""
        out = []
        if not self.task_id:
            out.append("task_id is empty")
        if not self.prompt.strip():
            out.append("prompt is empty")
        if not self.entry_point.isidentifier():
            out.append(f"entry_point {self.entry_point!r} is not a Python identifier")
        if not self.tests and not self.test_block.strip():
            out.append("no tests")
        for i, case in enumerate(self.tests):
            if not case.strip():
                out.append(f"test {i} is empty")
            elif (err := syntax_error(case)) is not None:
                out.append(f"test {i} does not parse: {err}")
        if self.test_block and (err := syntax_error(self.test_block)) is not None:
            out.append(f"the test block does not parse: {err}")
        return out


def syntax_error(code: str) -> str | None:
    try:
        pyast.parse(code)
    except (SyntaxError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None
