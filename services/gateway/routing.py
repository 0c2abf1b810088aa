"""Choosing a healthy rollout replica for each request.

Owns: per-replica state (healthy, why not, requests this gateway has in flight there, the load
the replica reported), a background poll of every replica, and the choice itself:
`least_loaded` (fewest requests in flight, ties in turn) or `round_robin` (in turn).
A replica that fails a request, or says it is not serving, is marked down at once, so the next
request goes elsewhere without waiting; the poll brings it back when it answers again. A poll
that merely gets no answer in time marks it down only after `failures` in a row: a replica (or
this gateway's own loop) busy with a burst answers slowly, and refusing users then would turn
load into outage.
Does not own: the wire (a `Replica` talks to its server) or retrying a request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from hotloop.errors import Unavailable

from .types import Replica

log = logging.getLogger(__name__)


@dataclass
class ReplicaState:
    replica: Replica
    healthy: bool = False
    reason: str = "not polled yet"
    in_flight: int = 0  # this gateway's requests on it now
    others: int = 0  # requests of other callers (e.g. training rollouts) at the last poll
    served: int = 0
    failures: int = 0  # requests it failed
    missed_polls: int = 0  # polls in a row without an answer

    @property
    def load(self) -> int:
        return self.in_flight + self.others


class Router:
    def __init__(self, replicas: list[Replica], policy: str = "least_loaded",
                 interval_s: float = 2.0, timeout_s: float = 1.0, failures: int = 3):
        if not replicas:
            raise ValueError("no rollout replicas configured ([endpoints] rollout)")
        self._states = [ReplicaState(r) for r in replicas]
        self._policy = policy
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._failures = failures
        self._turn = 0
        self._poller: asyncio.Task | None = None

    @property
    def states(self) -> list[ReplicaState]:
        return list(self._states)

    async def start(self) -> None:
        """Poll once (so a fresh gateway routes at once), then keep polling in the background."""
        await self.poll()
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for s in self._states:
            await s.replica.close()

    async def poll(self) -> None:
        async def one(s: ReplicaState) -> None:
            was = s.healthy
            try:
                running = await s.replica.probe(self._timeout_s)
            except Exception as e:  # a probe that raises is a sick replica, not a crash
                s.missed_polls += 1
                if s.missed_polls >= self._failures or not s.healthy:
                    s.healthy, s.reason = False, f"health check failed: {e}"
            else:
                s.missed_polls = 0
                s.healthy = running is not None
                s.reason = "" if s.healthy else "not serving"
                if running is not None:
                    s.others = max(0, running - s.in_flight)
            if was != s.healthy:
                log.info("replica %s is %s", s.replica.address,
                         "healthy" if s.healthy else f"unhealthy ({s.reason})")

        await asyncio.gather(*(one(s) for s in self._states))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.poll()

    def mark_down(self, replica: Replica, reason: str) -> None:
        for s in self._states:
            if s.replica is replica:
                if s.healthy:
                    log.warning("replica %s marked unhealthy: %s", replica.address, reason)
                s.healthy, s.reason = False, reason
                s.failures += 1

    def pick(self, exclude: set[int] = frozenset()) -> ReplicaState:
        """A healthy replica not in `exclude` (ids of states), else Unavailable."""
        n = len(self._states)
        order = [(self._turn + i) % n for i in range(n)]  # rotating start: ties go in turn
        candidates = [self._states[i] for i in order
                      if self._states[i].healthy and id(self._states[i]) not in exclude]
        if not candidates:
            why = "; ".join(f"{s.replica.address}: {s.reason}" for s in self._states)
            raise Unavailable(f"no healthy rollout replica ({why})")
        self._turn = (self._turn + 1) % n
        if self._policy == "least_loaded":
            return min(candidates, key=lambda s: s.load)  # min keeps the first of equals
        return candidates[0]

    @staticmethod
    def acquire(state: ReplicaState) -> None:
        state.in_flight += 1

    @staticmethod
    def release(state: ReplicaState, ok: bool) -> None:
        state.in_flight -= 1
        if ok:
            state.served += 1
