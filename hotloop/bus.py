"""The NATS bus: typed (protobuf) messages with trace context, JetStream streams, KV.

Owns: connecting with bounded retry, subject/stream names, publishing with W3C trace
context in headers, durable pull consumers with explicit ack and a dead-letter subject for
messages that cannot be decoded, the KV bucket holding each lineage's current policy version
(`lineages` lists them all), and the tenant registry's KV bucket (whose records
`hotloop.tenants.Registry` owns).
Does not own: what a service does with a message.

Clusters: `connect` takes one URL or several of one cluster, comma-separated; the client
fails over among them (and the servers the cluster advertises). The streams and the KV buckets
are created with `replicas` copies (`ensure_streams`), so with 3 on a cluster of three a dead
server loses nothing: the survivors elect new leaders, and meanwhile JetStream requests are
retried and pull fetches come back empty, as in any outage (below).

Outages: once connected, the client reconnects for as long as the process lives (a NATS
restart on the same port and store keeps the streams, consumers and KV), and calls the
`on_reconnect` listeners when it is back (plain subscriptions miss what was published while it
was away, so a listener re-reads what it needs from the KV). While it is away,
core publishes and acks wait in the client's buffer and pull fetches come back empty; each
JetStream request (publish, lookup, KV, consumer info) is retried for up to `outage_s`
(default `OUTAGE_S`), then its error propagates. A caller with a user waiting passes
`patience_s=0` and fails at once instead.

Payloads are protobuf messages from `hotloop.proto.v1.bus_pb2`; the `hotloop-type` header
names the message type, so a consumer refuses (dead-letters) a payload of another type or
version instead of misreading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from hotloop import telemetry
from hotloop.tenants import DEFAULT as DEFAULT_TENANT, InvalidTenant, TenantId

log = logging.getLogger(__name__)

WEIGHTS_UPDATED = "hotloop.weights.updated"
ROLLOUT_LOADED = "hotloop.rollout.loaded"
FEEDBACK = "hotloop.feedback"
FEEDBACK_DEAD = "hotloop.feedback.dead"
TRAFFIC = "hotloop.traffic"  # + ".<response_id>.<choice>": one subject per served choice
DEAD = FEEDBACK_DEAD  # malformed feedback and traffic alike land here, with the reason
FEEDBACK_TENANTS = f"{FEEDBACK}.tenant"  # + ".<tenant>": a named tenant's feedback
STREAMS = {"FEEDBACK": [FEEDBACK, f"{FEEDBACK_TENANTS}.*"], "TRAFFIC": [f"{TRAFFIC}.>"], "DEADLETTER": [FEEDBACK_DEAD]}
# JetStream drops a second message with the same Nats-Msg-Id inside this window: the gateway
# gives each feedback the id "<response_id>:<choice>:<user>", so a repeat is deduplicated.
FEEDBACK_DEDUP_WINDOW_S = 24 * 3600.0
TRAFFIC_MAX_AGE_S = 24 * 3600.0
"""Served exchanges older than this are dropped from TRAFFIC; feedback on them is refused."""
VERSIONS_BUCKET = "hotloop-versions"
TENANTS_BUCKET = "hotloop-tenants"
"""KV bucket of the tenant registry: key = a tenant's name, value = a `bus_pb2.TenantRecord`."""
LATEST_KEY = "latest"
"""KV key (in `VERSIONS_BUCKET`) of the newest announced version (a `common_pb2.VersionInfo`)."""
ANNOUNCED_KEY = "announced"
"""KV key (in `VERSIONS_BUCKET`) of the default lineage's last announcement (a
`bus_pb2.WeightsUpdated`: the version and the address of the trainer that announced it)."""
KV_STREAM_PREFIX = "KV_"  # JetStream keeps a KV bucket in the stream KV_<bucket>
STREAM_NAME_IN_USE = 10058  # JetStream's error code: a stream of that name exists, configured otherwise
TYPE_HEADER = "hotloop-type"
OUTAGE_S = 30.0
"""How long a JetStream request keeps retrying while the server is unreachable."""
RECONNECT_WAIT_S = 0.5
"""Between attempts to reach a lost server (nats-py waits 2 s by default)."""
DRAIN_TIMEOUT_S = 5.0
"""Bound on draining subscriptions at close (nats-py waits 30 s by default)."""
REQUEST_TIMEOUT_S = 5.0
"""One JetStream request's wait for its answer (a retry may follow, see `OUTAGE_S`)."""
# `[nats] ping_interval_s`'s default, and the unanswered pings after which the connection is
# stale (nats-py's default count; its default interval, 120 s, kept a client on a frozen
# server for ~6 minutes)
PING_INTERVAL_S = 10.0
MAX_OUTSTANDING_PINGS = 2
PONG_PATIENCE_S = 600.0
"""How long a round trip of `Bus.flush` keeps its place for a late PONG after its caller gave up
on it (a connection found stale by the pings long before is reset, and drops it)."""

