"""Tenants: who a user belongs to, and the names that scope a tenant's data.

A tenant is a set of users (API key ids, `[tenants.<name>] keys`) with an adapter lineage of
its own: its users are served by its newest version, and their traffic and feedback carry its
name, so that only the tenant's own trainer learns from them. The default tenant is "": every
key id in no tenant, and the lineage hotloop had before tenants existed.

Tenants come from two places: `[tenants.<name>]` in config ("config" tenants, fixed for the
life of a process) and the registry ("api" tenants, created and deleted at run time through the
gateway's admin API). The registry is a JetStream KV bucket (`hotloop.bus.TENANTS_BUCKET`)
shared by every gateway replica and the trainer; see `Registry` for what a watcher of it sees.

Owns: a tenant's name (`TenantId`: the one rule a name follows, checked where a name comes in,
carried as the type inside; it becomes a NATS subject token and a directory name), the
map from a key id to its tenant (`Directory`: config tenants, plus registry tenants that the
gateway puts in and takes out), and the registry's records (`TenantRecord`, `Registry`).
Does not own: keys and their secrets (the gateway's `keys.py` mints them; a record holds only
their sha256), subjects (`hotloop.bus.feedback_subject`), adapters and lineages (the trainer),
or who may do what (the gateway's admin API).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from hotloop.aio import raise_if_cancelled
from hotloop.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable

if TYPE_CHECKING:
    from hotloop.bus import Bus

log = logging.getLogger(__name__)

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


class InvalidTenant(InvalidArgument, ValueError):
    """A string that cannot name a tenant. An `InvalidArgument` (a 400 at the HTTP edge,
    INVALID_ARGUMENT at a gRPC one) and a `ValueError` (a config field's validation error)."""


class TenantId(str):
    """A tenant's name, checked: 1-32 of [a-z0-9_-], starting with a letter or a digit, or ""
    for the default tenant. The only place the rule lives.

    A `str` (subjects, dict keys, JSON and protos take it as it is), built only through the
    check: `TenantId(name)` (or `TenantId.parse(name)`) raises `InvalidTenant` for anything
    else, and returns a `TenantId` unchanged, so that code holding one never checks again.
    Parse once where a name comes in (a config field typed `TenantId`, a URL path, a gRPC
    request, a bus message, a KV key), then carry the type.

    The rule exists because a name becomes a NATS subject token (no '.', '*', '>', spaces),
    a directory name (no '/', no leading '-' or '.'), a Prometheus label and a key id prefix.
    """

    __slots__ = ()

    def __new__(cls, name: str = "") -> "TenantId":
        if type(name) is cls:
            return name
        if not isinstance(name, str):
            raise InvalidTenant(f"a tenant name is a string, not {type(name).__name__}")
        # fullmatch: `match` with `$` would also take a trailing newline ("acme\n")
        if name and not _NAME.fullmatch(name):
            raise InvalidTenant(f"tenant name {name!r} must be 1-32 of [a-z0-9_-], starting "
                                "with a letter or a digit")
        return super().__new__(cls, name)

    @classmethod
    def parse(cls, name: str) -> "TenantId":
        """`name` as a `TenantId`; `InvalidTenant` if it cannot name a tenant."""
        return cls(name)

    @property
    def is_default(self) -> bool:
        """The default tenant (""): users in no `[tenants.<name>]`, the unnamed lineage."""
        return not self

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(
            cls, core_schema.str_schema(strict=True),
            serialization=core_schema.plain_serializer_function_ser_schema(str))


DEFAULT = TenantId("")
"""The default tenant: users in no `[tenants.<name>]`, and the lineage without a name."""


class Directory:
    """Key id -> tenant: the config tenants (`[tenants]`, a mapping of name -> an object with
    `keys`), fixed, and the registry tenants their owner (the gateway) `put`s and `drop`s as
    the registry changes. Reads and writes happen on one event loop."""

    def __init__(self, tenants: Mapping[str, object]):
        self._by_key: dict[str, TenantId] = {}
        tenants = {TenantId(name): tenant for name, tenant in tenants.items()}
        for name, tenant in tenants.items():
            keys: Sequence[str] = getattr(tenant, "keys")
            for key in keys:
                if key in self._by_key:
                    raise ValueError(f"key id {key!r} is in tenants {self._by_key[key]!r} and {name!r}")
                self._by_key[key] = name
        self.config: dict[TenantId, list[str]] = {
            name: list(getattr(tenant, "keys")) for name, tenant in tenants.items()}
        """The config tenants and their key ids."""
        self._registry: dict[TenantId, list[str]] = {}

    @property
    def names(self) -> list[TenantId]:
        """Every tenant's name, config and registry, sorted."""
        return sorted({*self.config, *self._registry})

    def tenant_of(self, key_id: str) -> TenantId:
        """The tenant of a key id (the default tenant, "", for one in no tenant)."""
        return self._by_key.get(key_id, DEFAULT)

    def key_ids(self, name: TenantId | None = None) -> set[str]:
        """Every key id some tenant names (`name`: that tenant's)."""
        if name is None:
            return set(self._by_key)
        return {k for k, t in self._by_key.items() if t == name}

    def put(self, name: TenantId, key_ids: Iterable[str]) -> None:
        """Make `key_ids` the registry tenant `name`'s (replacing what it had). ValueError for
        a config tenant's name or a key id another tenant has: nothing is changed then."""
        name = TenantId(name)
        if name.is_default or name in self.config:
            raise ValueError(f"tenant {name!r} is declared in config; the registry cannot change it")
        ids = list(key_ids)
        taken = sorted(k for k in ids if self._by_key.get(k, name) != name)
        if taken:
            raise ValueError(f"key id(s) {taken} of tenant {name!r} belong to another tenant")
        self.drop(name)
        self._registry[name] = ids
        for k in ids:
            self._by_key[k] = name

    def drop(self, name: TenantId) -> None:
        """Forget the registry tenant `name` and its key ids (nothing if it is unknown)."""
        for k in self._registry.pop(name, []):
            if self._by_key.get(k) == name:
                del self._by_key[k]


# ---- the registry ------------------------------------------------------------------------
MAX_CAS_TRIES = 16
"""Read-modify-write attempts before a record that keeps changing underneath gives up."""


@dataclass(frozen=True)
class TenantKey:
    id: str
    sha256: str
    """Hex sha256 of the key: enough to check a presented key, useless to present one."""
    created_at: float = 0.0


@dataclass(frozen=True)
class TenantRecord:
    """A registry entry: the value of the tenant's name in the registry's KV bucket."""

    name: TenantId
    keys: tuple[TenantKey, ...] = ()
    generation: int = 0
    """0 at creation; each reset adds 1. The trainer resets the lane when this exceeds the
    generation it last applied (see `Registry`)."""
    created_at: float = field(default_factory=time.time)
    config: bool = False
    """A config tenant (`[tenants.<name>]`) that was reset or held: the record carries its
    generation and `held` only; its keys and its existence come from config."""
    held: bool = False
    """Learning held (`Registry.hold`): the trainer takes no more updates for the lineage, so
    its users go on being served the version it holds, until it is resumed."""
    revision: int = 0
    """The KV revision this record was read or written at (not stored in the value): higher
    is newer, for every name of the bucket alike."""
    reset_to: int = 0
    """What the latest reset went back to: 0 the base model, N the lineage's version N (its
    adapter published again as the next version; training goes on from it)."""

    def key_ids(self) -> list[str]:
        return [k.id for k in self.keys]

    def to_bytes(self) -> bytes:
        from hotloop.proto.v1 import bus_pb2

        return bus_pb2.TenantRecord(
            name=self.name, generation=self.generation, created_at=self.created_at,
            config=self.config, held=self.held, reset_to=self.reset_to,
            keys=[bus_pb2.TenantKey(id=k.id, sha256=k.sha256, created_at=k.created_at)
                  for k in self.keys],
        ).SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes, revision: int = 0) -> "TenantRecord":
        from hotloop.proto.v1 import bus_pb2

        p = bus_pb2.TenantRecord.FromString(data)
        return cls(TenantId(p.name), tuple(TenantKey(k.id, k.sha256, k.created_at) for k in p.keys),
                   p.generation, p.created_at, p.config, held=p.held, revision=revision,
                   reset_to=p.reset_to)


