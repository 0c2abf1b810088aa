"""`hotloop.quickexit`: a process that armed it skips the interpreter's last sweep of its heap
at exit, keeps its exit status and what it printed, and says nothing more on stderr after
its exit handlers; vLLM's engine processes arm it through the general plugin
(`hotloop.enginewatch.register`). Real child processes."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# An object in a reference cycle is freed only by a collection; the interpreter's final ones
# run its finalizer at exit, unless the heap was left out of them.
CHILD = """
import gc, sys
gc.disable()  # no collection before the exit's own: the finalizer tells which freed it
from hotloop import quickexit
if {arm}:
    quickexit.arm()

import os
MARK = os.open({marker!r}, os.O_WRONLY | os.O_CREAT)

class Marker:
    def __del__(self, write=os.write, fd=MARK):  # bound now: the teardown clears modules
        write(fd, b"swept")

cycle = Marker()
cycle.self = cycle
del cycle
print("last words", flush=False)
{end}
"""


def run_child(tmp_path: Path, arm: bool, end: str) -> tuple[subprocess.CompletedProcess, Path]:
    marker = tmp_path / f"swept-{arm}"
    code = CHILD.format(arm=arm, marker=str(marker), end=end)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    return proc, marker


@pytest.mark.parametrize("arm", [False, True])
def test_an_armed_exit_leaves_the_heap_unswept_and_keeps_its_status_and_output(tmp_path, arm):
    proc, marker = run_child(tmp_path, arm, "sys.exit(3)")
    assert proc.returncode == 3
    assert proc.stdout == "last words\n"  # buffered output still written
    # unarmed, the final collection frees the cycle and runs its finalizer; armed, it does not
    assert marker.read_text() == ("" if arm else "swept")


def test_an_uncaught_error_keeps_its_traceback_and_status(tmp_path):
    proc, _ = run_child(tmp_path, True, "raise RuntimeError('the reason')")
    assert proc.returncode == 1
    assert "RuntimeError: the reason" in proc.stderr


def test_what_is_printed_after_the_exit_handlers_is_silenced():
    # a handler registered after arming runs before the quick exit's and is heard; one
    # registered before it runs after (as the interpreter's teardown does): silenced
    code = textwrap.dedent("""
        import atexit, sys
        from hotloop import quickexit
        atexit.register(lambda: print("after", file=sys.stderr))
        quickexit.arm()
        atexit.register(lambda: print("before", file=sys.stderr))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stderr == "before\n"


def _engine_process(queue) -> None:
    from hotloop import enginewatch, quickexit

    enginewatch.register()  # what vLLM's load_general_plugins() does in its processes
    queue.put(quickexit._armed)


def test_the_vllm_plugin_arms_it_in_engine_processes_only():
    from hotloop import enginewatch, quickexit

    enginewatch.register()  # this process has no multiprocessing parent: not an engine
    assert not quickexit._armed
    ctx = multiprocessing.get_context("spawn")  # as vLLM starts its engine processes
    queue = ctx.Queue()
    child = ctx.Process(target=_engine_process, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) is True
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
