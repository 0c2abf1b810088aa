"""The NATS bus: typed (protobuf) messages with trace context, JetStream streams, KV.

Owns: connecting with bounded retry, subject/stream names, publishing with W3C trace
context in headers, durable pull consumers with explicit ack and a dead-letter subject for
messages that cannot be decoded, and the KV bucket holding the current policy version.
Does not own: what a service does with a message.

Payloads are protobuf messages from `hotloop.proto.v1.bus_pb2`; the `hotloop-type` header
names the message type, so a consumer refuses (dead-letters) a payload of another type or
version instead of misreading it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from hotloop import telemetry

log = logging.getLogger(__name__)

WEIGHTS_UPDATED = "hotloop.weights.updated"
ROLLOUT_LOADED = "hotloop.rollout.loaded"
FEEDBACK = "hotloop.feedback"
FEEDBACK_DEAD = "hotloop.feedback.dead"
TRAFFIC = "hotloop.traffic"  # + ".<response_id>.<choice>": one subject per served choice
DEAD = FEEDBACK_DEAD  # malformed feedback and traffic alike land here, with the reason
STREAMS = {"FEEDBACK": [FEEDBACK], "TRAFFIC": [f"{TRAFFIC}.>"], "DEADLETTER": [FEEDBACK_DEAD]}
# JetStream drops a second message with the same Nats-Msg-Id inside this window: the gateway
# gives each feedback the id "<response_id>:<choice>:<user>", so a repeat is deduplicated.
FEEDBACK_DEDUP_WINDOW_S = 24 * 3600.0
TRAFFIC_MAX_AGE_S = 24 * 3600.0
"""Served exchanges older than this are dropped from TRAFFIC; feedback on them is refused."""
VERSIONS_BUCKET = "hotloop-versions"
TYPE_HEADER = "hotloop-type"

M = TypeVar("M", bound=Message)


class BusError(RuntimeError):
    pass


def traffic_subject(response_id: str, choice: int = 0) -> str:
    """The subject of one served choice. Keying traffic by subject makes the feedback join a
    direct lookup (`Bus.traffic`), durable and independent of consumer position."""
    if not response_id or any(c in response_id for c in ". *>\t\r\n"):
        raise BusError(f"response id {response_id!r} cannot be a subject token")
    return f"{TRAFFIC}.{response_id}.{choice}"


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


class Bus:
    def __init__(self, nc, js):
        self.nc = nc
        self.js = js
        self._kv = None

    @classmethod
    async def connect(cls, url: str, name: str, timeout_s: float = 10.0) -> "Bus":
        import nats
        from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

        async def _quiet(e: Exception) -> None:  # reconnects are logged once, not per traceback
            log.warning("nats: %s", e)

        async for attempt in AsyncRetrying(
            stop=stop_after_delay(timeout_s),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception_type((OSError, TimeoutError, nats.errors.NoServersError)),
            reraise=True,
        ):
            with attempt:
                nc = await nats.connect(
                    url, name=name, connect_timeout=2, allow_reconnect=True,
                    max_reconnect_attempts=-1, error_cb=_quiet,
                )
        return cls(nc, nc.jetstream())

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.drain()

    # ---- publishing -------------------------------------------------------------------
    def _headers(self, msg: Message) -> dict[str, str]:
        return telemetry.inject_headers({TYPE_HEADER: msg.DESCRIPTOR.full_name})

    async def publish(self, subject: str, msg: Message) -> None:
        """Fire-and-forget on a plain subject (weight notifications)."""
        await self.nc.publish(subject, msg.SerializeToString(), headers=self._headers(msg))

    async def js_publish(self, subject: str, msg: Message) -> int:
        """Durable publish to a JetStream stream; returns the stream sequence once stored."""
        return (await self.js_publish_once(subject, msg)).seq

    async def js_publish_once(self, subject: str, msg: Message, msg_id: str = "") -> Published:
        """Durable publish; with `msg_id`, a repeat inside the stream's duplicate window is
        not stored again and comes back with `duplicate=True`."""
        headers = self._headers(msg)
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        ack = await self.js.publish(subject, msg.SerializeToString(), headers=headers)
        return Published(ack.seq, bool(getattr(ack, "duplicate", False)))

    async def traffic(self, response_id: str, choice: int = 0):
        """The TRAFFIC record of one served choice, or None (never served, or aged out)."""
        from nats.js.errors import NotFoundError

        from hotloop.proto.v1 import bus_pb2

        try:
            raw = await self.js.get_last_msg("TRAFFIC", traffic_subject(response_id, choice))
        except NotFoundError:
            return None
        return decode(bus_pb2.TrafficEvent, raw.data, dict(raw.headers or {}))

    # ---- streams and KV ------------------------------------------------------------------
    async def ensure_streams(self) -> None:
        from nats.js.api import StreamConfig

        extra = {"FEEDBACK": {"duplicate_window": FEEDBACK_DEDUP_WINDOW_S},
                 "TRAFFIC": {"max_age": TRAFFIC_MAX_AGE_S}}
        for name, subjects in STREAMS.items():
            cfg = StreamConfig(name=name, subjects=subjects, **extra.get(name, {}))
            try:
                await self.js.add_stream(cfg)
            except Exception as e:  # already exists with the same config is fine
                if "already in use" not in str(e):
                    await self.js.update_stream(cfg)

    async def kv(self):
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(VERSIONS_BUCKET)
            except Exception:
                self._kv = await self.js.create_key_value(bucket=VERSIONS_BUCKET, history=16)
        return self._kv

    async def kv_put(self, key: str, msg: Message) -> None:
        await (await self.kv()).put(key, msg.SerializeToString())

    async def kv_get(self, key: str, msg_type: type[M]) -> M | None:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await (await self.kv()).get(key)
        except KeyNotFoundError:
            return None
        return msg_type.FromString(entry.value)

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

    async def pull(
        self, stream: str, subject: str, durable: str, msg_type: type[M],
        batch: int = 16, timeout_s: float = 1.0, ack_wait_s: float = 30.0,
        max_ack_pending: int | None = None,
    ) -> "PullConsumer[M]":
        """`max_ack_pending`: JetStream delivers no more than this many un-acked messages to
        the consumer (server-side backpressure); None keeps the server's default."""
        from nats.js.api import AckPolicy, ConsumerConfig

        extra = {} if max_ack_pending is None else {"max_ack_pending": max_ack_pending}
        sub = await self.js.pull_subscribe(
            subject, durable=durable, stream=stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s, **extra),
        )
        return PullConsumer(self, sub, msg_type, batch, timeout_s)


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

    def __init__(self, bus: Bus, sub, msg_type, batch: int, timeout_s: float):
        self.bus, self.sub, self.msg_type = bus, sub, msg_type
        self.batch, self.timeout_s = batch, timeout_s

    async def fetch(self, batch: int | None = None, timeout_s: float | None = None) -> list[Received]:
        import nats

        try:
            raws = await self.sub.fetch(batch or self.batch, timeout=timeout_s or self.timeout_s)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            # nats-py raises the builtin TimeoutError instead of its own when the event loop
            # stalled past the fetch deadline (a busy 2-core host): still just "nothing yet".
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
        return int((await self.sub.consumer_info()).ack_floor.stream_seq)

    async def dead_letter(self, raw, reason: str) -> None:
        from hotloop.proto.v1 import bus_pb2

        await self.bus.js_publish(
            FEEDBACK_DEAD, bus_pb2.DeadLetter(subject=raw.subject, payload=raw.data, reason=reason)
        )
        await raw.ack()
