"""The bus against a real nats-server with JetStream."""

import asyncio
import time

import pytest

from hotloop import bus as hbus
from hotloop.proto.v1 import bus_pb2, common_pb2
from tests.procs import freeze


async def test_publish_subscribe_carries_trace_context(nats_server):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    b = await hbus.Bus.connect(nats_server.url, "test")
    got: asyncio.Queue = asyncio.Queue()

    async def handler(msg, headers):
        await got.put((msg, headers))

    await b.subscribe(hbus.WEIGHTS_UPDATED, bus_pb2.WeightsUpdated, handler)
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("push") as span:
        await b.publish(hbus.WEIGHTS_UPDATED, bus_pb2.WeightsUpdated(info=common_pb2.VersionInfo(version=7)))
        trace_id = format(span.get_span_context().trace_id, "032x")
    msg, headers = await asyncio.wait_for(got.get(), 5)
    assert msg.info.version == 7
    assert trace_id in headers["traceparent"]
    await b.close()


async def test_durable_consumer_redelivers_until_acked_and_dead_letters_garbage(nats_server):
    b = await hbus.Bus.connect(nats_server.url, "test")
    await b.ensure_streams()
    await b.js_publish(hbus.FEEDBACK, bus_pb2.FeedbackEvent(response_id="r1", score=1.0))
    await b.js.publish(hbus.FEEDBACK, b"\xff\xff not a protobuf", headers={hbus.TYPE_HEADER: "hotloop.v1.FeedbackEvent"})
    await b.js_publish(hbus.FEEDBACK, bus_pb2.TrafficEvent(response_id="wrong-type"))
    consumer = await b.pull("FEEDBACK", hbus.FEEDBACK, "trainer", bus_pb2.FeedbackEvent, ack_wait_s=1.0)
    first = await consumer.fetch(10, 2)
    assert [m.payload.response_id for m in first] == ["r1"]
    # not acked: comes back after ack_wait (nothing lost if the trainer dies mid-step)
    await asyncio.sleep(1.5)
    again = await consumer.fetch(10, 2)
    assert [m.payload.response_id for m in again] == ["r1"]
    await again[0].ack()
    await asyncio.sleep(1.5)
    assert await consumer.fetch(10, 1) == []
    dead = await b.pull("DEADLETTER", hbus.FEEDBACK_DEAD, "inspect", bus_pb2.DeadLetter)
    reasons = [m.payload.reason for m in await dead.fetch(10, 2)]
    assert len(reasons) == 2
    assert any("undecodable" in r for r in reasons) and any("TrafficEvent" in r for r in reasons)
    await b.close()


async def test_kv_holds_latest_version_across_reconnects(nats_server):
    b = await hbus.Bus.connect(nats_server.url, "a")
    await b.kv_put("latest", common_pb2.VersionInfo(version=3, sha256="ab"))
    await b.close()
    b2 = await hbus.Bus.connect(nats_server.url, "b")
    got = await b2.kv_get("latest", common_pb2.VersionInfo)
    assert got.version == 3 and got.sha256 == "ab"
    assert await b2.kv_get("missing", common_pb2.VersionInfo) is None
    await b2.close()


async def test_lineages_lists_every_announced_lineage_and_one_wildcard_hears_every_tenant(
        nats_server):
    b = await hbus.Bus.connect(nats_server.url, "a")
    try:
        assert await b.kv_keys() == [] and await b.lineages() == {}
        heard: list[tuple[str, int]] = []

        async def on(msg, headers) -> None:
            heard.append((msg.tenant, msg.info.version))

        await b.subscribe(hbus.WEIGHTS_TENANTS, bus_pb2.WeightsUpdated, on)
        for tenant, version in (("", 4), ("acme", 2), ("globex", 7)):
            info = common_pb2.VersionInfo(version=version)
            await b.kv_put(hbus.latest_key(tenant), info)
            await b.publish(hbus.weights_subject(tenant),
                            bus_pb2.WeightsUpdated(info=info, tenant=tenant))
        await b.kv_put("something-else", common_pb2.VersionInfo(version=9))
        got = await b.lineages()
        assert {t: v.version for t, v in got.items()} == {"": 4, "acme": 2, "globex": 7}
        for _ in range(100):  # the default lineage's subject is not under the wildcard
            if len(heard) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted(heard) == [("acme", 2), ("globex", 7)]
    finally:
        await b.close()
    assert hbus.lineage_of_key("latest") == "" and hbus.lineage_of_key("latest.tenant.a-1") == "a-1"
    for other in ("latest.tenant.", "latest.tenant.Bad", "latest.x", "lates", "latest.tenant.a.b"):
        assert hbus.lineage_of_key(other) is None, other