M = TypeVar("M", bound=Message)


class BusError(RuntimeError):
    pass


def transient(e: BaseException) -> bool:
    """An error that a reconnect can cure: no answer in time, no JetStream responder yet (a
    server still recovering its store), the client reconnecting or its outbound buffer full."""
    import nats
    from nats.js import errors as js_errors

    return isinstance(e, (
        TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError,
        nats.errors.ConnectionReconnectingError, nats.errors.StaleConnectionError,
        nats.errors.OutboundBufferLimitError, js_errors.NoStreamResponseError,
        js_errors.ServiceUnavailableError))


def traffic_subject(response_id: str, choice: int = 0) -> str:
    """The subject of one served choice. Keying traffic by subject makes the feedback join a
    direct lookup (`Bus.traffic`), durable and independent of consumer position."""
    if not response_id or any(c in response_id for c in ". *>\t\r\n"):
        raise BusError(f"response id {response_id!r} cannot be a subject token")
    return f"{TRAFFIC}.{response_id}.{choice}"


# The subjects and keys of a lineage take its `TenantId`; `TenantId(tenant)` returns one as it
# is and parses a plain str, so no subject ever carries a token that names no tenant (a '.',
# '*' or '>' would reach into other lineages' subjects).
def weights_subject(tenant: TenantId = DEFAULT_TENANT) -> str:
    """Where a lineage's versions are announced (`WeightsUpdated`): `hotloop.weights.updated`
    for the default lineage, `hotloop.weights.updated.tenant.<name>` for a tenant's, so that
    a listener of one lineage never hears another's version numbers."""
    return WEIGHTS_UPDATED if TenantId(tenant).is_default else f"{WEIGHTS_UPDATED}.tenant.{tenant}"


def latest_key(tenant: TenantId = DEFAULT_TENANT) -> str:
    """The KV key (in `VERSIONS_BUCKET`) of a lineage's newest announced version: `latest`, or
    `latest.tenant.<name>` for a tenant's."""
    return LATEST_KEY if TenantId(tenant).is_default else f"{LATEST_KEY}.tenant.{tenant}"


def announced_key(tenant: TenantId = DEFAULT_TENANT) -> str:
    """The KV key (in `VERSIONS_BUCKET`) of a lineage's last announcement, written with its
    `latest_key`: `announced`, or `announced.tenant.<name>`. A replica that starts after the
    announcement finds there where to fetch the version, without a configured trainer."""
    return ANNOUNCED_KEY if TenantId(tenant).is_default else f"{ANNOUNCED_KEY}.tenant.{tenant}"


def recorded_address(said: Message | None, info: Message) -> str:
    """The FetchAdapter address a lineage's last announcement (`said`, the `WeightsUpdated`
    under its `announced_key`, or None) recorded for the version `info` (a `VersionInfo`):
    only when it announced that very version (number and sha256), else ""."""
    if said is None or (said.info.version, said.info.sha256) != (info.version, info.sha256):
        return ""
    return said.fetch_from


WEIGHTS_TENANTS = f"{WEIGHTS_UPDATED}.tenant.*"
"""Every tenant's `weights_subject` (a wildcard: one subscription hears them all)."""
_LATEST_TENANT = f"{LATEST_KEY}.tenant."


def lineage_of_key(key: str) -> TenantId | None:
    """The lineage whose `latest_key` `key` is (the default for `latest`), or None for any
    other key."""
    if key == LATEST_KEY:
        return DEFAULT_TENANT
    if not key.startswith(_LATEST_TENANT):
        return None
    try:
        return TenantId(key[len(_LATEST_TENANT):]) or None
    except InvalidTenant:
        return None


