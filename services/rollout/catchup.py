"""Catch-up: a replica reaches the mesh's latest version of every lineage by itself.

A replica that was down when a version was pushed (or restarted, which empties it: versions
live in the engine and a scratch directory) would otherwise serve an older policy until the
next push, and a mesh whose trainer is idle has no next push. That holds for each lineage: the
default one and every tenant's (services/rollout/tenants.py). A trainer announces every
version that went live on at least one replica (KV `latest_key(tenant)`, then `WeightsUpdated`
on `weights_subject(tenant)` with its `fetch_from` address) and keeps each one in its store;
catch-up uses exactly that.

Owns, per lineage (`CatchUp`): the newest version this replica knows the mesh announced
(`known_latest`, also told to the replica: `Replica.announced`), one attempt to reach it
(`sync`: read the lineage's KV key; if it is ahead of the replica, fetch the archive from a
trainer, check that it is the announced one, and load it through the core as the lineage's
latest), the bounded wait at start-up (`start`) and the background loop afterwards (`follow`).
Across lineages (`Lineages`): which lineages exist (the KV's `latest.tenant.<name>` keys,
listed at start-up, on each reconnect and every `poll_s` (a failed listing sooner, with a
doubling wait), and any tenant whose announcement is heard: `listen` subscribes to every
tenant's subject with one wildcard), a `CatchUp` for each, started together under one
bound, and the metrics (`metric_families`: per lineage, label `tenant`, "" the default: the
announced version, whether the replica is behind, attempts by result).

When it looks: at start-up before the replica serves; on each `WeightsUpdated` (it subscribes:
reacting at once, and the announcement names a trainer); each time the bus connection comes
back (an announcement published while it was away is never delivered: core NATS subjects are
at-most-once); and every `poll_s` as the backstop for anything else the subscription missed
(one KV read per lineage). A failed attempt is retried with a doubling wait up to
`retry_max_s`, and logged.

Where it fetches from, in order: the configured trainers (a tenant's `[tenants.<name>]
trainer`, then `[endpoints] trainer`; a trainer that does not train the lineage answers
NOT_FOUND and the next is asked), then the `fetch_from` of the lineage's last announcement
heard, then the one the KV recorded with the latest version (`announced_key`: a replica that
starts after the announcement, in a mesh whose trainers are not all configured, say one per
tenant, still knows where to go). With none, nothing can be fetched, so the start-up wait
ends at once instead of running out its bound; an announcement will name a trainer (a trainer
announces its latest version again when it starts).

A tenant's versions are stored, not loaded into an engine slot: `RolloutCore.push` with a
tenant keeps the verified archive on disk and a slot is filled when a request first runs on
it, so catching up every tenant at start-up never needs more slots than the replica has.

Does not own: verifying and loading (`RolloutCore.push` checks size, sha256, base model,
shapes, rank and values and leaves nothing behind on failure), what a tenant's request does
while its lineage is still being fetched (the core's rule, told by `Replica.announced`), the
bus connection or the wire to the trainer (both injected: `bus_latest`, `bus_tenants`,
`hotloop.clients.TrainerClient`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

from hotloop.adapters import Version, version_from_proto, version_to_proto
from hotloop.aio import raise_if_cancelled
from hotloop.errors import FailedPrecondition, HotloopError, Unavailable
from hotloop.metrics import counter, gauge
from hotloop.tenants import DEFAULT, InvalidTenant, TenantId

log = logging.getLogger(__name__)

FIRST_RETRY_S = 0.5
FETCH_TIMEOUT_S = 120.0  # one whole transfer; a start-up attempt gets at most what is left

Fetch = Callable[[str, int, float, TenantId], Awaitable[tuple[Version, AsyncIterator[bytes]]]]
"""(trainer address, version, timeout_s, tenant) -> the stored version of that tenant's
lineage and its archive's chunks."""


