"""Whether the engine still steps while it has work: a hung engine is found, not waited on.

Owns: `Heartbeat`, the record of the engine's last step and of the work it holds (requests
being generated, calls into the engine core), and the rule that calls it stalled: it holds
work and has made no step for `stall_s` since the later of its last step and the moment it
last became busy. An idle engine is never stalled, however long since its last step.

Why: an engine core that dies is seen at once (`AsyncLLM.errored`), but one that hangs (a
deadlocked worker, a stopped process, a GPU that stops answering) raises nothing. Its replica
would keep answering health checks, the gateway would keep sending it users, and every request
would wait for ever. The rollout core polls this (`RolloutCore.check_engine`, every 2 s under
`hotloop serve`) and, once stalled, fails every request in the engine with UNAVAILABLE (a
request without a token yet is then re-routed by the gateway and the balanced clients) and
stops the service, which `hotloop up`, compose and Kubernetes restart; the restarted replica
catches up with the mesh's versions before it serves.

What counts as a step: every batch of outputs the engine core sends (one per engine step that
produced a token), seen where the front end receives it (`RolloutCore.start` wraps the engine
client's `get_output_async`). Requests that return only their final output still send one per
step. Does not own: the clock (injected), what to do when stalled (the core).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Heartbeat:
    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic):
        """`stall_s`: seconds without a step while busy that count as a stall (0: never)."""
        self.stall_s = stall_s
        self._clock = clock
        self.steps = 0
        self.last_step: float | None = None
        self.busy = 0  # requests and engine calls in the engine now
        self._busy_since = 0.0

    def step(self) -> None:
        """The engine made a step (it sent outputs)."""
        self.steps += 1
        self.last_step = self._clock()

    def begin(self) -> None:
        if self.busy == 0:
            self._busy_since = self._clock()
        self.busy += 1

    def end(self) -> None:
        self.busy = max(0, self.busy - 1)

    @contextmanager
    def working(self) -> Iterator[None]:
        """Hold the engine busy for the duration (a request, a call into the engine core)."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    def stalled(self) -> float | None:
        """Seconds the engine has held work without a step, when past `stall_s`; else None."""
        if self.stall_s <= 0 or self.busy == 0:
            return None
        since = max(self._busy_since, self.last_step or 0.0)
        quiet = self._clock() - since
        return quiet if quiet > self.stall_s else None
