"""The tail every benchmark shares: how it speaks, how it stops, how it reports.

Owns:
- `say`: one prefixed, flushed progress line per event (`[bench grpo] ...`);
- stopping: SIGTERM is Ctrl-C while a benchmark starts its mesh (`sigterm_interrupts`), the
  measured part runs under `run_interruptible` (the first SIGINT or SIGTERM cancels it, and
  what was measured is still reported), children are stopped by `stop_process`;
- the report: the result as JSON (and a Markdown table beside it) at `--json` and in the run
  directory, the table (or the JSON) printed last, and the exit code (130 interrupted, 1
  failed, 0).

Does not own: what a benchmark measures or how its table reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hotloop.service import run_interruptible

from launch.processes import sigterm_interrupts, stop_process

__all__ = ["exit_code", "report", "run_interruptible", "say_as", "sigterm_interrupts", "stop_process"]


def say_as(name: str) -> Callable[[str], None]:
    """A `say(msg)` that prints `[bench <name>] msg` at once (runs last minutes; lines must
    not wait in a buffer)."""

    def say(msg: str) -> None:
        print(f"[bench {name}] {msg}", flush=True)

    return say


def report(result: dict[str, Any], json_path: str | None, *, table: str | None = None,
           markdown: bool = False, run_dir: Path | None = None, name: str = "",
           say: Callable[[str], None] = print) -> str:
    """Write `result` as JSON at `json_path` (`--json`) when given and as
    `<run_dir>/bench-<name>.json` when the benchmark has a run directory, with `table` beside
    each as `.md` when it is `markdown`; then print the table, or the JSON when there is none.
    Returns the JSON text."""
    text = json.dumps(result, indent=2, default=str)

    def write(path: Path) -> list[Path]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if not (markdown and table is not None):
            return [path]
        path.with_suffix(".md").write_text(table)
        return [path, path.with_suffix(".md")]

    if run_dir is not None:
        write(run_dir / f"bench-{name}.json")
    if json_path:
        say("wrote " + " and ".join(map(str, write(Path(json_path)))))
    print(table if table is not None else text, flush=True)
    return text


def exit_code(interrupted: bool, failed: str | bool = "") -> int:
    """130 for a run stopped by Ctrl-C or SIGTERM (as a shell reports SIGINT), 1 for a run
    that failed part-way (it still reported what it measured), else 0."""
    return 130 if interrupted else 1 if failed else 0
