"""One trainer per lineage: a lease in the bus's KV.

Two trainers that learn the same lineage (the same tenant named in two `[online] tenants`, or
two `hotloop train online` with one `[online] tenant`) would each publish versions 1, 2, ...
of their own adapter under one name, and the replicas would serve whichever came last. So a
trainer claims each lineage it learns before it restores or publishes anything
(`LineageLease.claim`), keeps the claim alive while it runs, and gives it up when it stops.

- The claim is a key of `LEASES_BUCKET` (`lease_key`) whose value names its holder
  (`Holder`: host, run directory, pid, since). The bucket's entries expire `LEASE_TTL_S`
  after their last write, so a holder that died without giving the lease up (kill -9, a
  host gone) frees it within that time; a live one renews it every `RENEW_S`.
- A claim by the same holder (the same host and run directory: the trainer restarted after
  a crash, before its old lease expired) takes the lease over at once.
- A claim by another holder waits while the lease may still expire, and is refused
  (`LineageTaken`, naming the holder) as soon as the holder is seen to renew it: it is alive.
- A holder whose renewal finds the lease gone (the bus was away longer than the lease lasts)
  claims it again; one that finds another holder has it marks the lease lost, and `check`
  (called before each publish) raises.

Does not own: which trainer learns which tenants (config: `[online] tenant` / `tenants`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass

from hotloop.aio import raise_if_cancelled
from hotloop.bus import Bus, BusError
from hotloop.tenants import TenantId

log = logging.getLogger(__name__)

LEASES_BUCKET = "hotloop-lineage-leases"
LEASE_TTL_S = 30.0
"""A lease not renewed for this long expires (the bucket's `ttl`, fixed when it is created)."""
RENEW_S = 10.0
"""How often a holder renews its leases (a third of `LEASE_TTL_S`: two renewals may fail)."""
POLL_S = 1.0
"""How often a waiting claim looks at the lease again."""


class LineageTaken(BusError):
    """Another live trainer learns this lineage."""


def lease_key(tenant: TenantId) -> str:
    """The lease's key: `default` for the default lineage, `tenant.<name>` for a tenant's."""
    return "default" if TenantId(tenant).is_default else f"tenant.{tenant}"


@dataclass(frozen=True)
class Holder:
    """Who holds a lease. `owner` (host and run directory) is the identity: a restart of the
    same run is the same holder."""

    host: str
    run_dir: str
    pid: int
    since: float

    @classmethod
    def here(cls, run_dir: str) -> Holder:
        return cls(socket.gethostname(), str(run_dir), os.getpid(), time.time())

    @property
    def owner(self) -> str:
        return f"{self.host}:{self.run_dir}"

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Holder | None:
        try:
            d = json.loads(data)
            return cls(str(d["host"]), str(d["run_dir"]), int(d["pid"]), float(d["since"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, run directory {self.run_dir}"


async def leases_kv(bus: Bus, ttl_s: float = LEASE_TTL_S):
    """The leases' KV bucket (created with `ttl_s` if it does not exist yet)."""
    return await bus.bucket(LEASES_BUCKET, history=1, ttl_s=ttl_s)


class LineageLease:
    """A held lease: renewed in the background until `release`."""

    def __init__(self, bus: Bus, tenant: TenantId, holder: Holder, revision: int, renew_s: float) -> None:
        self.bus, self.tenant, self.holder, self.revision = bus, tenant, holder, revision
        self.lost: str = ""  # why the lease is no longer this holder's ("" while it is)
        self._task = asyncio.create_task(self._renewing(renew_s), name=f"lease {lease_key(tenant)}")

    @classmethod
    async def claim(cls, bus: Bus, tenant: TenantId, holder: Holder, *, ttl_s: float = LEASE_TTL_S,
                    renew_s: float = RENEW_S, poll_s: float = POLL_S) -> LineageLease:
        """Hold `tenant`'s lineage, waiting while another holder's lease may expire (at most
        twice `ttl_s`: the server expires entries on a timer); `LineageTaken` once that holder
        is seen alive (its lease's revision moved), or at that bound."""
        revision = await _acquire(bus, tenant, holder, ttl_s, poll_s)
        log.info("lineage %r: lease held (%s)", tenant or "default", holder.describe())
        return cls(bus, tenant, holder, revision, renew_s)

    def check(self) -> None:
        """Raise `LineageTaken` if another trainer took the lineage over."""
        if self.lost:
            raise LineageTaken(self.lost)

    async def _renewing(self, every_s: float) -> None:
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        key = lease_key(self.tenant)
        while True:
            # `release` cancels this task; a nats-py request whose answer lands on the same
            # loop iteration swallows the cancellation (hotloop.aio), and the loop renewed on
            # while `release` waited for it: CI saw a test wait 600 s there
            raise_if_cancelled()
            await asyncio.sleep(every_s)
            kv = await leases_kv(self.bus)
            try:
                self.revision = await self.bus.retrying(
                    lambda: kv.update(key, self.holder.encode(), last=self.revision), f"renew lease {key}")
                continue
            except (KeyWrongLastSequenceError, KeyNotFoundError):
                pass
            except Exception as e:  # the bus away past its patience: try again next time
                log.warning("lineage %r: lease renewal failed (%r)", self.tenant or "default", e)
                continue
            try:  # expired while the bus was away, or taken: claim it again, without waiting
                self.revision = await _acquire(self.bus, self.tenant, self.holder, 0.0, 0.0)
            except LineageTaken as e:
                self.lost = f"{e}; this trainer held it until its lease lapsed"
                log.error("lineage %r: %s", self.tenant or "default", self.lost)
                return
            except Exception as e:
                log.warning("lineage %r: lease renewal failed (%r)", self.tenant or "default", e)

    async def release(self) -> None:
        """Stop renewing and give the lease up (if it is still this holder's)."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        if self.lost:
            return
        key = lease_key(self.tenant)
        with contextlib.suppress(Exception):  # the bus gone: the lease expires by itself
            kv = await leases_kv(self.bus)
            await self.bus.retrying(lambda: kv.delete(key, last=self.revision), f"release lease {key}",
                                    patience_s=2.0)


async def _acquire(bus: Bus, tenant: TenantId, holder: Holder, ttl_s: float, poll_s: float) -> int:
    from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

    key, kv = lease_key(tenant), await leases_kv(bus, ttl_s or LEASE_TTL_S)
    deadline = time.monotonic() + 2 * ttl_s + 2 * poll_s  # the server expires entries on a timer
    seen: int | None = None
    while True:
        try:
            return await bus.retrying(lambda: kv.create(key, holder.encode()), f"claim lease {key}")
        except KeyWrongLastSequenceError:
            pass
        try:
            entry = await bus.retrying(lambda: kv.get(key), f"read lease {key}")
        except KeyNotFoundError:  # expired or released in between
            continue
        other = Holder.decode(entry.value or b"")
        if other is not None and other.owner == holder.owner:  # this run, restarted
            try:
                return await bus.retrying(lambda: kv.update(key, holder.encode(), last=entry.revision),
                                          f"take over lease {key}")
            except KeyWrongLastSequenceError:
                continue
        who = other.describe() if other is not None else "an unreadable holder"
        if (seen is not None and entry.revision != seen) or time.monotonic() >= deadline:
            raise LineageTaken(
                f"lineage {tenant or 'default'!r} is learned by another trainer ({who}): two "
                "trainers on one lineage would publish conflicting versions. List each tenant in "
                "one trainer's [online] tenant/tenants, or stop the other one")
        seen = entry.revision
        await asyncio.sleep(poll_s)
