"""Freezing a real process for a fault test.

`kill(pid, SIGSTOP)` returns before the process has stopped: the signal is delivered to each
thread on its way back to user space, and a loaded host's process can still answer a request
sent right after (CI saw a NATS server frozen this way store a publish). `freeze` returns once
/proc shows every thread stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path


def _states(pid: int) -> list[str]:
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:  # the state is the field after the parenthesised command name
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            pass
    return states


def _stopped(pid: int) -> bool:
    states = _states(pid)
    return bool(states) and all(st in ("T", "t") for st in states)


async def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every thread of it is stopped, the event loop free."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _stopped(pid):
        assert time.monotonic() < deadline, f"pid {pid} not stopped: thread states {_states(pid)}"
        await asyncio.sleep(0.005)