def feedback_subject(tenant: TenantId = DEFAULT_TENANT) -> str:
    """The FEEDBACK subject of a tenant's feedback, which its trainer reads: `hotloop.feedback`
    for the default tenant (""), `hotloop.feedback.tenant.<name>` for another (`hotloop.tenants`
    says what a name may be; the dead-letter subject, `hotloop.feedback.dead`, is neither)."""
    return FEEDBACK if TenantId(tenant).is_default else f"{FEEDBACK_TENANTS}.{tenant}"


@dataclass
class Published:
    seq: int
    duplicate: bool  # JetStream already held a message with this id: nothing was stored


@dataclass
class Received:
    """A decoded message and the raw NATS message (to ack once its effect has committed)."""

    payload: Message
    raw: object
    headers: dict[str, str]

    async def ack(self) -> None:
        await self.raw.ack()

    async def nak(self, delay_s: float | None = None) -> None:
        await self.raw.nak(delay=delay_s)

    @property
    def seq(self) -> int:
        """The message's stream sequence: the same on every redelivery, so it identifies a
        feedback across restarts (JetStream already dropped duplicates by message id)."""
        return int(self.raw.metadata.sequence.stream)


def servers(url: str) -> list[str]:
    """The server URLs of `url` (one, or several comma-separated), in order."""
    found = [u.strip() for u in url.split(",") if u.strip()]
    if not found:
        raise BusError(f"no NATS server in {url!r}")
    return found


