"""The tenant admin API's operations, and this gateway's copy of the tenant registry.

Owns:
- who may use the admin API (`check_admin`: `Authorization: Bearer <[security] admin_token>`,
  compared in constant time; no admin token configured: every admin call is refused, 403);
- the operations behind the admin endpoints: create a tenant and mint its first key, mint
  another, list, get, reset (to the base model or to one of the lineage's own versions, which
  its trainer must hold), hold and resume, delete (`hotloop.tenants.Registry` holds the
  records; a key's secret is returned once and only its sha256 is stored), and export a
  tenant's latest version (`export`: read the lineage's `latest_key` in the versions KV,
  stream the archive from the trainer with `TrainerClient.fetch_adapter`, check size and
  sha256 against the KV before any byte goes out);
- keeping this replica's `KeyRing` and `Directory` in step with the registry (`start` replays
  it before the gateway serves, then a task follows its watch): a key minted on one replica
  works on another within the watch's delivery time, and a deleted tenant's keys stop at once
  on the replica that deleted it and on the others as soon as the delete is delivered. A
  change this replica made itself is applied at once, and the watch never re-applies an
  older revision of a name (so a delete is not undone by the create it follows).

Config tenants (`[tenants.<name>]`) are fixed: they work with no registry record at all and
cannot be created, deleted or given keys through the API (409, `Conflict`); a reset or hold
of one writes a record that carries only its generation and hold (`TenantRecord.config`).

Where the trainer is: the address of the last `WeightsUpdated` heard for the tenant's lineage
(`fetch_from`; a trainer announces its latest again when it starts), then `[endpoints]
trainer`. The versions KV holds the version, not the address.

Does not own: HTTP (http.py converts), the records' format and the watch protocol
(`hotloop.tenants`), training or publishing a lineage (the trainer).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import IO

from hotloop import bus as hbus
from hotloop.adapters import MAX_ARCHIVE_BYTES
from hotloop.aio import raise_if_cancelled
from hotloop.errors import (
    Conflict,
    HotloopError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from hotloop.proto.v1 import bus_pb2, common_pb2
from hotloop.tenants import (Directory, InvalidTenant, Registry, TenantId, TenantKey,
                             TenantRecord)

from .keys import KeyRing, digest_hex, mint

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 120.0
"""Bound on fetching one archive from the trainer."""
SPOOL_BYTES = 64 << 20
"""An archive up to this size is held in memory while it is checked; a larger one on disk."""
EXPORT_CHUNK = 1 << 20
WATCH_RETRY_S = 1.0


@dataclass
class Export:
    """A tenant's latest version, checked, ready to send: `file` holds the archive (a tar of
    adapter_config.json and adapter_model.safetensors), positioned at its start."""

    tenant: TenantId
    version: int
    sha256: str
    bytes: int
    file: IO[bytes]

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            while chunk := await asyncio.to_thread(self.file.read, EXPORT_CHUNK):
                yield chunk
        finally:
            self.file.close()


def _record_view(record: TenantRecord | None, name: TenantId, config_keys: list[str] | None,
                 latest: int) -> dict:
    held = record is not None and record.held
    if config_keys is not None:
        return {"name": name, "source": "config", "key_ids": list(config_keys),
                "generation": record.generation if record is not None else 0,
                "created_at": None, "latest_version": latest, "held": held}
    assert record is not None
    return {"name": name, "source": "api", "key_ids": record.key_ids(),
            "generation": record.generation, "created_at": record.created_at,
            "latest_version": latest, "held": held}


class TenantAdmin:
    def __init__(self, bus: hbus.Bus, keys: KeyRing, tenants: Directory, admin_token: str = "",
                 trainer: str = ""):
        """`keys` and `tenants`: the ones the gateway core authenticates and routes with (this
        object changes them as the registry changes). `admin_token`: `[security]
        admin_token` ("" refuses the admin API). `trainer`: `[endpoints] trainer`."""
        self.bus = bus
        self.registry = Registry(bus)
        self.keys, self.tenants = keys, tenants
        self.admin_token = admin_token
        self.trainer = trainer
        self.fetch_from: dict[TenantId, str] = {}
        """tenant -> the trainer address its lineage's last announcement named."""
        self._applied: dict[TenantId, int] = {}  # name -> the newest registry revision applied
        self._task: asyncio.Task | None = None
        self._sub = None

    # ---- following the registry ------------------------------------------------------
    async def start(self, timeout_s: float | None = None) -> None:
        """Replay the registry into the key ring and directory (returns once done, within
        `timeout_s`, default the bus's outage bound), then keep following it."""
        ready = asyncio.Event()
        self._task = asyncio.create_task(self._follow(ready))
        self._sub = await self.bus.subscribe(f"{hbus.WEIGHTS_UPDATED}.tenant.*",
                                             bus_pb2.WeightsUpdated, self._announced)
        waiter = asyncio.ensure_future(ready.wait())
        try:
            await asyncio.wait({waiter, self._task}, timeout=timeout_s or self.bus.outage_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not ready.is_set():
            await self.close()
            raise Unavailable("the tenant registry could not be read (NATS KV bucket "
                              f"{hbus.TENANTS_BUCKET})")

    async def _follow(self, ready: asyncio.Event) -> None:
        while True:
            raise_if_cancelled()  # a watch that swallowed the close's cancel (hotloop.aio)
            try:
                async for name, record, revision in self.registry.changes(ready):
                    self.apply(name, record, revision)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # retried on purpose: the gateway serves on meanwhile
                log.warning("tenant registry watch failed (%r); watching again in %gs", e, WATCH_RETRY_S)
                await asyncio.sleep(WATCH_RETRY_S)

    async def _announced(self, msg, headers) -> None:
        try:
            tenant = TenantId(msg.tenant)
        except InvalidTenant as e:
            log.warning("ignoring an announcement on a tenant's subject: %s", e)
            return
        if not tenant.is_default and msg.fetch_from:
            self.fetch_from[tenant] = msg.fetch_from

    def apply(self, name: TenantId, record: TenantRecord | None, revision: int) -> None:
        """Bring the key ring and directory to `record` (None: deleted) of `name`, unless a
        newer revision of it was applied already."""
        if revision <= self._applied.get(name, 0):
            return
        self._applied[name] = revision
        if name in self.tenants.config or (record is not None and record.config):
            if record is not None and not record.config:
                log.warning("tenant registry: %r is declared in config; its registry record "
                            "is ignored", name)
            return  # a config tenant's keys come from config
        if record is None:
            self.keys.drop(name)
            self.tenants.drop(name)
            return
        digests = {bytes.fromhex(k.sha256): k.id for k in record.keys}
        try:
            self.keys.put(name, digests)
            self.tenants.put(name, digests.values())
        except ValueError as e:  # a clash with a config key (id): refuse the record's keys
            log.warning("tenant registry: tenant %r left out: %s", name, e)
            self.keys.drop(name)
            self.tenants.drop(name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # the connection is already closed
                pass
            self._sub = None

    # ---- who may -----------------------------------------------------------------------
    def is_admin(self, authorization: str | None) -> bool:
        """Whether `authorization` is `Bearer <admin token>` (never, with no admin token)."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        return bool(self.admin_token) and scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.admin_token.encode())

    def check_admin(self, authorization: str | None) -> None:
        """Return if `authorization` is `Bearer <admin token>`; else Unauthenticated (no or a
        wrong token) or PermissionDenied (a user's API key; no admin token configured)."""
        if not self.admin_token:
            raise PermissionDenied("admin API disabled: set [security] admin_token")
        if self.is_admin(authorization):
            return
        try:
            self.keys.authenticate(authorization)
        except Unauthenticated:
            raise Unauthenticated("the admin API needs `Authorization: Bearer <admin token>`") from None
        raise PermissionDenied("a user API key cannot use the admin API")

    # ---- operations --------------------------------------------------------------------
    def _name(self, name: str) -> TenantId:
        """A name from a URL path or a body, parsed: `InvalidTenant` (a 400) if it names no
        tenant."""
        tenant = TenantId(name)
        if tenant.is_default:
            raise InvalidArgument("the default tenant has no name and no record")
        return tenant

    def _not_config(self, name: TenantId, what: str) -> None:
        if name in self.tenants.config:
            raise Conflict(f"tenant {name!r} is declared in config ([tenants.{name}]): {what} "
                           "it there, not through the API")

    async def _latest(self, name: TenantId) -> int:
        info = await self.bus.kv_get(hbus.latest_key(name), common_pb2.VersionInfo)
        return info.version if info is not None else 0

    def _new_key(self, name: TenantId) -> tuple[TenantKey, str]:
        while True:
            key_id, secret = mint(name)
            if key_id not in self.keys.ids():
                return TenantKey(key_id, digest_hex(secret), time.time()), secret

    async def create(self, name: str) -> dict:
        """Create tenant `name` with a first key; returns the key (shown this once)."""
        name = self._name(name)
        self._not_config(name, "change")
        held = await self._latest(name)
        if held:
            raise Conflict(f"the lineage of a deleted tenant {name!r} still holds version {held} "
                           "(the trainer removes it when it stops that lane): choose another "
                           "name, or retry once it is gone")
        key, secret = self._new_key(name)
        record = await self.registry.create(name, [key])
        self.apply(name, record, record.revision)
        return {"tenant": name, "key_id": key.id, "api_key": secret}

    async def add_key(self, name: str) -> dict:
        """Mint another key for registry tenant `name`."""
        name = self._name(name)
        self._not_config(name, "add keys to")
        key, secret = self._new_key(name)
        record = await self.registry.add_key(name, key)
        self.apply(name, record, record.revision)
        return {"tenant": name, "key_id": key.id, "api_key": secret}

    async def get(self, name: str) -> dict:
        name = self._name(name)
        record = await self.registry.get(name)
        config = self.tenants.config.get(name)
        if config is None and record is None:
            raise NotFound(f"no tenant {name!r}")
        return _record_view(record, name, config, await self._latest(name))

    async def list(self) -> list[dict]:
        records = {r.name: r for r in await self.registry.list()}
        out = []
        for name in sorted({*records, *self.tenants.config}):
            config = self.tenants.config.get(name)
            if config is None and records[name].config:
                continue  # a reset record of a tenant no longer in config
            out.append(_record_view(records.get(name), name, config, await self._latest(name)))
        return out

    async def reset(self, name: str, version: int = 0) -> dict:
        """Start the tenant's lineage over from the base model, or (`version` N) from its own
        version N: the trainer sees the generation go up, resets the lane and publishes that
        adapter (a fresh one for the base) as a new version, and training goes on from it. A
        version above the lineage's latest, or one its trainer does not hold, is refused here
        (InvalidArgument, NotFound), before anything is written."""
        name = self._name(name)
        if not await self.exists(name):
            raise NotFound(f"no tenant {name!r}")
        if version < 0:
            raise InvalidArgument(f"a reset goes back to a version >= 0, not {version}")
        if version:
            latest = await self._latest(name)
            if version > latest:
                raise InvalidArgument(f"tenant {name!r} has no version {version}: its latest "
                                      f"is {latest}")
            _, chunks = await self._fetch(name, version)  # it is stored: the trainer has it
            await chunks.aclose()
        record = await self.registry.reset(name, config=name in self.tenants.config,
                                           to_version=version)
        return {"tenant": name, "generation": record.generation, "to_version": version}

    async def hold(self, name: str, held: bool = True) -> dict:
        """Hold the tenant's learning (`held`), or resume it: the trainer that follows the
        registry takes no update of its lineage while held, so its users are served the
        version it held at (the update under way then, if any, lands first); their feedback
        waits in the trainer's queue, the time held not counted toward its `max_wait_s`."""
        name = self._name(name)
        record = await self.registry.hold(name, held, config=name in self.tenants.config)
        return {"tenant": name, "held": record.held, "latest_version": await self._latest(name)}

    async def delete(self, name: str) -> dict:
        """Delete registry tenant `name`: its keys stop working here now, elsewhere as soon
        as the delete is delivered; the trainer stops its lane."""
        name = self._name(name)
        self._not_config(name, "remove")
        gone = await self.registry.delete(name)
        # the tombstone's revision is above the deleted record's, so the watch re-applies
        # no revision of the record, and a create of the name afterwards is newer still
        self.apply(name, None, gone.revision + 1)
        return {"tenant": name, "deleted": True, "key_ids": gone.key_ids()}

    async def exists(self, name: TenantId) -> bool:
        return name in self.tenants.config or await self.registry.get(name) is not None

    async def export(self, name: str) -> Export:
        """Tenant `name`'s latest version, fetched from the trainer and checked against the
        versions KV. NotFound: no such tenant, or no version yet."""
        name = self._name(name)
        if not await self.exists(name):
            raise NotFound(f"no tenant {name!r}")
        info = await self.bus.kv_get(hbus.latest_key(name), common_pb2.VersionInfo)
        if info is None or info.version == 0:
            raise NotFound(f"tenant {name!r} has no adapter version yet (it is served the base model)")
        _, chunks = await self._fetch(name, info.version, info.sha256)
        try:
            return await _checked(name, info, chunks)
        finally:
            await chunks.aclose()  # read to its end, or not: the trainer's client is closed

    async def _fetch(self, name: TenantId, version: int, sha256: str = ""):
        """(the trainer's record of `version` of `name`'s lineage, its archive's chunks) from
        the first trainer that holds it (with `sha256`, that very one: the announced); close
        the chunks (`aclose`) when done with them: that closes the trainer's client. NotFound
        or Unavailable: no trainer had it."""
        from hotloop.clients import TrainerClient

        info = await self.bus.kv_get(hbus.latest_key(name), common_pb2.VersionInfo)
        said = await self.bus.kv_get(hbus.announced_key(name), bus_pb2.WeightsUpdated)
        recorded = hbus.recorded_address(said, info) if info is not None else ""
        addresses = list(dict.fromkeys(
            a for a in (self.fetch_from.get(name), recorded, self.trainer) if a))
        if not addresses:
            raise Unavailable(f"no trainer address known for tenant {name!r}: set [endpoints] "
                              "trainer, or wait for its trainer to announce a version")
        err: HotloopError = Unavailable("no trainer tried")
        for address in addresses:
            client = TrainerClient(address, self.admin_token)
            try:
                got, chunks = await client.fetch_adapter(version, FETCH_TIMEOUT_S, tenant=name)
                if sha256 and (got.version, got.sha256) != (version, sha256):
                    await chunks.aclose()
                    raise Unavailable(f"trainer at {address} holds another v{version} of "
                                      f"tenant {name!r} than the one announced")
            except (NotFound, Unavailable) as e:
                await client.close()
                err = e  # the next address may hold it
                continue
            except BaseException:
                await client.close()
                raise

            return got, _Chunks(chunks, client)
        raise err


class _Chunks:
    """A trainer's archive chunks with the client they come over: `aclose` closes both, read
    or not (an async generator never started runs no `finally`, so it cannot own the client)."""

    def __init__(self, chunks: AsyncIterator[bytes], client) -> None:
        self.chunks, self.client = chunks, client

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.chunks.__aiter__()

    async def aclose(self) -> None:
        try:
            await self.chunks.aclose()  # unread: the call is cancelled
        finally:
            await self.client.close()


async def _checked(name: TenantId, info, chunks: AsyncIterator[bytes]) -> Export:
    """Spool `chunks` and return them as an Export if their size and sha256 are the KV's."""
    limit = min(int(info.bytes) or MAX_ARCHIVE_BYTES, MAX_ARCHIVE_BYTES)
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
    digest, size = hashlib.sha256(), 0
    try:
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise Unavailable(f"the trainer sent more than the {limit} bytes of "
                                  f"tenant {name!r} v{info.version}")
            digest.update(chunk)
            spool.write(chunk)
        if size != info.bytes or digest.hexdigest() != info.sha256:
            raise Unavailable(f"the archive of tenant {name!r} v{info.version} from the trainer "
                              "does not match the announced size and sha256")
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return Export(name, int(info.version), info.sha256, size, spool)