def _digest_hex(sha256: str) -> str:
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise InvalidArgument("a key's digest must be 64 lower-case hex digits (its sha256)")
    return sha256


class Registry:
    """The tenant registry: created tenants, their key ids and key digests, and their
    generation and whether its learning is held, in a JetStream KV bucket that every gateway
    replica and the trainer share.

    Writes are compare-and-set on the KV revision: `create` succeeds only where the name holds
    no record (two gateway replicas creating one name at once: exactly one wins, the other gets
    `AlreadyExists`), and `add_key`, `reset`, `hold` and `delete` rewrite the revision they
    read (a concurrent change makes them read again and retry, up to `MAX_CAS_TRIES`). A
    missing name is `NotFound`; the bus being away past its outage bound is `Unavailable`.

    What `watch()` yields, for the trainer (`async for name, record in registry.watch()`):

    - first, the current state of every name the bucket has held, one `(name, record)` each,
      or `(name, None)` for a name that was deleted (its tombstone), in KV revision order;
      `ready` (if given) is set once these are out (at once for an empty bucket). This replay
      is a state, not events: a watcher that restarts sees it again.
    - then every change, in the order it was committed:
      - create: `(name, record)` with `record.generation == 0` for a name the watcher has
        no lane for (a name deleted and created again comes as a create: a new tenant);
      - a key added: `(name, record)` with the same generation as before (nothing for the
        trainer to do);
      - hold or resume: `(name, record)` with the same generation and `record.held` the new
        state; the lane takes no update while held (the version in flight still lands);
      - reset: `(name, record)` with `record.generation` one more than before; the lane
        starts over from the base model and publishes a fresh adapter as its next version;
      - delete: `(name, None)`; the tenant is gone for good (a later create of the name is
        another tenant).
    - `record.config` is True for a config tenant (`[tenants.<name>]`) that was reset or held:
      the record carries the generation and `held` only. It is never deleted through the API.

    So a trainer keeps, per lane, the generation it last applied (durably, e.g. in its
    checkpoint; 0 for a lane it starts) and does:

        async for name, record in registry.watch():
            if record is None:
                remove_tenant(name)                    # unknown name: nothing to do
            elif name not in lanes:
                add_tenant(name); applied[name] = record.generation
            elif record.generation > applied[name]:
                reset_tenant(name); applied[name] = record.generation
            hold_tenant(name, record.held)             # idempotent: the state, not a change

    A removed lane's lineage (its versions-KV key `hotloop.bus.latest_key(name)`, its
    store) is the trainer's to delete once the lane has stopped: until `latest_key(name)` is
    gone, the gateway refuses to create the name again, so a new tenant does not start on a
    deleted one's announced version.

    The iterator ends only when the caller stops iterating (`aclose()`): it rides out bus
    outages (JetStream's ordered consumer resumes after the last revision it delivered).
    """

    def __init__(self, bus: "Bus"):
        self.bus = bus

    async def _kv(self):
        return await self.bus.tenants_kv()

    async def _entry(self, name: TenantId) -> TenantRecord | None:
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        kv = await self._kv()
        try:
            entry = await self.bus.retrying(lambda: kv.get(name), f"tenant {name} lookup")
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return TenantRecord.from_bytes(entry.value, entry.revision)

    async def get(self, name: TenantId) -> TenantRecord | None:
        """The record of `name`, or None."""
        return await self._entry(TenantId(name))

    async def list(self) -> list[TenantRecord]:
        """Every record, by name."""
        from hotloop.bus import TENANTS_BUCKET

        entries = await self.bus.entries(await self._kv(), TENANTS_BUCKET)
        out = []
        for key, e in entries.items():
            try:
                out.append(TenantRecord.from_bytes(e.value, e.revision))
            except InvalidTenant as err:  # a foreign record: say so, list the others
                log.warning("tenant registry: the record under %r names no tenant: %s", key, err)
        return out

    async def create(self, name: TenantId, keys: Sequence[TenantKey] = (), *, config: bool = False,
                     generation: int = 0, held: bool = False, reset_to: int = 0) -> TenantRecord:
        """A new record for `name`; `AlreadyExists` if it has one."""
        from nats.js.errors import KeyWrongLastSequenceError

        if TenantId(name).is_default:
            raise InvalidArgument("the default tenant cannot be created")
        for k in keys:
            _digest_hex(k.sha256)
        record = TenantRecord(TenantId(name), tuple(keys), generation, time.time(), config, held,
                              reset_to=reset_to)
        kv, data = await self._kv(), record.to_bytes()
        try:
            revision = await self.bus.retrying(lambda: kv.create(name, data), f"tenant {name} create")
        except KeyWrongLastSequenceError:
            current = await self._entry(name)
            if current is not None and current.to_bytes() == data:  # ours: a retry after a lost answer
                return current
            raise AlreadyExists(f"tenant {name!r} exists already") from None
        return replace(record, revision=revision)

    async def _rewrite(self, name: TenantId, change: Callable[[TenantRecord], TenantRecord]
                       ) -> TenantRecord:
        from nats.js.errors import KeyWrongLastSequenceError

        name = TenantId(name)
        kv = await self._kv()
        for _ in range(MAX_CAS_TRIES):
            current = await self._entry(name)
            if current is None:
                raise NotFound(f"no tenant {name!r}")
            new = change(current)
            if new == current:
                return current
            data = new.to_bytes()
            try:
                revision = await self.bus.retrying(
                    lambda: kv.update(name, data, last=current.revision), f"tenant {name} update")
            except KeyWrongLastSequenceError:
                continue  # changed since we read it: read again
            return replace(new, revision=revision)
        raise Unavailable(f"tenant {name!r} kept changing during {MAX_CAS_TRIES} attempts to update it")

    async def add_key(self, name: TenantId, key: TenantKey) -> TenantRecord:
        """Add a key (id and digest) to `name`'s record. `AlreadyExists` for a key id it has."""
        _digest_hex(key.sha256)

        def add(r: TenantRecord) -> TenantRecord:
            if key in r.keys:
                return r  # ours, landed already (a write retried after its answer was lost)
            if key.id in r.key_ids():
                raise AlreadyExists(f"tenant {name!r} has a key {key.id!r} already")
            return replace(r, keys=(*r.keys, key))

        return await self._rewrite(name, add)

    async def reset(self, name: TenantId, *, config: bool = False, to_version: int = 0) -> TenantRecord:
        """Add 1 to `name`'s generation (a write retried across a bus outage may add 2: a
        watcher resets once either way), going back to `to_version` (0: the base model; N: the
        lineage's version N). `config`: `name` is a config tenant, whose record is created (at
        generation 1) by its first reset."""
        if to_version < 0:
            raise InvalidArgument(f"a reset goes back to a version >= 0, not {to_version}")
        if config:
            try:
                return await self.create(name, config=True, generation=1, reset_to=to_version)
            except AlreadyExists:
                pass  # reset before: bump it below
        return await self._rewrite(name, lambda r: replace(r, generation=r.generation + 1,
                                                              reset_to=to_version))

    async def hold(self, name: TenantId, held: bool = True, *, config: bool = False) -> TenantRecord:
        """Hold `name`'s learning (`held`), or resume it. `config`: `name` is a config tenant,
        whose record is created (at generation 0) by its first hold."""
        if config:
            try:
                return await self.create(name, config=True, held=held)
            except AlreadyExists:
                pass  # reset or held before: rewrite it below
        return await self._rewrite(name, lambda r: replace(r, held=held))

    async def delete(self, name: TenantId) -> TenantRecord:
        """Delete `name`'s record; returns what it was (its `revision` the one deleted)."""
        from nats.js.errors import APIError

        name = TenantId(name)
        kv = await self._kv()
        for _ in range(MAX_CAS_TRIES):
            current = await self._entry(name)
            if current is None:
                raise NotFound(f"no tenant {name!r}")
            try:
                await self.bus.retrying(lambda: kv.delete(name, last=current.revision),
                                        f"tenant {name} delete")
            except APIError as e:
                if e.err_code in (10071, 10164):  # wrong last sequence: changed since read
                    continue
                raise
            return current
        raise Unavailable(f"tenant {name!r} kept changing during {MAX_CAS_TRIES} attempts to delete it")

    async def changes(self, ready: asyncio.Event | None = None
                      ) -> AsyncIterator[tuple[TenantId, TenantRecord | None, int]]:
        """`watch()` with each change's KV revision: (name, record or None, revision)."""
        from google.protobuf.message import DecodeError
        import nats

        from hotloop.bus import TENANTS_BUCKET

        kv = await self._kv()
        ready = ready if ready is not None else asyncio.Event()
        end = await self.bus.replay_end(TENANTS_BUCKET)  # read before the watch starts
        watcher = await self.bus.retrying(kv.watchall, "tenant watch")
        if not end:
            ready.set()  # an empty bucket: nothing to replay
        try:
            async for entry in watcher:
                raise_if_cancelled()  # nats-py's watcher reads with wait_for (hotloop.aio)
                if entry is None:  # nats-py's end marker races the delivery: `end` says it
                    continue
                try:
                    name = TenantId(entry.key)
                except InvalidTenant as e:  # a foreign key: say so, skip it
                    log.warning("tenant registry: a key that names no tenant: %s", e)
                    name = None
                if name is None:
                    pass
                elif entry.operation in ("DEL", "PURGE"):
                    yield name, None, entry.revision
                else:
                    try:
                        record = TenantRecord.from_bytes(entry.value, entry.revision)
                    except (DecodeError, InvalidTenant) as e:  # a foreign value: say so, skip it
                        log.warning("tenant registry: undecodable record for %r: %s", name, e)
                    else:
                        yield name, record, entry.revision
                # resumed after the item was handled: the replay is out once its last one was
                if not ready.is_set() and (entry.revision >= end or entry.delta == 0):
                    ready.set()
        finally:
            try:
                await watcher.stop()
            except nats.errors.Error:  # the connection is closed or reconnecting
                pass

    async def watch(self, ready: asyncio.Event | None = None
                    ) -> AsyncIterator[tuple[TenantId, TenantRecord | None]]:
        """(name, record) per create, key added or reset; (name, None) per delete; after the
        current state of every name. See the class docstring."""
        async for name, record, _ in self.changes(ready):
            yield name, record
