"""Stopping the applications' children, and SIGTERM as Ctrl-C, with real processes and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launch.processes import sigterm_interrupts, stop_process, tail_log

# Ignores SIGTERM, starts a grandchild in its own process group, says so, then sleeps.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(g.pid, flush=True)
time.sleep(60)
"""


def test_a_child_that_stops_on_sigterm_is_not_killed():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    warned = []
    stop_process(p, grace_s=30, warn=warned.append)
    assert p.returncode == -signal.SIGTERM and warned == []


def test_a_child_that_ignores_sigterm_is_killed_with_its_process_group():
    p = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    grandchild = psutil.Process(int(p.stdout.readline()))
    warned = []
    t0 = time.monotonic()
    stop_process(p, grace_s=0.5, warn=warned.append)
    assert p.returncode == -signal.SIGKILL and time.monotonic() - t0 < 10
    assert len(warned) == 1 and str(p.pid) in warned[0]
    grandchild.wait(10)  # raises TimeoutExpired if the group was not killed
    assert not grandchild.is_running()


def test_nothing_to_stop():
    stop_process(None, grace_s=1)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    stop_process(p, grace_s=1)  # exited already: no signal to a pid that may be reused
    assert p.returncode == 0


def test_sigterm_is_ctrl_c_inside_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with sigterm_interrupts():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs between bytecodes: well before this ends
    assert signal.getsignal(signal.SIGTERM) is before


def test_tail_log(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    assert tail_log(log, 2) == "line 28\nline 29"
    assert tail_log(tmp_path / "missing.log") == "(no log)"


def test_hotloop_command_runs_the_cli_of_this_checkout():
    """What the stack and the benchmarks start as `hotloop`: the installed console script's
    module with this interpreter, importing the code on this PYTHONPATH."""
    from launch.processes import hotloop_command

    cmd = hotloop_command()
    assert cmd[:2] == [sys.executable, "-m"]
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([*cmd, "train", "--help"], capture_output=True, text=True, cwd=root,
                       env={**os.environ, "PYTHONPATH": str(root)}, timeout=60)
    assert r.returncode == 0 and "usage: hotloop train" in r.stdout, r.stderr
    assert "ppo" in r.stdout and "online" in r.stdout  # the recipes, from the registry