class Bus:
    def __init__(self, nc, js, outage_s: float = OUTAGE_S,
                 reconnect_listeners: list[Callable[[], None]] | None = None, replicas: int = 1):
        self.nc = nc
        self.js = js
        self.outage_s = outage_s
        self.replicas = replicas
        """Copies of each stream and KV bucket `ensure_streams` (and a first `kv()`) asks for."""
        self._buckets: dict[str, Any] = {}  # KV buckets looked up (`bucket`)
        self._pulls: list = []  # pull subscriptions, unsubscribed (not drained) at close
        self._reconnect_listeners = [] if reconnect_listeners is None else reconnect_listeners
        self._round_trips: set[asyncio.Task] = set()  # `_round_trip`s whose PONG is still owed

    def on_reconnect(self, fn: Callable[[], None]) -> None:
        """Call `fn()` (on the event loop, not awaited) each time the connection comes back."""
        self._reconnect_listeners.append(fn)

    @classmethod
    async def connect(cls, url: str, name: str, timeout_s: float = 10.0,
                      outage_s: float = OUTAGE_S, replicas: int = 1,
                      ping_interval_s: float = PING_INTERVAL_S) -> "Bus":
        """Connect to `url` (one server, or several of one cluster comma-separated) within
        `timeout_s` (BusError if no server answers by then). `outage_s`: how long JetStream
        requests ride out a lost server afterwards. `replicas`: see `Bus.replicas`.
        `ping_interval_s`: `[nats] ping_interval_s` (a server that stops answering is left
        after `MAX_OUTSTANDING_PINGS` + 1 of them)."""
        from nats.aio.client import Client

        async def _quiet(e: Exception) -> None:  # reconnects are logged once, not per traceback
            log.warning("nats: %s", e)

        listeners: list[Callable[[], None]] = []

        async def _reconnected() -> None:
            log.info("nats: reconnected")
            for fn in list(listeners):
                fn()

        nc = Client()
        # With max_reconnect_attempts=-1 nats-py retries the first connect forever too, so the
        # bound is this wait_for; after it, reconnecting never gives up (see the docstring).
        try:
            await asyncio.wait_for(nc.connect(
                servers(url), name=name, connect_timeout=2, allow_reconnect=True, max_reconnect_attempts=-1,
                reconnect_time_wait=RECONNECT_WAIT_S, drain_timeout=DRAIN_TIMEOUT_S, error_cb=_quiet,
                reconnected_cb=_reconnected, ping_interval=ping_interval_s,
                max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            ), timeout_s)
        except TimeoutError:
            last = nc.last_error
            await nc.close()
            raise BusError(f"no NATS server answered at {url} within {timeout_s:g}s"
                           + (f" ({last})" if last else "")) from None
        return cls(nc, nc.jetstream(timeout=REQUEST_TIMEOUT_S), outage_s, listeners, replicas)

    async def close(self) -> None:
        """Deliver what is buffered (acks included) and close. Pull subscriptions are
        unsubscribed, not drained: nats-py's fetch takes messages off their queue without
        marking them done, so draining one waits out the whole drain timeout. Whatever they
        held un-acked is redelivered to the next consumer."""
        import nats

        if self.nc.is_closed:
            return
        for sub in self._pulls:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:  # already gone, or the connection is reconnecting
                pass
        self._pulls.clear()
        if self.nc.is_connected:
            await self.nc.drain()
        else:  # reconnecting: nothing can be drained; un-acked messages are redelivered
            await self.nc.close()
        for task in list(self._round_trips):  # PONGs a closed connection will never bring
            task.cancel()

    async def retrying(self, op: Callable[[], Awaitable[Any]], what: str,
                       patience_s: float | None = None) -> Any:
        """`op()`, retried while `transient` errors last, for up to `patience_s` (None: the
        bus's `outage_s`; 0: one try)."""
        from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

        patience = self.outage_s if patience_s is None else patience_s

        def _note(state) -> None:
            if state.attempt_number == 1:
                log.warning("bus: %s failed (%r); retrying for up to %gs", what,
                            state.outcome.exception(), patience)

        async for attempt in AsyncRetrying(
            stop=stop_after_delay(patience), wait=wait_exponential(multiplier=0.1, max=1.0),
            retry=retry_if_exception(transient), before_sleep=_note, reraise=True,
        ):
            with attempt:
                return await op()

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Return once everything published (acks included) before this call has reached the
        server (retried across an outage).

        One nats-py `flush` does not promise that: it writes its PING straight to the socket,
        ahead of commands still in the client's buffer, so its PONG can come back before a
        buffered publish has left. While the first round trip is on the wire the client's
        flusher sends the buffer, so the second PING goes out behind it."""
        async def twice() -> None:
            await self._round_trip(timeout_s)
            await self._round_trip(timeout_s)

        await self.retrying(twice, "flush")

    async def _round_trip(self, timeout_s: float) -> None:
        """One PING/PONG round trip that its caller may cancel, or give up on after
        `timeout_s` (FlushTimeoutError), without breaking the connection.

        nats-py's `flush` cancels its PONG's future in both cases but leaves it first in line:
        the PONG that then arrives raises InvalidStateError in the client's read loop, which
        ends it, and the connection hears nothing more until its pings find it stale (a trainer
        cancelled at SIGTERM inside an ack's flush then waited out the whole drain timeout at
        close). So nats-py's flush runs as a task of its own, shielded from the caller, with a
        patience (`PONG_PATIENCE_S`) that a PONG still owed never meets first."""
        import nats

        inner = asyncio.ensure_future(self.nc.flush(PONG_PATIENCE_S))
        self._round_trips.add(inner)

        def settled(task: asyncio.Task) -> None:
            self._round_trips.discard(task)
            if not task.cancelled():
                task.exception()  # retrieved: a round trip nobody waits for any more may fail

        inner.add_done_callback(settled)
        try:
            await asyncio.wait_for(asyncio.shield(inner), timeout_s)
        except TimeoutError:
            raise nats.errors.FlushTimeoutError from None

    # ---- publishing -------------------------------------------------------------------
    def _headers(self, msg: Message) -> dict[str, str]:
        return telemetry.inject_headers({TYPE_HEADER: msg.DESCRIPTOR.full_name})

    async def publish(self, subject: str, msg: Message) -> None:
        """Fire-and-forget on a plain subject (weight notifications)."""
        await self.nc.publish(subject, msg.SerializeToString(), headers=self._headers(msg))

    async def js_publish(self, subject: str, msg: Message, msg_id: str = "") -> int:
        """Durable publish to a JetStream stream; returns the stream sequence once stored."""
        return (await self.js_publish_once(subject, msg, msg_id)).seq

    async def js_publish_once(self, subject: str, msg: Message, msg_id: str = "",
                              patience_s: float | None = None) -> Published:
        """Durable publish; with `msg_id`, a repeat inside the stream's duplicate window is
        not stored again and comes back with `duplicate=True`. Retried across an outage (see
        `retrying`): without a `msg_id`, a try whose answer was lost may store a second copy;
        with one, the retry comes back as a duplicate."""
        headers = self._headers(msg)
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        data = msg.SerializeToString()
        ack = await self.retrying(lambda: self.js.publish(subject, data, headers=headers),
                                  f"publish to {subject}", patience_s)
        return Published(ack.seq, bool(getattr(ack, "duplicate", False)))

    async def traffic(self, response_id: str, choice: int = 0, patience_s: float | None = None):
        """The TRAFFIC record of one served choice, or None (never served, or aged out)."""
        from nats.js.errors import NotFoundError

        from hotloop.proto.v1 import bus_pb2

        subject = traffic_subject(response_id, choice)
        try:
            raw = await self.retrying(lambda: self.js.get_last_msg("TRAFFIC", subject),
                                      f"traffic lookup {subject}", patience_s)
        except NotFoundError:
            return None
        return decode(bus_pb2.TrafficEvent, raw.data, dict(raw.headers or {}))

    # ---- streams and KV ------------------------------------------------------------------
    async def ensure_streams(self) -> None:
        """Create the streams and the versions KV bucket, or bring existing ones to what this
        bus wants (subjects, limits, `replicas`), leaving their other settings as they are.
        Idempotent, so each service that needs them calls it at start, in any order; two at
        once are fine too (the one that loses the race to create compares and updates)."""
        extra = {"FEEDBACK": {"duplicate_window": FEEDBACK_DEDUP_WINDOW_S},
                 "TRAFFIC": {"max_age": TRAFFIC_MAX_AGE_S}}
        for name, subjects in STREAMS.items():
            await self._ensure_stream(name, subjects=subjects, num_replicas=self.replicas,
                                      **extra.get(name, {}))
        await self.kv()  # a bucket made by a process with another `replicas` is brought to ours:
        await self._ensure_stream(KV_STREAM_PREFIX + VERSIONS_BUCKET, num_replicas=self.replicas)
        await self.tenants_kv()
        await self._ensure_stream(KV_STREAM_PREFIX + TENANTS_BUCKET, num_replicas=self.replicas)

    async def _ensure_stream(self, name: str, **want) -> None:
        """Create stream `name` with `want` (StreamConfig fields), or update the existing one
        where it differs from `want`."""
        from nats.js.api import StreamConfig
        from nats.js.errors import APIError, NotFoundError

        try:
            try:
                info = await self.retrying(lambda: self.js.stream_info(name), f"stream {name}")
            except NotFoundError:
                try:
                    await self.retrying(lambda: self.js.add_stream(StreamConfig(name=name, **want)),
                                        f"create stream {name}")
                    return
                except APIError as e:
                    if e.err_code != STREAM_NAME_IN_USE:
                        raise
                info = await self.retrying(lambda: self.js.stream_info(name), f"stream {name}")
            if all(getattr(info.config, k) == v for k, v in want.items()):
                return
            updated = info.config.evolve(**want)
            await self.retrying(lambda: self.js.update_stream(updated), f"update stream {name}")
        except APIError as e:
            raise BusError(f"stream {name} with {self.replicas} replica(s) ([nats] replicas): "
                           f"{e.description or e}") from e

    async def bucket(self, bucket: str, history: int, ttl_s: float = 0.0):
        """KV bucket `bucket` (looked up once), created with `replicas` copies, `history` and
        `ttl_s` (entries expire that long after their last write; 0: never) if it does not
        exist yet."""
        if bucket not in self._buckets:
            self._buckets[bucket] = await self._lookup_or_create(bucket, history, ttl_s)
        return self._buckets[bucket]

    async def _lookup_or_create(self, bucket: str, history: int, ttl_s: float):
        from nats.js.errors import APIError, BucketNotFoundError

        try:
            return await self.retrying(lambda: self.js.key_value(bucket), f"KV {bucket} lookup")
        except BucketNotFoundError:
            try:
                return await self.retrying(lambda: self.js.create_key_value(
                    bucket=bucket, history=history, replicas=self.replicas, ttl=ttl_s or None),
                    f"KV {bucket} create")
            except APIError as e:  # created meanwhile by another process (other replicas)
                if e.err_code != STREAM_NAME_IN_USE:
                    raise
                return await self.retrying(lambda: self.js.key_value(bucket), f"KV {bucket} lookup")

    async def kv(self):
        """The versions KV bucket, created with `replicas` copies if it does not exist yet."""
        return await self.bucket(VERSIONS_BUCKET, 16)

    async def tenants_kv(self):
        """The tenant registry's KV bucket (`hotloop.tenants.Registry` reads and writes it),
        created with `replicas` copies if it does not exist yet."""
        return await self.bucket(TENANTS_BUCKET, 8)

    async def kv_put(self, key: str, msg: Message) -> None:
        kv, data = await self.kv(), msg.SerializeToString()
        await self.retrying(lambda: kv.put(key, data), f"KV put {key}")

    async def kv_get(self, key: str, msg_type: type[M]) -> M | None:
        from nats.js.errors import KeyNotFoundError

        kv = await self.kv()
        try:
            entry = await self.retrying(lambda: kv.get(key), f"KV get {key}")
        except KeyNotFoundError:
            return None
        return msg_type.FromString(entry.value)

    async def kv_delete(self, key: str) -> None:
        """Delete a key of the versions KV (a deleted tenant's `latest_key`); absent is fine."""
        kv = await self.kv()
        await self.retrying(lambda: kv.delete(key), f"KV delete {key}")

    async def kv_keys(self) -> list[str]:
        """Every key of the versions bucket that holds a value, sorted (deleted ones left out)."""
        return list(await self.entries(await self.kv(), VERSIONS_BUCKET))

    async def entries(self, kv, bucket: str) -> dict[str, Any]:
        """key -> its current entry (nats-py `KeyValue.Entry`), by key, of every key of KV
        `bucket` (`kv`, its handle) that holds a value (deleted ones left out).

        Not nats-py's `KeyValue.keys()`: that watches the bucket and ends at a marker which
        races the delivery (a key delivered before the consumer's info comes back but not yet
        read is missed), so it answers an empty list for a bucket that holds keys, about one
        call in a hundred here. The keys come from the stream's per-subject state instead,
        and each is read back (one request per key)."""
        from nats.js.errors import KeyNotFoundError

        prefix = f"$KV.{bucket}."
        info = await self.retrying(
            lambda: self.js.stream_info(f"KV_{bucket}", subjects_filter=prefix + ">"),
            f"KV {bucket} keys")
        out = {}
        for subject in sorted(info.state.subjects or {}):
            key = subject[len(prefix):]
            try:
                out[key] = await self.retrying(lambda: kv.get(key), f"KV get {key}")
            except KeyNotFoundError:  # deleted (its tombstone is the subject's last message)
                pass
        return out

    async def replay_end(self, bucket: str) -> int:
        """The revision of the last entry a watch of KV `bucket` started now replays (0: the
        bucket holds nothing): the stream's last sequence. A watcher knows its replay is out
        when it has seen that revision, or an entry with nothing pending after it (`delta`
        0), whichever comes first; nats-py's own end marker (a None entry) races the
        delivery like `entries`' listing does."""
        info = await self.retrying(lambda: self.js.stream_info(f"KV_{bucket}"),
                                   f"KV {bucket} info")
        return info.state.last_seq if info.state.messages else 0

    async def lineages(self) -> dict[TenantId, Message]:
        """Every lineage the mesh announced: tenant ("" the default) -> its newest version
        (the `common_pb2.VersionInfo` under its `latest_key`)."""
        from hotloop.proto.v1 import common_pb2

        out = {}
        for key, entry in (await self.entries(await self.kv(), VERSIONS_BUCKET)).items():
            tenant = lineage_of_key(key)
            if tenant is not None:
                out[tenant] = common_pb2.VersionInfo.FromString(entry.value)
        return dict(sorted(out.items()))

    # ---- consuming ------------------------------------------------------------------------
    async def subscribe(
        self, subject: str, msg_type: type[M], handler: Callable[[M, dict], Awaitable[None]]
    ):
        """Plain subscription; undecodable messages are logged and dropped (not durable)."""

        async def _cb(raw):
            headers = dict(raw.headers or {})
            try:
                payload = decode(msg_type, raw.data, headers)
            except BusError as e:
                log.warning("dropping message on %s: %s", subject, e)
                return
            await handler(payload, headers)

        return await self.nc.subscribe(subject, cb=_cb)

    async def delete_consumer(self, stream: str, durable: str) -> None:
        """Delete a durable consumer (none of that name: nothing to do). The stream's messages
        stay; a pull subscription on it gets nothing more."""
        from nats.js.errors import NotFoundError

        with contextlib.suppress(NotFoundError):
            await self.retrying(lambda: self.js.delete_consumer(stream, durable),
                                f"delete consumer {durable}")

    async def pull(
        self, stream: str, subject: str, durable: str, msg_type: type[M],
        batch: int = 16, timeout_s: float = 1.0, ack_wait_s: float = 30.0,
        max_ack_pending: int | None = None,
    ) -> "PullConsumer[M]":
        """`max_ack_pending`: JetStream delivers no more than this many un-acked messages to
        the consumer (server-side backpressure); None keeps the server's default."""
        from nats.js.api import AckPolicy, ConsumerConfig

        extra = {} if max_ack_pending is None else {"max_ack_pending": max_ack_pending}
        config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s, **extra)
        sub = await self.retrying(
            lambda: self.js.pull_subscribe(subject, durable=durable, stream=stream, config=config),
            f"consumer {durable}")
        self._pulls.append(sub)
        return PullConsumer(self, sub, msg_type, batch, timeout_s, stream, durable)


