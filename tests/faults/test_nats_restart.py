"""A NATS restart in the middle of an online run: real nats-server (JetStream, file store), the
online loop in this process on the tiny model. The test plays the gateway: it publishes
traffic and feedback before the outage and after the restart. Every feedback must be trained
exactly once and acked, none lost, and the loop must carry on by itself.

No rollout replica: the publisher stores and announces each version (a publisher without
replicas is a supported setup); what is under test is the trainer's bus, not serving.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from hotloop.bus import FEEDBACK, Bus, traffic_subject
from launch.natsserver import NatsServer
from hotloop.proto.v1 import bus_pb2, common_pb2
from services.trainer.recipes import online
from services.trainer.config import OnlineConfig
from services.trainer.publish import Publisher

pytestmark = pytest.mark.slow
DURABLE = "faults-online"
OUTAGE_S = 3.0  # "a restart of several seconds"


async def serve(bus: Bus, rid: str, seed: int) -> None:
    """What the gateway publishes for one served choice (token ids from the tiny vocab)."""
    ids = [3 + (seed * 7 + i * 13) % 400 for i in range(12)]
    ev = bus_pb2.TrafficEvent(
        response_id=rid, prompt_ids=ids[:5], completion_ids=ids[5:], logprobs=[-2.0] * 7,
        policy_version=0, served_at=time.time(), user="u", choice=0, temperature=1.0,
        version_spans=[common_pb2.VersionSpan(version=0, first_token=0)], finish_reason="length")
    await bus.js_publish_once(traffic_subject(rid), ev, msg_id=f"{rid}:0")


async def feedback(bus: Bus, rid: str, score: float) -> int:
    fb = bus_pb2.FeedbackEvent(response_id=rid, user="u1", choice=0, score=score, received_at=time.time())
    return (await bus.js_publish_once(FEEDBACK, fb, msg_id=f"{rid}:0:u1")).seq


async def test_nats_restart_mid_run_loses_no_feedback_and_the_trainer_resumes(
        tmp_path, trainer_cfg, tiny_model):
    nats = NatsServer(tmp_path / "nats").start()
    url, port = nats.url, nats.port
    gateway = trainer_bus = None
    try:
        gateway = await Bus.connect(url, "gateway")
        await gateway.ensure_streams()
        sent = []
        for i in range(4):
            await serve(gateway, f"before{i}", i)
            sent.append(await feedback(gateway, f"before{i}", 1.0 if i % 2 else -1.0))

        trainer_bus = await Bus.connect(url, "trainer")
        mesh = online.OnlineMesh(trainer_bus, Publisher([], "", tmp_path / "store", trainer_bus, "tiny"))
        job = OnlineConfig(batch_size=1, batch_window_s=0, max_steps=0, durable=DURABLE, ack_wait_s=2,
                           max_staleness_versions=100, out_dir=str(tmp_path), run_id="run")
        recs: list = []
        down = asyncio.Event()
        real_publish = mesh.publisher.publish

        async def publish_then_outage(version, adapter):
            res = await real_publish(version, adapter)
            if version == 2:  # the second feedback is trained and published, not yet acked; the
                nats.stop()   # other two are fetched (held, un-acked) or still in the stream
                down.set()
            return res

        mesh.publisher.publish = publish_then_outage
        loop = asyncio.create_task(online.run(job, trainer_cfg, tiny_model, mesh, tmp_path / "run",
                                              on_step=recs.append))
        await asyncio.wait_for(down.wait(), 60)
        assert len(recs) == 1  # the second update is published, its checkpoint and ack are not
        await asyncio.sleep(OUTAGE_S)
        if loop.done():
            await loop  # it died in the outage: its error, with its traceback
        nats.restart()
        assert nats.url == url and nats.port == port  # the clients' URL still points at it
        for i in range(4):
            await serve(gateway, f"after{i}", 10 + i)
            sent.append(await feedback(gateway, f"after{i}", 1.0 if i % 2 else -1.0))

        deadline = time.monotonic() + 60
        while sum(r.feedback for r in recs) < len(sent) and time.monotonic() < deadline:
            if loop.done():
                await loop  # its error, with its traceback
            await asyncio.sleep(0.1)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        info = await gateway.js.consumer_info("FEEDBACK", DURABLE)
    finally:
        for b in (trainer_bus, gateway):
            if b is not None:
                await b.close()
        nats.stop()

    trained = [s for r in recs for s in r.seqs]
    assert sorted(trained) == sorted(sent), (trained, sent)  # each exactly once, none lost
    assert recs[-1].counters["dead_lettered"] == {} and recs[-1].counters["dropped"] == {}
    assert info.num_ack_pending == 0 and info.num_pending == 0  # all acked
    assert recs[-1].version == len(recs)
