"""Catch-up: a replica reaches the mesh's latest version by itself.

A replica that was down when a version was pushed (or restarted, which empties it: versions
live in the engine and a scratch directory) would otherwise serve an older policy until the
next push, and a mesh whose trainer is idle has no next push. The trainer announces every
version that went live on at least one replica (KV "latest", then `WeightsUpdated` with its
`fetch_from` address) and keeps each one in its store; `CatchUp` uses exactly that.

Owns: the newest version this replica knows the mesh announced (`known_latest`), one attempt
to reach it (`sync`: read the KV; if it is ahead of the replica, fetch the archive from a
trainer, check that it is the announced one, and load it through the core), the bounded wait at
start-up (`start`), the background loop afterwards (`follow`), and its metrics
(`metric_families`: the announced version, whether the replica is behind, attempts by result).

When it looks: at start-up before the replica serves; on each `WeightsUpdated` (it subscribes:
reacting at once, and the announcement names a trainer); each time the bus connection comes
back (an announcement published while it was away is never delivered: core NATS subjects are
at-most-once); and every `poll_s` as the backstop for anything else the subscription missed
(one KV read). A failed attempt is retried with a doubling wait up to `retry_max_s`, and logged.

Where it fetches from, in order: the configured trainer (`[endpoints] trainer`), then the
`fetch_from` of the last announcement heard. With neither, nothing can be fetched, so the
start-up wait ends at once instead of running out its bound; an announcement will name a
trainer (a trainer announces its latest version again when it starts).

Does not own: verifying and loading (`RolloutCore.push` checks size, sha256, base model,
shapes, rank and values and leaves nothing behind on failure), the bus connection or the wire
to the trainer (both injected: `bus_latest`, `hotloop.clients.TrainerClient`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from hotloop.adapters import Version, version_from_proto
from hotloop.errors import FailedPrecondition, HotloopError, Unavailable
from hotloop.metrics import counter, gauge

log = logging.getLogger(__name__)

FIRST_RETRY_S = 0.5
FETCH_TIMEOUT_S = 120.0  # one whole transfer; a start-up attempt gets at most what is left

Fetch = Callable[[str, int, float], Awaitable[tuple[Version, AsyncIterator[bytes]]]]
"""(trainer address, version, timeout_s) -> the stored version and its archive's chunks."""


class Replica(Protocol):
    """What catch-up needs of the replica (`RolloutCore`)."""

    @property
    def latest(self) -> int: ...

    async def push(self, info: Version, chunks: AsyncIterator[bytes], make_latest: bool = True): ...


def bus_latest(bus) -> Callable[[], Awaitable[Version | None]]:
    """A reader of KV "latest" on `bus` (a `hotloop.bus.Bus`); None when nothing was announced.
    A bus that cannot answer is `Unavailable` (catch-up retries), anything else propagates."""
    from hotloop.bus import LATEST_KEY, transient
    from hotloop.proto.v1 import common_pb2

    async def read() -> Version | None:
        try:
            msg = await bus.kv_get(LATEST_KEY, common_pb2.VersionInfo)
        except Exception as e:
            if transient(e):
                raise Unavailable(f"the bus did not say the latest version: {e!r}") from e
            raise
        return None if msg is None else version_from_proto(msg)

    return read


class TrainerFetch:
    """`Fetch` over the trainers' `FetchAdapter` (`hotloop.clients.TrainerClient`), one
    channel per address."""

    def __init__(self, admin_token: str = "") -> None:
        self._clients: dict = {}
        self._token = admin_token  # FetchAdapter is an admin RPC

    async def __call__(self, address: str, version: int,
                       timeout_s: float) -> tuple[Version, AsyncIterator[bytes]]:
        if address not in self._clients:
            from hotloop.clients import TrainerClient

            self._clients[address] = TrainerClient(address, self._token)
        return await self._clients[address].fetch_adapter(version, timeout_s)

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for c in clients.values():
            await c.close()


async def listen(catchup: "CatchUp", bus) -> None:
    """Wake `catchup` on every `WeightsUpdated` on `bus` and each time its connection comes
    back. Call before the first `start`: no announcement then falls between the subscription
    and the first read of the KV."""
    from hotloop.bus import WEIGHTS_UPDATED
    from hotloop.proto.v1 import bus_pb2

    async def on_weights(msg, headers) -> None:
        catchup.announced(version_from_proto(msg.info), msg.fetch_from)

    await bus.subscribe(WEIGHTS_UPDATED, bus_pb2.WeightsUpdated, on_weights)
    bus.on_reconnect(catchup.wake)


