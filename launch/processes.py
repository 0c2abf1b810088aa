"""The applications' child processes and signals, written once for the launcher, the demos, the
jobs and the benchmarks.

Owns: making a child die with its parent (`die_with_parent`), stopping a child (SIGTERM, a
grace period, then SIGKILL of its process group: `stop_process`), the tail of a child's log
for an error message (`tail_log`), SIGTERM treated as Ctrl-C while an application starts
or tears down (`sigterm_interrupts`), and the command line that runs `hotloop` as a child
(`hotloop_command`).

Does not own: the asynchronous part of stopping a job, where the first SIGINT or SIGTERM
cancels the job's coroutine so it can checkpoint (`hotloop.service.run_interruptible`), nor a
service's own shutdown (`hotloop.service.run`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, even by SIGKILL, so a
    killed `hotloop up` or demo never leaves services (and their vLLM engines) running.
    Services run in their own session so that Ctrl-C reaches only the launcher, which stops
    them in order."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not glibc Linux: the launcher's own stop() remains the only guard
        pass


def hotloop_command(python: str = sys.executable) -> list[str]:
    """`hotloop` as a child's command line, with `python`: `python -m` the module of
    the package's `hotloop` console script, read from the installed metadata, so that the
    rooms below the CLI (this one, the benchmarks) start it without naming the CLI's module
    (the layering test). With `PYTHONPATH` set, the child imports the same copy of the code."""
    from importlib.metadata import entry_points

    script = next(iter(entry_points(group="console_scripts", name="hotloop")), None)
    if script is None:
        raise RuntimeError("no `hotloop` console script: install the package (`pip install -e .`)")
    return [python, "-m", script.module]


def tail_log(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_process(popen: subprocess.Popen | None, grace_s: float,
                 warn: Callable[[str], None] | None = None) -> None:
    """SIGTERM (a trainer checkpoints and exits), then, after `grace_s`, SIGKILL of its process
    group (a child started with `start_new_session`: its own children go with it). Nothing
    to do for a child that was never started or has exited; `warn` hears about a kill."""
    if popen is None or popen.poll() is not None:
        return
    popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(grace_s)
    except subprocess.TimeoutExpired:
        (warn or log.warning)(f"pid {popen.pid} did not stop within {grace_s:.0f} s of SIGTERM; killing it")
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        popen.wait()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Inside, SIGTERM raises KeyboardInterrupt in the main thread, like Ctrl-C: code that
    cleans up on Ctrl-C (a `with mesh:`, a `finally`) then cleans up on SIGTERM too, during a
    start-up that takes minutes. The previous handler is restored on the way out."""
    old = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