async def test_a_listing_of_the_versions_kv_never_misses_a_key_and_leaves_deleted_ones_out(
        nats_server):
    """nats-py's `KeyValue.keys()` answered [] for a bucket holding keys about one call in a
    hundred (its end marker races the delivery); a replica then missed a tenant's lineage
    until its next poll. Many listings, so that a return of the race fails here."""
    b = await hbus.Bus.connect(nats_server.url, "a")
    try:
        await b.kv_put(hbus.latest_key("acme"), common_pb2.VersionInfo(version=1))
        await b.kv_put(hbus.latest_key("gone"), common_pb2.VersionInfo(version=1))
        await b.kv_delete(hbus.latest_key("gone"))
        for i in range(1000):
            assert await b.kv_keys() == [hbus.latest_key("acme")], f"listing {i}"
        assert {t: v.version for t, v in (await b.lineages()).items()} == {"acme": 1}
    finally:
        await b.close()


async def test_connect_to_nothing_fails_within_bound():
    with pytest.raises(Exception):
        await asyncio.wait_for(hbus.Bus.connect("nats://127.0.0.1:1", "x", timeout_s=1.0), 10)


async def test_feedback_ids_deduplicate_and_traffic_is_looked_up_by_response(nats_server):
    b = await hbus.Bus.connect(nats_server.url, "test")
    await b.ensure_streams()
    fb = bus_pb2.FeedbackEvent(response_id="abc", score=1.0, user="k1")
    first = await b.js_publish_once(hbus.FEEDBACK, fb, msg_id="abc:0:k1")
    again = await b.js_publish_once(hbus.FEEDBACK, fb, msg_id="abc:0:k1")
    other = await b.js_publish_once(hbus.FEEDBACK, fb, msg_id="abc:0:k2")
    assert not first.duplicate and again.duplicate and not other.duplicate
    assert again.seq == first.seq
    consumer = await b.pull("FEEDBACK", hbus.FEEDBACK, "t", bus_pb2.FeedbackEvent)
    assert len(await consumer.fetch(10, 1)) == 2

    for choice in (0, 1):
        await b.js_publish(hbus.traffic_subject("abc", choice),
                           bus_pb2.TrafficEvent(response_id="abc", choice=choice, completion_ids=[choice + 5]))
    got = await b.traffic("abc", 1)
    assert got is not None and list(got.completion_ids) == [6]
    assert await b.traffic("missing", 0) is None
    with pytest.raises(hbus.BusError):
        hbus.traffic_subject("a.b", 0)
    await b.close()


async def test_one_server_gets_one_replica_and_ensure_brings_streams_to_their_settings(nats_server):
    """The default config (`[nats] replicas` 1) on a single server: every stream and the KV
    bucket with one replica. A FEEDBACK made elsewhere with JetStream's default 2-minute
    duplicate window is brought to the 24 h one; ensuring again changes nothing and keeps the
    messages; asking a single server for 3 replicas is an error naming the setting."""
    from nats.js.api import StreamConfig

    from hotloop.config import MeshConfig

    nats = MeshConfig.model_validate({"nats": {"url": nats_server.url}}).nats
    b = await hbus.Bus.connect(nats.url, "test", replicas=nats.replicas)
    await b.js.add_stream(StreamConfig(name="FEEDBACK", subjects=[hbus.FEEDBACK]))
    await b.ensure_streams()
    names = [*hbus.STREAMS, hbus.KV_STREAM_PREFIX + hbus.VERSIONS_BUCKET]
    configs = {n: (await b.js.stream_info(n)).config for n in names}
    assert {n: c.num_replicas for n, c in configs.items()} == dict.fromkeys(names, 1)
    assert configs["FEEDBACK"].duplicate_window == hbus.FEEDBACK_DEDUP_WINDOW_S
    assert configs["TRAFFIC"].max_age == hbus.TRAFFIC_MAX_AGE_S

    await b.js_publish(hbus.FEEDBACK, bus_pb2.FeedbackEvent(response_id="kept"))
    await b.ensure_streams()
    assert (await b.js.stream_info("FEEDBACK")).state.messages == 1

    three = await hbus.Bus.connect(nats.url, "three", replicas=3)
    with pytest.raises(hbus.BusError, match=r"\[nats\] replicas"):
        await three.ensure_streams()
    await three.close()
    await b.close()