class CatchUp:
    def __init__(self, replica: Replica, read_latest: Callable[[], Awaitable[Version | None]],
                 fetch: Fetch, trainer: str = "", *, poll_s: float = 30.0,
                 retry_max_s: float = 30.0):
        """`trainer`: the configured FetchAdapter address ("" for none)."""
        self.replica = replica
        self._read_latest = read_latest
        self._fetch = fetch
        self._trainer = trainer
        self._announced_from = ""
        self._poll_s = poll_s
        self._retry_max_s = retry_max_s
        self._known: Version | None = None
        self._wake = asyncio.Event()
        self.error = ""
        """Why the last attempt did not reach `known_latest`; empty when current."""
        self.loaded = 0  # versions it loaded
        self.failed = 0  # attempts to fetch and load that failed (each source tried counts)

    # ---- what is known -----------------------------------------------------------------
    @property
    def known_latest(self) -> int:
        """The newest version known to be announced, or what the replica holds if newer."""
        return max(self._known.version if self._known else 0, self.replica.latest)

    @property
    def behind(self) -> bool:
        return self.known_latest > self.replica.latest

    def sources(self) -> list[str]:
        """Trainer addresses to fetch from, the configured one first."""
        return list(dict.fromkeys(a for a in (self._trainer, self._announced_from) if a))

    def _note(self, v: Version) -> None:
        if self._known is None or v.version > self._known.version:
            self._known = v

    def announced(self, info: Version, fetch_from: str) -> None:
        """A `WeightsUpdated` arrived: remember it and where it can be fetched, and look now
        if it is news. An announcement of what the replica holds already (the push reached
        it first, or the KV read at start did) wakes nothing: only a reconnect or the poll
        then looks at the KV again."""
        self._note(info)
        if fetch_from:
            self._announced_from = fetch_from
        if info.version > self.replica.latest:
            self._wake.set()

    def wake(self) -> None:
        """Look now (the bus connection came back)."""
        self._wake.set()

    # ---- one attempt -------------------------------------------------------------------
    async def sync(self, timeout_s: float = FETCH_TIMEOUT_S) -> bool:
        """One attempt to hold the newest announced version; True when the replica holds it
        (or something newer). `timeout_s` bounds the KV read and each transfer."""
        # Whatever woke us so far is covered by the read below; a wake from now on is news
        # and makes the next `_sleep` return at once.
        self._wake.clear()
        try:
            latest = await asyncio.wait_for(self._read_latest(), timeout_s)
        except (Unavailable, TimeoutError) as e:
            # an announcement heard earlier may still be fetchable
            latest, why_not = None, f"reading KV latest: {str(e) or 'timed out'}"
        else:
            why_not = ""
        if latest is not None:
            self._note(latest)
        target = self._known
        if target is None or target.version <= self.replica.latest:
            self.error = why_not if target is None else ""  # unread, or nothing to fetch
            return not self.error
        sources = self.sources()
        if not sources:
            self.error = (f"v{target.version} is announced but no trainer address is known "
                          "([endpoints] trainer is unset and no announcement was heard)")
            return False
        errors = [why_not] if why_not else []
        for address in sources:
            try:
                await self._load_from(address, target, timeout_s)
            except FailedPrecondition as e:
                if self.replica.latest >= target.version:  # a push got there first
                    self.error = ""
                    return True
                self.failed += 1
                errors.append(f"{address}: {e}")
            except HotloopError as e:  # unreachable, not in its store, or refused by the core
                self.failed += 1
                errors.append(f"{address}: {e}")
            else:
                self.loaded += 1
                self.error = ""
                return True
        self.error = "; ".join(errors)
        return False

    async def _load_from(self, address: str, target: Version, timeout_s: float) -> None:
        info, chunks = await self._fetch(address, target.version, timeout_s)
        try:
            if (info.version, info.sha256) != (target.version, target.sha256):
                # The core checks the bytes against the header it is given: give it the
                # announced one, and refuse a store whose record differs from what was announced.
                raise FailedPrecondition(
                    f"its v{info.version} has sha256 {info.sha256[:12]}, the announced "
                    f"v{target.version} has {target.sha256[:12]}")
            await self.replica.push(target, chunks, make_latest=True)
        finally:
            await chunks.aclose()
        log.info("caught up to v%d (sha %s) from the trainer at %s",
                 target.version, target.sha256[:12], address)

    def metric_families(self):
        """Prometheus families read when scraped (`hotloop.metrics.StateCollector`)."""
        yield gauge("hotloop_rollout_known_latest_version",
                    "The newest version this replica knows the mesh announced.", self.known_latest)
        yield gauge("hotloop_rollout_behind",
                    "1 while the replica serves an older version than was announced.",
                    int(self.behind))
        yield counter("hotloop_rollout_catchup_fetches_total",
                      "Versions catch-up fetched from a trainer, by result (loaded, failed).",
                      labels=["result"], samples=[(["loaded"], self.loaded),
                                                  (["failed"], self.failed)])

    # ---- when to look ------------------------------------------------------------------
    async def start(self, timeout_s: float) -> bool:
        """At start-up, before serving: reach the newest announced version within `timeout_s`.
        False when the replica starts behind: the bound ran out, or no trainer address is
        known (waiting could not help); `follow` goes on trying."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = FIRST_RETRY_S
        while True:
            left = deadline - loop.time()
            if await self.sync(max(0.1, min(left, FETCH_TIMEOUT_S))):
                return True
            left = deadline - loop.time()
            if not self.sources() or left <= 0:
                if self.behind:
                    log.warning("starting on v%d, behind the announced v%d (%s); catching up in "
                                "the background", self.replica.latest, self.known_latest, self.error)
                else:
                    log.warning("starting on v%d without knowing the latest version (%s); "
                                "checking in the background", self.replica.latest, self.error)
                return False
            wait = min(delay, left)
            log.warning("catch-up to v%d failed (%s); retrying in %.1f s", self.known_latest,
                        self.error, wait)
            await self._sleep(wait)
            delay = min(2 * delay, self._retry_max_s)

    async def follow(self) -> None:
        """After `start`, forever: look on every announcement, reconnect and `poll_s`; retry
        a failure with a doubling wait up to `retry_max_s`."""
        delay = FIRST_RETRY_S
        wait = delay if self.error else self._poll_s
        while True:
            await self._sleep(wait)
            if await self.sync():
                delay, wait = FIRST_RETRY_S, self._poll_s
                continue
            wait = delay
            delay = min(2 * delay, self._retry_max_s)
            log.warning("catch-up: serving v%d, behind the announced v%d (%s); retrying in "
                        "%.1f s", self.replica.latest, self.known_latest, self.error, wait)

    async def _sleep(self, seconds: float) -> None:
        """Sleep up to `seconds`; an announcement or a reconnect ends it early."""
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            pass
        self._wake.clear()