def decode(msg_type: type[M], data: bytes, headers: dict[str, str]) -> M:
    declared = headers.get(TYPE_HEADER)
    if declared and declared != msg_type.DESCRIPTOR.full_name:
        raise BusError(f"expected {msg_type.DESCRIPTOR.full_name}, message says {declared}")
    try:
        return msg_type.FromString(data)
    except DecodeError as e:
        raise BusError(f"undecodable {msg_type.DESCRIPTOR.full_name}: {e}") from e


class PullConsumer:
    """Durable, explicitly acked. Undecodable messages go to the dead-letter subject with the
    reason and are then acked (they would fail forever); everything else is the caller's to
    ack after its effect commits, or it is redelivered after ack_wait."""

    def __init__(self, bus: Bus, sub, msg_type, batch: int, timeout_s: float,
                 stream: str = "", durable: str = ""):
        self.bus, self.sub, self.msg_type = bus, sub, msg_type
        self.batch, self.timeout_s = batch, timeout_s
        self.stream, self.durable = stream, durable

    async def close(self) -> None:
        """Unsubscribe (as `Bus.close` does), keeping the durable consumer: what this one
        holds un-acked is redelivered to the next subscriber of it, and a pull request still
        pending here takes nothing more (it would hold a message until ack_wait)."""
        import nats

        if self.sub in self.bus._pulls:
            self.bus._pulls.remove(self.sub)
            try:
                await self.sub.unsubscribe()
            except nats.errors.Error:  # already gone, or the connection is reconnecting
                pass

    async def delete(self) -> None:
        """Unsubscribe and delete the durable consumer: its position and what it had
        delivered un-acked go with it; the stream's messages stay."""
        await self.close()
        await self.bus.delete_consumer(self.stream, self.durable)

    async def fetch(self, batch: int | None = None, timeout_s: float | None = None) -> list[Received]:
        import nats

        timeout_s = timeout_s or self.timeout_s
        try:
            raws = await self.sub.fetch(batch or self.batch, timeout=timeout_s)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            # nats-py raises the builtin TimeoutError instead of its own when the event loop
            # stalled past the fetch deadline (a busy 2-core host): still just "nothing yet".
            return []
        except Exception as e:
            if not transient(e):
                raise
            # No consumer leader answers (503): a cluster electing a new one after losing a
            # server. Nothing yet, after the wait a fetch would have had, so a caller's loop
            # keeps its pace instead of spinning through the election.
            await asyncio.sleep(timeout_s)
            return []
        out = []
        for raw in raws:
            headers = dict(raw.headers or {})
            try:
                out.append(Received(decode(self.msg_type, raw.data, headers), raw, headers))
            except BusError as e:
                await self.dead_letter(raw, str(e))
        return out

    async def ack_floor(self) -> int:
        """The stream sequence at and below which JetStream holds every message of this
        consumer as acked (never redelivered)."""
        info = await self.bus.retrying(self.sub.consumer_info, "consumer info")
        return int(info.ack_floor.stream_seq)

    async def dead_letter(self, raw, reason: str) -> None:
        from hotloop.proto.v1 import bus_pb2

        meta = raw.metadata  # the message's id: a publish retried across an outage stores one copy
        await self.bus.js_publish(
            FEEDBACK_DEAD, bus_pb2.DeadLetter(subject=raw.subject, payload=raw.data, reason=reason),
            msg_id=f"dead:{meta.stream}:{meta.sequence.stream}")
        await raw.ack()