async def test_several_urls_connect_to_whichever_answers(nats_server):
    """`[nats] url` may list a cluster's servers, comma-separated: one of them down does not
    keep the client from the others."""
    b = await hbus.Bus.connect(f"nats://127.0.0.1:1, {nats_server.url}", "test", timeout_s=10)
    assert b.nc.connected_url.port == nats_server.port
    await b.close()
    with pytest.raises(hbus.BusError):
        hbus.servers(" , ")


async def test_flush_returns_only_once_what_was_published_before_it_reached_the_server(nats_server):
    """A message published before `flush` has reached the server when `flush` returns: a
    subscriber that subscribes afterwards never hears it, only the next one. (nats-py's own
    flush writes its PING ahead of commands still in its buffer, so its PONG can come back
    before a buffered publish has left.)"""
    a = await hbus.Bus.connect(nats_server.url, "a")
    b = await hbus.Bus.connect(nats_server.url, "b")
    try:
        for i in range(300):  # without the fix, a few dozen rounds show it
            subject = f"hotloop.test.flush.{i}"
            await a.publish(subject, common_pb2.VersionInfo(version=1))
            await a.flush()
            heard: list[int] = []

            async def on(msg, headers, heard=heard) -> None:
                heard.append(msg.version)

            sub = await b.subscribe(subject, common_pb2.VersionInfo, on)
            await b.flush()  # the subscription is at the server
            await a.publish(subject, common_pb2.VersionInfo(version=2))
            await a.flush()
            for _ in range(200):
                if heard:
                    break
                await asyncio.sleep(0.01)
            await b.flush()
            await asyncio.sleep(0)
            await sub.unsubscribe()
            assert heard == [2], f"round {i}: heard {heard} (1 was published before the flush)"
    finally:
        await a.close()
        await b.close()


async def test_a_flush_cancelled_or_timed_out_before_its_pong_leaves_the_connection_reading(nats_server):
    """nats-py's `flush` cancels its PONG's future when it is cancelled or times out, and
    leaves it first in line: the PONG that then arrives raised InvalidStateError in the client's
    read loop, which ended it, and the connection heard nothing more (a trainer cancelled at
    SIGTERM inside an ack's flush then waited out the whole drain timeout at close: CI's "took
    5.7s to stop"). The server is frozen (SIGSTOP) so that the PONGs are still owed when the
    flushes end; both ways of ending one are tried."""
    import os
    import signal

    b = await hbus.Bus.connect(nats_server.url, "b")
    heard: asyncio.Queue = asyncio.Queue()

    async def on(msg, headers) -> None:
        await heard.put(msg.version)

    await b.subscribe("hotloop.test.after", common_pb2.VersionInfo, on)
    await b.flush()
    try:
        await freeze(nats_server.proc.pid)  # every thread: one still running answers the PING
        cancelled = asyncio.create_task(b.flush())
        await asyncio.sleep(0.3)  # its PING is out, its PONG owed
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        with pytest.raises(TimeoutError):  # its own time ran out (one try: no retrying)
            await b.retrying(lambda: b._round_trip(0.3), "flush", patience_s=0)
    finally:
        os.kill(nats_server.proc.pid, signal.SIGCONT)
    await b.publish("hotloop.test.after", common_pb2.VersionInfo(version=3))
    await b.flush()
    assert await asyncio.wait_for(heard.get(), 5) == 3  # the connection still reads
    t0 = time.monotonic()
    await b.close()
    assert time.monotonic() - t0 < hbus.DRAIN_TIMEOUT_S / 2  # no drain waited out
