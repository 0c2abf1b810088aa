"""asyncio helpers that long-running loops share.

Why `raise_if_cancelled`: asyncio's cancellation is edge-triggered, and on Python 3.11 a
library can lose the edge. `asyncio.wait_for` (used by nats-py's requests and fetches) returns
its inner result when that result and a `Task.cancel()` land on the same loop iteration; the
cancelled task never sees `CancelledError` and runs on. A loop that then idles waiting for work
outlives its stop (CI saw a SIGTERM'd trainer do so and be given up on after 10 s). The request
is not forgotten, though: `Task.cancelling()` still counts it (nothing called `uncancel`). A
loop that calls `raise_if_cancelled()` once per iteration makes the stop level-triggered: the
step in flight finishes, the next one does not start.

Why `finish`: some work must not be cut half-way by a stop (a checkpoint and the acks it
covers, an engine swap whose weights and version table must agree, a thread that holds the
policy). `asyncio.shield` protects it from the first cancel only: the usual handler then
awaits the task plainly, and a second cancel (a service's stop cancels its loop at the signal
and again at its cleanup) cuts it there. `finish` waits through any number of them.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")


def cancel_requested() -> bool:
    """Whether the current task was asked to stop: a `cancel()` not undone by `uncancel()`
    (`asyncio.timeout` and `TaskGroup` uncancel the requests they raised themselves)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def raise_if_cancelled() -> None:
    """Raise `CancelledError` if the current task was cancelled and the error went missing.

    Call it at the top of a loop's iteration, not inside a handler that already caught the
    cancellation on purpose (that task's `cancelling()` stays raised until it ends)."""
    if cancel_requested():
        raise asyncio.CancelledError("cancelled earlier; a library swallowed the CancelledError")


async def finish(task: asyncio.Future[T]) -> T:
    """Wait for `task` to end, however many times the caller is cancelled meanwhile; then
    raise `CancelledError` if it was (the task is done: its result is `task.result()`; its
    error, if any, is the CancelledError's cause), else return the task's result or raise its
    error. A task that someone cancelled raises `CancelledError` as it would plainly."""
    stopped = False
    while not task.done():
        try:
            await asyncio.wait([task])  # unlike `await task`, a cancel here leaves the task alone
        except asyncio.CancelledError:
            stopped = True
    if stopped:
        error = None if task.cancelled() else task.exception()
        raise asyncio.CancelledError("cancelled while finishing work that must not be cut") from error
    return task.result()
