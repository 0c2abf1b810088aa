"""The gateway's side of the bus: the traffic fork, durable feedback, and the tenants'
announced versions.

Owns: turning served choices and feedback into `bus_pb2` events with the message ids of
bus.proto, the bounded queue and background task that publish traffic (a full queue drops
and counts, so a slow or absent bus never slows a user), the synchronous, acked feedback
publish, reading a served choice back from TRAFFIC, and hearing each tenant's newest version
(`watch_lineages`: every tenant's `WeightsUpdated` through one wildcard subscription, and the
tenants' KV keys read at start, on each reconnect and every `LINEAGES_REREAD_S`, since core
NATS delivers an announcement at most once).
Does not own: deciding what is valid feedback (core.py), what the versions mean for routing
(routing.py) or the streams (hotloop.bus).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from collections.abc import Callable

from hotloop.aio import raise_if_cancelled
from hotloop.bus import WEIGHTS_TENANTS, Bus, feedback_subject, traffic_subject
from hotloop.errors import Unavailable
from hotloop.proto.v1 import bus_pb2, common_pb2
from hotloop.tenants import DEFAULT, InvalidTenant, TenantId

from .types import ServedChoice

log = logging.getLogger(__name__)

LINEAGES_REREAD_S = 30.0
"""How often the tenants' KV keys are read again, as the backstop for a missed announcement."""
FIRST_READ_S = 5.0
"""Bound on the read of the tenants' KV keys at start (a bus that does not answer by then is
read again in the background; the replicas' polls report what they know meanwhile)."""


@dataclass
class TrafficCounters:
    forked: int = 0  # queued for publishing
    published: int = 0  # stored by JetStream
    dropped: int = 0  # queue full: never published
    publish_errors: int = 0  # not stored, after the bus retried for its outage bound (logged)


def traffic_event(s: ServedChoice) -> bus_pb2.TrafficEvent:
    return bus_pb2.TrafficEvent(
        response_id=s.response_id, prompt_ids=s.prompt_ids, completion_ids=s.completion_ids,
        logprobs=s.logprobs,
        policy_version=s.version_spans[0][0] if s.version_spans else 0,
        served_at=s.served_at,
        version_spans=[common_pb2.VersionSpan(version=v, first_token=f) for v, f in s.version_spans],
        user=s.user, choice=s.choice, temperature=s.temperature, finish_reason=s.finish_reason,
        tenant=s.tenant,
    )


def served_from_event(e: bus_pb2.TrafficEvent) -> ServedChoice:
    return ServedChoice(
        response_id=e.response_id, choice=e.choice, user=e.user, prompt_ids=list(e.prompt_ids),
        completion_ids=list(e.completion_ids), logprobs=list(e.logprobs),
        version_spans=[(s.version, s.first_token) for s in e.version_spans],
        temperature=e.temperature, finish_reason=e.finish_reason, served_at=e.served_at,
        tenant=TenantId(e.tenant),  # read back from the bus: parsed (InvalidTenant)
    )