class Replica(Protocol):
    """What catch-up needs of the replica (`RolloutCore`)."""

    def latest_of(self, tenant: TenantId) -> int:
        """The latest version the lineage of `tenant` ("" the default) holds (0: none)."""

    def announced(self, tenant: TenantId, version: int) -> None:
        """The mesh announced `version` of `tenant`'s lineage (what this replica knows)."""

    async def push(self, info: Version, chunks: AsyncIterator[bytes], make_latest: bool = True,
                   tenant: TenantId = DEFAULT): ...


def _read_kv(bus, key: str, message):
    """A reader of the `message` under `key`, or None; a bus that cannot answer is `Unavailable`."""
    from hotloop.bus import transient

    async def read():
        try:
            return await bus.kv_get(key, message)
        except Exception as e:
            if transient(e):
                raise Unavailable(f"the bus did not say the latest version: {e!r}") from e
            raise

    return read


def bus_latest(bus, tenant: TenantId = DEFAULT) -> Callable[[], Awaitable[Version | None]]:
    """A reader of the lineage's KV key (`latest`, or `latest.tenant.<name>`) on `bus` (a
    `hotloop.bus.Bus`); None when nothing was announced. A bus that cannot answer is
    `Unavailable` (catch-up retries), anything else propagates."""
    from hotloop.bus import latest_key
    from hotloop.proto.v1 import common_pb2

    read_kv = _read_kv(bus, latest_key(tenant), common_pb2.VersionInfo)

    async def read() -> Version | None:
        msg = await read_kv()
        return None if msg is None else version_from_proto(msg)

    return read


def bus_recorded(bus, tenant: TenantId = DEFAULT) -> Callable[[Version], Awaitable[str]]:
    """A reader of the address the lineage's last announcement recorded in the KV
    (`announced_key`) for a given version ("": none for that version; `recorded_address`). A
    bus that cannot answer is `Unavailable`."""
    from hotloop.bus import announced_key, recorded_address
    from hotloop.proto.v1 import bus_pb2

    read_kv = _read_kv(bus, announced_key(tenant), bus_pb2.WeightsUpdated)

    async def read(version: Version) -> str:
        return recorded_address(await read_kv(), version_to_proto(version))

    return read


def bus_tenants(bus) -> Callable[[], Awaitable[list[TenantId]]]:
    """A lister of the tenants whose lineage the mesh announced (their KV keys on `bus`);
    `Unavailable` when the bus cannot answer."""
    from hotloop.bus import lineage_of_key, transient

    async def tenants() -> list[TenantId]:
        try:
            keys = await bus.kv_keys()
        except Exception as e:
            if transient(e):
                raise Unavailable(f"the bus did not list the announced lineages: {e!r}") from e
            raise
        return sorted(t for t in map(lineage_of_key, keys) if t)

    return tenants


class TrainerFetch:
    """`Fetch` over the trainers' `FetchAdapter` (`hotloop.clients.TrainerClient`), one
    channel per address."""

    def __init__(self, admin_token: str = "") -> None:
        self._clients: dict = {}
        self._token = admin_token  # FetchAdapter is an admin RPC

    async def __call__(self, address: str, version: int, timeout_s: float,
                       tenant: TenantId = DEFAULT) -> tuple[Version, AsyncIterator[bytes]]:
        if address not in self._clients:
            from hotloop.clients import TrainerClient

            self._clients[address] = TrainerClient(address, self._token)
        return await self._clients[address].fetch_adapter(version, timeout_s, tenant=tenant)

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for c in clients.values():
            await c.close()


async def listen(lineages: "Lineages", bus) -> None:
    """Wake `lineages` on every `WeightsUpdated` of any lineage on `bus` (the default subject
    and one wildcard over every tenant's) and each time its connection comes back. Call
    before the first `start`: no announcement then falls between the subscription and the
    first read of the KV."""
    from hotloop.bus import WEIGHTS_TENANTS, WEIGHTS_UPDATED
    from hotloop.proto.v1 import bus_pb2
    async def on_default(msg, headers) -> None:
        lineages.announced(DEFAULT, version_from_proto(msg.info), msg.fetch_from)

    async def on_tenant(msg, headers) -> None:
        try:
            tenant = TenantId(msg.tenant)
        except InvalidTenant as e:
            log.warning("ignoring an announcement on a tenant's subject: %s", e)
            return
        if tenant.is_default:  # the default lineage is announced on its own subject only
            log.warning("ignoring an announcement without a tenant on a tenant's subject")
            return
        lineages.announced(tenant, version_from_proto(msg.info), msg.fetch_from)

    await bus.subscribe(WEIGHTS_UPDATED, bus_pb2.WeightsUpdated, on_default)
    await bus.subscribe(WEIGHTS_TENANTS, bus_pb2.WeightsUpdated, on_tenant)
    bus.on_reconnect(lineages.wake)


