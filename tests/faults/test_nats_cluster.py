"""A NATS JetStream cluster of three real servers (streams and KV with 3 replicas) loses a
server to SIGKILL in the middle of a run, and nothing is lost.

The test plays the mesh's three bus users on the cluster's three URLs: the gateway publishes
traffic and feedback (with their message ids, as it does), the trainer consumes feedback from a
durable pull consumer (acking each) and announces versions (KV `latest`, then
`WeightsUpdated`), the rollout subscribes to the announcements. The killed server is the one
the trainer is connected to, and the FEEDBACK, TRAFFIC and KV streams and the consumer are led
from it (moved there first), so the kill costs a reconnect and four leader elections at once.
Publishing goes on through the failover; the server is restarted on its port and store.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from launch.natsserver import NatsCluster
from hotloop.bus import FEEDBACK, LATEST_KEY, VERSIONS_BUCKET, WEIGHTS_UPDATED, Bus, traffic_subject
from hotloop.proto.v1 import bus_pb2, common_pb2
from tests.procs import freeze

pytestmark = pytest.mark.slow
ROUNDS = 30  # each: one served choice, its feedback, one announced version
KILL_AT, RESTART_AT = 10, 20  # rounds published before the kill, before the restart
DURABLE = "trainer"
KV_STREAM = f"KV_{VERSIONS_BUCKET}"


async def lead_on(bus: Bus, server: str, stream: str, consumer: str = "") -> None:
    """Move a stream's (or its consumer's) leader onto `server`: JetStream's leader stepdown
    with a preferred peer. Checked, so the failover under test is really of that leader."""
    api = f"CONSUMER.LEADER.STEPDOWN.{stream}.{consumer}" if consumer else f"STREAM.LEADER.STEPDOWN.{stream}"

    async def leader() -> str:
        info = await (bus.js.consumer_info(stream, consumer) if consumer else bus.js.stream_info(stream))
        return info.cluster.leader

    deadline = time.monotonic() + 15
    while (now := await leader()) != server:
        assert time.monotonic() < deadline, f"{stream}/{consumer}: leader stays {now}, not {server}"
        await bus.nc.request(f"$JS.API.{api}", json.dumps({"placement": {"preferred": server}}).encode(),
                             timeout=5)
        await asyncio.sleep(0.2)


async def test_killing_a_server_mid_run_loses_no_feedback_traffic_or_announcement(tmp_path):
    cluster = NatsCluster(tmp_path / "nats", 3).start()
    buses: list[Bus] = []
    try:
        gateway = await Bus.connect(cluster.url, "gateway", replicas=3)
        trainer = await Bus.connect(cluster.url, "trainer", replicas=3)
        rollout = await Bus.connect(cluster.url, "rollout", replicas=3)
        buses += [gateway, trainer, rollout]
        await gateway.ensure_streams()
        for name in ("FEEDBACK", "TRAFFIC", "DEADLETTER", KV_STREAM):
            assert (await gateway.js.stream_info(name)).config.num_replicas == 3, name
        consumer = await trainer.pull("FEEDBACK", FEEDBACK, DURABLE, bus_pb2.FeedbackEvent,
                                      batch=8, timeout_s=0.5, ack_wait_s=5)

        heard: list[int] = []  # versions the rollout's subscription delivered
        rollout_back: list[int] = []  # rounds published when the rollout's connection came back
        published_rounds = 0

        async def on_weights(msg, headers) -> None:
            heard.append(msg.info.version)

        await rollout.subscribe(WEIGHTS_UPDATED, bus_pb2.WeightsUpdated, on_weights)
        rollout.on_reconnect(lambda: rollout_back.append(published_rounds))
        await rollout.flush()

        victim = next(m for m in cluster.members if m.port == trainer.nc.connected_url.port)
        for stream in ("FEEDBACK", "TRAFFIC", KV_STREAM):
            await lead_on(gateway, victim.name, stream)
        await lead_on(gateway, victim.name, "FEEDBACK", DURABLE)

        delivered: dict[int, list[str]] = {}  # stream seq -> response ids (one per delivery)
        done = asyncio.Event()

        async def consume() -> None:
            while not done.is_set():
                for m in await consumer.fetch():
                    delivered.setdefault(m.seq, []).append(m.payload.response_id)
                    await m.ack()

        sent: dict[str, int] = {}  # response id -> the feedback's stream seq
        publish_s: list[tuple[int, float]] = []  # (round, seconds its feedback publish took)
        killed_at = restarted_at = failover_s = 0.0
        consuming = asyncio.create_task(consume())
        for i in range(ROUNDS):
            if i == KILL_AT:
                # what was published before the kill has arrived: core NATS is at-most-once,
                # and an announcement still in the killed server's buffers is gone with it
                deadline = time.monotonic() + 10
                while KILL_AT not in heard:
                    assert time.monotonic() < deadline, heard
                    await asyncio.sleep(0.01)
                victim.kill()
                killed_at = time.monotonic()
            if i == RESTART_AT:
                await asyncio.to_thread(victim.restart)
                await asyncio.to_thread(cluster.wait_healthy, 30)
                restarted_at = time.monotonic() - killed_at
            rid = f"resp{i}"
            served = bus_pb2.TrafficEvent(response_id=rid, completion_ids=[i + 5], policy_version=i)
            await gateway.js_publish_once(traffic_subject(rid), served, msg_id=f"{rid}:0")
            t = time.monotonic()
            fb = await gateway.js_publish_once(
                FEEDBACK, bus_pb2.FeedbackEvent(response_id=rid, score=1.0, user="u"), msg_id=f"{rid}:0:u")
            publish_s.append((i, time.monotonic() - t))
            if i == KILL_AT:  # the first round's publishes waited out the reconnect and elections
                failover_s = time.monotonic() - killed_at
            sent[rid] = fb.seq
            await trainer.kv_put(LATEST_KEY, common_pb2.VersionInfo(version=i + 1))
            await trainer.publish(WEIGHTS_UPDATED, bus_pb2.WeightsUpdated(info=common_pb2.VersionInfo(version=i + 1)))
            published_rounds = i + 1
        await trainer.flush()

        deadline = time.monotonic() + 30
        while len(delivered) < ROUNDS and time.monotonic() < deadline and not consuming.done():
            await asyncio.sleep(0.1)
        info = await trainer.js.consumer_info("FEEDBACK", DURABLE)
        while (info.num_ack_pending or info.num_pending) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the last acks are on their way
            info = await trainer.js.consumer_info("FEEDBACK", DURABLE)
        done.set()
        await consuming
        assert await consumer.fetch(8, 1) == []  # every delivery acked: nothing comes again

        stream = await gateway.js.stream_info("FEEDBACK")
        latest = await rollout.kv_get(LATEST_KEY, common_pb2.VersionInfo)
        traffic = {rid: await gateway.traffic(rid) for rid in sent}
        for _ in range(100):  # the restarted server catches up with the stream
            stream = await gateway.js.stream_info("FEEDBACK")
            if all(p.current and not p.lag for p in stream.cluster.replicas):
                break
            await asyncio.sleep(0.1)
    finally:
        for b in buses:
            await b.close()
        cluster.stop()

    # feedback: each stored once (ids deduplicate a publish retried across the failover),
    # each delivered to the durable consumer and acked; none pending, none lost
    assert stream.state.messages == ROUNDS
    assert sorted(sent.values()) == sorted(delivered), (sent, delivered)
    assert {rids[0] for rids in delivered.values()} == set(sent)
    assert info.num_ack_pending == 0 and info.num_pending == 0
    assert len(stream.cluster.replicas) == 2 and all(p.current for p in stream.cluster.replicas)
    # traffic: every served choice can still be joined to its feedback
    assert all(t is not None and list(t.completion_ids) == [int(rid[4:]) + 5] for rid, t in traffic.items())
    # announcements: the KV holds the last; the subscriber heard every one except those
    # published while it was reconnecting (none, when the killed server was not its own; the
    # round in flight as it came back may race its subscription's way through the cluster)
    assert latest is not None and latest.version == ROUNDS
    away = set(range(KILL_AT + 1, rollout_back[-1] + 2)) if rollout_back else set()
    assert set(range(1, ROUNDS + 1)) - set(heard) <= away, (rollout_back, heard)

    # what the failover cost (reported, not asserted: it is the servers' election timing)
    slowest = max(s for i, s in publish_s if i >= KILL_AT)
    redelivered = sum(len(r) - 1 for r in delivered.values())
    print(f"\nfailover: first round after the kill stored {failover_s:.2f}s after it, slowest "
          f"feedback publish {slowest:.2f}s, restart "
          f"+ caught up at {restarted_at:.2f}s after the kill, {redelivered} redelivered, "
          f"rollout reconnected: {bool(rollout_back)}, missed announcements: "
          f"{sorted(set(range(1, ROUNDS + 1)) - set(heard))}")


async def test_a_frozen_server_is_left_for_another_within_the_ping_bound(tmp_path):
    """A server that freezes (SIGSTOP: its TCP connections stay open, nothing answers) is
    found by the client's pings (`[nats] ping_interval_s`; three unanswered) and left for
    another member; a feedback published meanwhile is stored once, through it. At nats-py's
    default interval (120 s) the client stayed on the frozen server, and the publish was
    still waiting a minute later (checked: this test then fails)."""
    import os
    import signal

    cluster = NatsCluster(tmp_path / "nats", 3).start()
    bus = None
    victim = None
    try:
        bus = await Bus.connect(cluster.url, "gateway", replicas=3, ping_interval_s=0.5)
        await bus.ensure_streams()
        victim = next(m for m in cluster.members if m.port == bus.nc.connected_url.port)
        await lead_on(bus, victim.name, "FEEDBACK")  # its stream's leader freezes with it
        await freeze(victim.proc.pid)  # every thread: one still running would store the publish
        t0 = time.monotonic()
        fb = bus_pb2.FeedbackEvent(response_id="frozen", score=1.0, user="u")
        ack = await asyncio.wait_for(bus.js_publish_once(FEEDBACK, fb, msg_id="frozen:0:u"), 60)
        took = time.monotonic() - t0
        assert bus.nc.connected_url.port != victim.port
        # stored once: a retry whose first try was stored but not acked in time (the election)
        # is answered as a duplicate, which is the id doing its job (CI saw it once)
        assert ack.seq >= 1
        assert (await bus.js.stream_info("FEEDBACK")).state.messages == 1
        # three pings, a reconnect and the stream's leader election (5-8.5 s alone, measured
        # above); without the pings the publish is still waiting at 60 s
        assert took < 30, took
        print(f"\nfrozen server left, feedback stored {took:.2f}s after the freeze")
    finally:
        if victim is not None and victim.proc is not None and victim.proc.poll() is None:
            os.kill(victim.proc.pid, signal.SIGCONT)
        if bus is not None:
            await bus.close()
        cluster.stop()