class BusEvents:
    def __init__(self, bus: Bus, queue_size: int):
        self._bus = bus
        self._queue: asyncio.Queue[tuple[ServedChoice, asyncio.Future]] = asyncio.Queue(maxsize=queue_size)
        self._task: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self.counters = TrafficCounters()

    async def start(self) -> None:
        await self._bus.ensure_streams()
        self._task = asyncio.create_task(self._publish_forever())

    async def close(self, drain_s: float = 5.0) -> None:
        """Publish what is queued (for at most `drain_s`), then stop."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self._queue.join(), drain_s)
        except TimeoutError:
            log.warning("%d traffic events not published at shutdown", self._queue.qsize())
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None

    async def watch_lineages(self, on_version: Callable[[TenantId, int], None]) -> None:
        """Call `on_version(tenant, version)` with each tenant's newest announced version:
        every `WeightsUpdated` on a tenant's subject from now on, and every tenant's KV key
        now (bounded by `FIRST_READ_S`), on each reconnect and every `LINEAGES_REREAD_S`."""
        async def on_weights(msg: bus_pb2.WeightsUpdated, headers) -> None:
            try:
                tenant = TenantId(msg.tenant)
            except InvalidTenant as e:
                log.warning("ignoring an announcement on a tenant's subject: %s", e)
                return
            on_version(tenant, msg.info.version)

        async def read() -> None:
            for tenant, info in (await self._bus.lineages()).items():
                on_version(tenant, info.version)

        wake = asyncio.Event()

        async def reread_forever() -> None:
            while True:
                raise_if_cancelled()  # a read that swallowed the close's cancel (hotloop.aio)
                try:
                    await asyncio.wait_for(wake.wait(), LINEAGES_REREAD_S)
                except TimeoutError:
                    pass
                wake.clear()
                try:
                    await read()
                except Exception as e:  # the next reconnect or period tries again
                    log.warning("reading the tenants' announced versions failed: %s", e)

        await self._bus.subscribe(WEIGHTS_TENANTS, bus_pb2.WeightsUpdated, on_weights)
        self._bus.on_reconnect(wake.set)
        try:
            await asyncio.wait_for(read(), FIRST_READ_S)
        except Exception as e:
            log.warning("reading the tenants' announced versions failed (%s); trying again in "
                        "the background", e)
        self._watch = asyncio.create_task(reread_forever())

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def fork(self, served: ServedChoice) -> asyncio.Future | None:
        """Queue one served choice for TRAFFIC without waiting. Returns a future that becomes
        True once JetStream stored it (False if it refused), or None when it was dropped."""
        stored = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait((served, stored))
        except asyncio.QueueFull:
            self.counters.dropped += 1
            return None
        self.counters.forked += 1
        return stored

    async def _publish_forever(self) -> None:
        while True:
            raise_if_cancelled()  # a publish that swallowed the close's cancel (hotloop.aio)
            s, stored = await self._queue.get()
            ok = False
            try:
                await self._bus.js_publish_once(
                    traffic_subject(s.response_id, s.choice), traffic_event(s),
                    msg_id=f"{s.response_id}:{s.choice}",
                )
                self.counters.published += 1
                ok = True
            except asyncio.CancelledError:
                raise
            except Exception as e:  # one lost record must not stop the fork
                self.counters.publish_errors += 1
                log.warning("traffic %s:%d not published: %s", s.response_id, s.choice, e)
            finally:
                if not stored.done():
                    stored.set_result(ok)
                self._queue.task_done()

    async def publish_feedback(self, response_id: str, choice: int, user: str, score: float,
                               label: str, text: str, received_at: float, tenant: TenantId = DEFAULT) -> bool:
        """Publish on the tenant's feedback subject and wait for JetStream's ack; True when it
        was a duplicate (same response, choice and user inside the duplicate window).
        Unavailable when the bus did not ack."""
        event = bus_pb2.FeedbackEvent(response_id=response_id, score=score, label=label, text=text,
                                      user=user, received_at=received_at, choice=choice,
                                      tenant=tenant)
        try:
            # a user is waiting: one try, then 503 (a retry is deduplicated by the msg id)
            published = await self._bus.js_publish_once(
                feedback_subject(tenant), event, msg_id=f"{response_id}:{choice}:{user}", patience_s=0)
        except Exception as e:
            raise Unavailable(f"feedback was not stored (the bus did not acknowledge it): {e}") from e
        return published.duplicate

    async def traffic(self, response_id: str, choice: int) -> ServedChoice | None:
        try:
            event = await self._bus.traffic(response_id, choice, patience_s=0)
        except Exception as e:
            raise Unavailable(f"could not look up response {response_id} on the bus: {e}") from e
        if event is None:
            return None
        try:
            return served_from_event(event)
        except InvalidTenant as e:  # not a record this gateway wrote: nothing to rate
            log.warning("traffic %s:%d names no tenant: %s", response_id, choice, e)
            return None