def lineage_name(tenant: TenantId) -> str:
    return f"tenant {tenant!r}" if tenant else "the default lineage"


class CatchUp:
    """Catch-up of one lineage (`tenant`, "" the default)."""

    def __init__(self, replica: Replica, read_latest: Callable[[], Awaitable[Version | None]],
                 fetch: Fetch, trainer: str | Sequence[str] = "", *, tenant: TenantId = DEFAULT,
                 read_recorded: Callable[[Version], Awaitable[str]] | None = None,
                 poll_s: float = 30.0, retry_max_s: float = 30.0):
        """`trainer`: the configured FetchAdapter address(es), asked first, in order ("" for
        none). `read_recorded`: the address the KV recorded with a version (`bus_recorded`),
        read only when the replica is behind."""
        self.replica = replica
        self.tenant = tenant
        self._read_latest = read_latest
        self._read_recorded = read_recorded
        self._fetch = fetch
        self._trainers = [trainer] if isinstance(trainer, str) else list(trainer)
        self._announced_from = ""
        self._recorded_from = ""  # what the KV recorded with the latest version
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
    def held(self) -> int:
        """The latest version the replica holds of this lineage."""
        return self.replica.latest_of(self.tenant)

    @property
    def known_latest(self) -> int:
        """The newest version known to be announced, or what the replica holds if newer."""
        return max(self._known.version if self._known else 0, self.held)

    @property
    def behind(self) -> bool:
        return self.known_latest > self.held

    def sources(self) -> list[str]:
        """Trainer addresses to fetch from: the configured ones, the last announcement's, the
        one the KV recorded."""
        return list(dict.fromkeys(
            a for a in (*self._trainers, self._announced_from, self._recorded_from) if a))

    def _note(self, v: Version) -> None:
        if self._known is None or v.version > self._known.version:
            self._known = v
            self.replica.announced(self.tenant, v.version)

    def announced(self, info: Version, fetch_from: str) -> None:
        """A `WeightsUpdated` arrived: remember it and where it can be fetched, and look now
        if it is news. An announcement of what the replica holds already (the push reached
        it first, or the KV read at start did) wakes nothing: only a reconnect or the poll
        then looks at the KV again."""
        self._note(info)
        if fetch_from:
            self._announced_from = fetch_from
        if info.version > self.held:
            self._wake.set()

    def wake(self) -> None:
        """Look now (the bus connection came back, or the lineage was just found)."""
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
        if target is None or target.version <= self.held:
            self.error = why_not if target is None else ""  # unread, or nothing to fetch
            return not self.error
        if self._read_recorded is not None:  # behind: where its trainer said to fetch it
            try:
                self._recorded_from = await asyncio.wait_for(self._read_recorded(target), timeout_s)
            except (Unavailable, TimeoutError):
                self._recorded_from = ""
        sources = self.sources()
        if not sources:
            where = ("[tenants.<name>] trainer and [endpoints] trainer are unset"
                     if self.tenant else "[endpoints] trainer is unset")
            self.error = (f"v{target.version} is announced but no trainer address is known "
                          f"({where}, no announcement was heard and the KV recorded none)")
            return False
        errors = [why_not] if why_not else []
        for address in sources:
            try:
                await self._load_from(address, target, timeout_s)
            except FailedPrecondition as e:
                if self.held >= target.version:  # a push got there first
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
        info, chunks = await self._fetch(address, target.version, timeout_s, self.tenant)
        try:
            if (info.version, info.sha256) != (target.version, target.sha256):
                # The core checks the bytes against the header it is given: give it the
                # announced one, and refuse a store whose record differs from what was announced.
                raise FailedPrecondition(
                    f"its v{info.version} has sha256 {info.sha256[:12]}, the announced "
                    f"v{target.version} has {target.sha256[:12]}")
            await self.replica.push(target, chunks, make_latest=True, tenant=self.tenant)
        finally:
            await chunks.aclose()
        log.info("%s: caught up to v%d (sha %s) from the trainer at %s",
                 lineage_name(self.tenant), target.version, target.sha256[:12], address)

    # ---- when to look ------------------------------------------------------------------
    async def start(self, timeout_s: float) -> bool:
        """At start-up, before serving: reach the newest announced version within `timeout_s`.
        False when the replica starts behind: the bound ran out, or no trainer address is
        known (waiting could not help); `follow` goes on trying."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = FIRST_RETRY_S
        name = lineage_name(self.tenant)
        while True:
            left = deadline - loop.time()
            if await self.sync(max(0.1, min(left, FETCH_TIMEOUT_S))):
                return True
            left = deadline - loop.time()
            if not self.sources() or left <= 0:
                if self.behind:
                    log.warning("%s: starting on v%d, behind the announced v%d (%s); catching up "
                                "in the background", name, self.held, self.known_latest, self.error)
                else:
                    log.warning("%s: starting on v%d without knowing the latest version (%s); "
                                "checking in the background", name, self.held, self.error)
                return False
            wait = min(delay, left)
            log.warning("%s: catch-up to v%d failed (%s); retrying in %.1f s", name,
                        self.known_latest, self.error, wait)
            await self._sleep(wait)
            delay = min(2 * delay, self._retry_max_s)

    async def follow(self) -> None:
        """After `start`, forever: look on every announcement, reconnect and `poll_s`; retry
        a failure with a doubling wait up to `retry_max_s`."""
        delay = FIRST_RETRY_S
        wait = delay if self.error else self._poll_s
        while True:
            raise_if_cancelled()  # a fetch that swallowed the stop's cancel (hotloop.aio)
            await self._sleep(wait)
            if await self.sync():
                delay, wait = FIRST_RETRY_S, self._poll_s
                continue
            wait = delay
            delay = min(2 * delay, self._retry_max_s)
            log.warning("%s: catch-up: serving v%d, behind the announced v%d (%s); retrying in "
                        "%.1f s", lineage_name(self.tenant), self.held, self.known_latest,
                        self.error, wait)

    async def _sleep(self, seconds: float) -> None:
        """Sleep up to `seconds`; an announcement or a reconnect ends it early."""
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            pass
        self._wake.clear()


class Lineages:
    """Catch-up of every lineage the mesh announced: the default one and each tenant's, one
    `CatchUp` each, made by `make(tenant)` when the lineage is first found."""

    def __init__(self, make: Callable[[TenantId], CatchUp],
                 list_tenants: Callable[[], Awaitable[list[TenantId]]], *, poll_s: float = 30.0,
                 retry_max_s: float = 30.0):
        """`list_tenants`: the tenants whose lineage the mesh announced (`bus_tenants`). A
        listing that fails is retried with a doubling wait up to `retry_max_s` (and `poll_s`)."""
        self._make = make
        self._list = list_tenants
        self._poll_s = poll_s
        self._retry_max_s = retry_max_s
        self.default = make(DEFAULT)
        self._lineages: dict[TenantId, CatchUp] = {DEFAULT: self.default}
        self._group: asyncio.TaskGroup | None = None
        self._wake = asyncio.Event()
        self.error = ""
        """Why the last listing of the announced lineages failed; empty when it did not."""

    # ---- what is known -----------------------------------------------------------------
    def __getitem__(self, tenant: TenantId) -> CatchUp:
        return self._lineages[tenant]

    def __contains__(self, tenant: TenantId) -> bool:
        return tenant in self._lineages

    def tenants(self) -> list[TenantId]:
        """The tenants whose lineage is known (the default one not included)."""
        return sorted(t for t in self._lineages if t)

    @property
    def behind(self) -> bool:
        return any(c.behind for c in self._lineages.values())

    def _lineage(self, tenant: TenantId) -> CatchUp:
        c = self._lineages.get(tenant)
        if c is None:
            c = self._lineages[tenant] = self._make(tenant)
            c.wake()  # its first look is due now
            log.info("%s found: catching up its lineage", lineage_name(tenant))
            if self._group is not None:  # following: it is followed from now on
                self._group.create_task(c.follow(), name=f"catch-up {tenant}")
        return c

    def announced(self, tenant: TenantId, info: Version, fetch_from: str) -> None:
        """A `WeightsUpdated` of `tenant`'s lineage arrived (a new tenant's too)."""
        self._lineage(tenant).announced(info, fetch_from)

    def wake(self) -> None:
        """Look at every lineage, and list them again, now (the bus connection came back)."""
        self._wake.set()
        for c in self._lineages.values():
            c.wake()

    async def discover(self, timeout_s: float = FETCH_TIMEOUT_S) -> bool:
        """List the announced lineages once; a new one gets its `CatchUp`. False (and `error`
        says why) when the bus did not answer within `timeout_s`."""
        try:
            names = await asyncio.wait_for(self._list(), timeout_s)
        except (Unavailable, TimeoutError) as e:
            self.error = f"listing the announced lineages: {str(e) or 'timed out'}"
            return False
        for tenant in names:
            self._lineage(tenant)
        self.error = ""
        return True

    # ---- when to look ------------------------------------------------------------------
    async def start(self, timeout_s: float) -> bool:
        """At start-up, before serving: find the announced lineages and reach each one's
        newest version, all at once, within `timeout_s` together. True when every lineage
        is current."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        listed = await self.discover(max(0.1, timeout_s))
        if not listed:
            log.warning("starting without the list of tenants' lineages (%s); listing again in "
                        "the background", self.error)
        left = max(0.0, deadline - loop.time())
        done = await asyncio.gather(*(c.start(left) for c in list(self._lineages.values())))
        return listed and all(done)

    async def follow(self) -> None:
        """After `start`, forever: follow each lineage (`CatchUp.follow`), and list the
        lineages again every `poll_s` and on each reconnect. Raises (ending every lineage's
        loop) if one of them fails."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            try:
                for tenant, c in list(self._lineages.items()):
                    group.create_task(c.follow(), name=f"catch-up {tenant}")
                delay, wait = FIRST_RETRY_S, self._poll_s
                while True:
                    raise_if_cancelled()  # a listing that swallowed the stop's cancel (hotloop.aio)
                    try:
                        await asyncio.wait_for(self._wake.wait(), wait)
                    except TimeoutError:
                        pass
                    self._wake.clear()
                    if await self.discover():
                        delay, wait = FIRST_RETRY_S, self._poll_s
                        continue
                    # a failed listing (the bus still coming back, say) is retried sooner
                    wait, delay = min(delay, self._poll_s), min(2 * delay, self._retry_max_s)
                    log.warning("catch-up: %s; listing again in %.1f s", self.error, wait)
            finally:
                self._group = None

    def metric_families(self):
        """Prometheus families read when scraped (`hotloop.metrics.StateCollector`), one
        sample per lineage (label `tenant`, "" the default)."""
        lineages = sorted(list(self._lineages.items()))  # a copy: the loop may add one
        yield gauge("hotloop_rollout_known_latest_version",
                    "The newest version of each lineage this replica knows the mesh announced.",
                    labels=["tenant"], samples=[([t], c.known_latest) for t, c in lineages])
        yield gauge("hotloop_rollout_behind",
                    "1 while the replica serves a lineage an older version than was announced.",
                    labels=["tenant"], samples=[([t], int(c.behind)) for t, c in lineages])
        yield counter("hotloop_rollout_catchup_fetches_total",
                      "Versions catch-up fetched from a trainer, by lineage and result (loaded, "
                      "failed).", labels=["tenant", "result"],
                      samples=[s for t, c in lineages
                               for s in (([t, "loaded"], c.loaded), ([t, "failed"], c.failed))])
