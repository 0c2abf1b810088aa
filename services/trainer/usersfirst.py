"""How a trainer shares the host with the users the same engine serves (`users_first`).

Owns the three policies, chosen by measurement (`hotloop bench joint`; docs/architecture.md,
"PPO with joint serving"):
- `none`: the trainer computes as it likes;
- `nice`: every thread of the trainer runs at the lowest OS priority (19), so the kernel gives
  the cores to the engine whenever it has users' tokens to compute, and the trainer keeps
  whatever is idle (measured on 2 cores with 2 streaming users: no latency gain, 30% less PPO
  throughput, because the engine alone kept both cores busy);
- `pause`: between micro-batches the trainer waits while the rollout reports users' requests
  in flight (`RolloutStatus.foreground_requests`), at most `max_pause_s` per wait.
Does not own: the engine's own priority scheduling (users at priority 0, training at
`hotloop.clients.TRAINING_PRIORITY`), or when a recipe calls `wait`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

from hotloop.clients import RolloutClient


class UsersFirst:
    """The trainer's side of sharing the host with users (`[ppo]` / `[online] users_first`).
    `rollout` is needed by `pause` only."""

    def __init__(self, policy: str, rollout: RolloutClient | None = None,
                 max_pause_s: float = 2.0) -> None:
        if policy == "pause" and rollout is None:
            raise ValueError("users_first = 'pause' watches a rollout replica: none given")
        self.policy, self.rollout, self.max_pause_s = policy, rollout, max_pause_s
        self._users = threading.Event()  # set while the rollout reports users in flight
        self.paused_s = 0.0
        self._watcher: asyncio.Task | None = None

    def start(self) -> None:
        """`nice`: call before the policy is loaded, so that every thread torch starts inherits
        the priority (Linux niceness is per thread and inherited at creation)."""
        if self.policy == "nice":
            for tid in _threads():
                with contextlib.suppress(OSError):  # a thread that just ended
                    os.setpriority(os.PRIO_PROCESS, tid, 19)

    def watch(self) -> None:
        """`pause`: start watching the replica's users in flight (stop with `close`)."""
        if self.policy == "pause" and self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            try:
                busy = (await self.rollout.status()).foreground_requests > 0
            except Exception:  # the replica restarting: train on, do not fail the run
                busy = False
            (self._users.set if busy else self._users.clear)()
            await asyncio.sleep(0.05)

    def wait(self, stop: threading.Event) -> None:
        """In the train thread, between micro-batches: wait while users are in flight."""
        if self.policy != "pause" or not self._users.is_set():
            return
        t0 = time.monotonic()
        while self._users.is_set() and not stop.is_set() and time.monotonic() - t0 < self.max_pause_s:
            time.sleep(0.01)
        self.paused_s += time.monotonic() - t0

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the calling thread only
        return [0]
