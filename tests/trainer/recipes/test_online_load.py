"""The online loop when feedback arrives faster than it trains: a real nats-server (JetStream)
with the loop's own durable consumer, a real `Publisher` without replicas (it stores and
announces each version), and the tiny policy with its train step slowed down. The tests play
the gateway (traffic records and feedback with its message ids) and read what the loop did
from the stream, metrics.jsonl and its Prometheus metrics. No vLLM: what is under test is which
feedback an update takes, which it sheds, and that none is lost."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from hotloop.bus import FEEDBACK, Bus, traffic_subject
from hotloop.proto.v1 import bus_pb2
from services.trainer.config import OnlineConfig
from services.trainer.recipes import online
from services.trainer.recipes.online import FeedbackQueue, Pending
from services.trainer.publish import Publisher

pytestmark = [pytest.mark.slow]
DURABLE = "online-load-test"


class Gateway:
    """What the gateway publishes: one traffic record per answer, then its feedback."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def answer_and_rate(self, rid: str, completion_tokens: int, score: float) -> int:
        ids = [3 + (i * 7 + len(rid)) % 40 for i in range(completion_tokens)]
        ev = bus_pb2.TrafficEvent(response_id=rid, prompt_ids=[5, 6], completion_ids=ids,
                                  logprobs=[-1.0] * len(ids), policy_version=0,
                                  served_at=time.time(), user="u", choice=0, temperature=1.0)
        await self.bus.js_publish_once(traffic_subject(rid), ev, msg_id=f"{rid}:0")
        fb = bus_pb2.FeedbackEvent(response_id=rid, user="u", choice=0, score=score,
                                   received_at=time.time())
        return (await self.bus.js_publish_once(FEEDBACK, fb, msg_id=f"{rid}:0:u")).seq


def job(tmp_path, **kw) -> OnlineConfig:
    base = {"durable": DURABLE, "ack_wait_s": 60, "out_dir": str(tmp_path), "run_id": "run",
            "max_staleness_versions": 1000, "checkpoint_interval": 1, "max_steps": 0}
    return OnlineConfig(**{**base, **kw})


async def acks_landed(bus: Bus, pending: int, timeout: float = 10.0):
    """The consumer's info once `pending` messages are un-acked, read again a moment later.
    The server applies acks from its own queue, after a consumer info sent behind them may have
    been answered, so one read can still count acks that have left; a count that overshoots
    (an ack too many) shows on the second read."""
    deadline = time.monotonic() + timeout
    while (info := await bus.js.consumer_info("FEEDBACK", DURABLE)).num_ack_pending != pending:
        if time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    return await bus.js.consumer_info("FEEDBACK", DURABLE)


def records(tmp_path, kind: str) -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r[kind] for r in map(json.loads, lines) if kind in r]


def slowed(policy, seconds: float):
    """The policy with each train step `seconds` longer (a trainer slower than its users)."""
    step = policy.train_step

    def slow_step(*args, **kwargs):
        time.sleep(seconds)
        return step(*args, **kwargs)

    policy.train_step = slow_step
    return policy


async def run_until(recipe_job, cfg, model, tmp_path, bus, policy, done, metrics=None) -> None:
    """Run the loop until `done(step record)` says so, then stop it (as a SIGTERM does)."""
    publisher = Publisher([], "token", tmp_path / "store", bus, "tiny")
    mesh = online.OnlineMesh(bus, publisher)

    def on_step(rec) -> None:
        if done(rec):
            asyncio.current_task().cancel()

    task = asyncio.create_task(online.run(recipe_job, cfg, model, mesh, tmp_path / "run",
                                          on_step=on_step, policy=policy, metrics=metrics))
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 180)
    finally:
        await publisher.close()


async def test_arrivals_faster_than_training_are_shed_and_none_is_lost(
        nats_server, tmp_path, make_cfg, tiny_model) -> None:
    from hotloop import metrics
    from services.trainer.learner.policy import LoraPolicy
    from tests.scrape import scrape

    bus = await Bus.connect(nats_server.url, "gateway")
    await bus.ensure_streams()
    gw = Gateway(bus)
    # 30 answers rated at once, against updates of at most 2 feedback that take 0.5 s or more
    # each: what waits past 1 s is shed
    seqs = [await gw.answer_and_rate(f"r{i}", 8, 1.0 if i % 2 else -1.0) for i in range(30)]
    policy = slowed(LoraPolicy(make_cfg()), 0.5)
    om = online.OnlineMetrics()
    endpoint = metrics.serve(om.registry)

    def all_settled(rec) -> bool:  # the step's own record and drops are written by now
        trained = sum(r["feedback"] for r in records(tmp_path, "step"))
        return trained + len(records(tmp_path, "settled")) == len(seqs)

    try:
        await run_until(job(tmp_path, batch_size=2, batch_window_s=0, max_wait_s=1.0, max_queue=64),
                        make_cfg(), tiny_model, tmp_path, bus, policy, all_settled, metrics=om)
        got = await scrape(endpoint.port)
        info = await acks_landed(bus, 0)
    finally:
        endpoint.close()
        await bus.close()

    steps, drops = records(tmp_path, "step"), records(tmp_path, "settled")
    trained = [s for r in steps for s in r["seqs"]]
    shed = [d["seq"] for d in drops if d["kind"] == "shed"]
    # each feedback trained once or shed once: none lost, none twice
    assert sorted(trained + shed) == seqs
    assert shed and len(drops) == len(shed)
    assert all("in the trainer's queue" in d["reason"] for d in drops)
    # Updates take the newest first. The first one starts while the intake still fetches;
    # once all 30 are queued (the first update takes 0.5 s), each takes the newest left.
    later = [s for r in steps[1:] for s in r["seqs"]]
    assert len(steps) >= 2 and later == sorted(later, reverse=True)
    for r in steps:  # only an update's newest feedback may have waited past the bound
        assert r["feedback"] == 1 or r["queue_wait_s"] <= 1.0
    assert sum(r["shed"] for r in steps) == len(shed)
    assert steps[-1]["counters"]["dropped"] == {"shed": len(shed)}
    assert got.value("hotloop_trainer_feedback_dropped_total", reason="shed") == len(shed)
    assert got.value("hotloop_trainer_queue_wait_seconds_count") == len(trained)
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_an_update_stops_at_its_token_bound_newest_first(
        nats_server, tmp_path, make_cfg, tiny_model) -> None:
    """Six answers of 2 + 8 tokens against a bound of 25 tokens: the update takes the newest
    three (the third crosses the bound and is still taken); the rest wait, un-acked, for the
    next update."""
    bus = await Bus.connect(nats_server.url, "gateway")
    await bus.ensure_streams()
    gw = Gateway(bus)
    seqs = [await gw.answer_and_rate(f"t{i}", 8, 1.0) for i in range(6)]
    try:
        # the window holds the update until all six are queued
        await run_until(job(tmp_path, batch_size=6, batch_window_s=60, max_batch_tokens=25),
                        make_cfg(), tiny_model, tmp_path, bus, None, lambda rec: True)
        info = await acks_landed(bus, 3)
    finally:
        await bus.close()
    (step,) = records(tmp_path, "step")
    assert step["seqs"] == seqs[:2:-1] and step["tokens"] == 24  # completion tokens
    assert step["queue_depth"] == 3 and step["shed"] == 0
    assert info.num_ack_pending == 3  # fetched, not trained: redelivered to the next run


def test_the_queue_sheds_its_oldest_but_never_the_newest() -> None:
    def pending(seq: int, arrived: float) -> Pending:
        return Pending(msg=None, seq=seq, arrived=arrived)

    q = FeedbackQueue(3)
    for seq, at in ((1, 10.0), (2, 11.0), (3, 12.0)):
        q.put(pending(seq, at))
    with pytest.raises(OverflowError):
        q.put(pending(4, 13.0))
    assert [p.seq for p in q.shed(11.5)] == [1, 2] and q.qsize() == 1
    assert q.shed(100.0) == [] and q.newest().seq == 3  # the newest stays, however old
    q.put(pending(5, 14.0))
    assert [q.pop_newest().seq, q.pop_newest().seq] == [5, 3] and q.empty()


def test_the_time_a_lineage_was_held_does_not_count_toward_a_wait() -> None:
    """Held from t=20 to t=120: what was queued before waited 5 and 10 s of learning, what came
    during the hold waits from the resume; the order of the waits is the queue's."""
    q = FeedbackQueue(8)
    for seq, at in ((1, 10.0), (2, 15.0), (3, 60.0), (4, 110.0)):
        q.put(Pending(msg=None, seq=seq, arrived=at))
    q.resume(20.0, 120.0)
    assert [p.waits_from for p in (q.pop_newest(), q.pop_newest())] == [120.0, 120.0]
    assert q.shed(110.0) == []  # max_wait_s 10 at t=120: nothing waited past 10 s of learning
    assert [p.seq for p in q.shed(112.0)] == [1]  # waits from 10 + 100 = 110 and 15 + 100 = 115
    assert q.oldest().arrived == 15.0  # its arrival is kept: the wait metrics count the hold


class SlowPublisher(Publisher):
    """A publisher whose every push takes `delay` s (a replica building and swapping the
    version), logging when each version's publish starts and ends; `fail_at` raises there."""

    def __init__(self, *args, delay: float, fail_at: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay, self.fail_at, self.log = delay, fail_at, []

    async def publish(self, version, adapter_dir):
        self.log.append(("start", version, time.monotonic()))
        await asyncio.sleep(self.delay)
        if version == self.fail_at:
            raise RuntimeError(f"replica refused version {version}")
        result = await super().publish(version, adapter_dir)
        self.log.append(("end", version, time.monotonic()))
        return result


def watched(policy, log: list):
    """The policy, logging when each train step starts and which version each checkpoint holds."""
    step, save = policy.train_step, policy.save_checkpoint

    def train_step(*args, **kwargs):
        log.append(("train", None, time.monotonic()))
        return step(*args, **kwargs)

    def save_checkpoint(root, data_position=None, *args, **kwargs):
        log.append(("checkpoint", data_position["version"], time.monotonic()))
        return save(root, data_position, *args, **kwargs)

    policy.train_step, policy.save_checkpoint = train_step, save_checkpoint
    return policy


async def test_a_publish_runs_beside_the_next_training_and_versions_land_in_order(
        nats_server, tmp_path, make_cfg, tiny_model) -> None:
    """Six feedback, one per update, each publish 1 s long: the next update trains while a
    version is pushed, yet versions go out one after another in order, every checkpoint
    holds only published versions, and at the end everything is published and acked."""
    from services.trainer.learner.policy import LoraPolicy

    bus = await Bus.connect(nats_server.url, "gateway")
    await bus.ensure_streams()
    gw = Gateway(bus)
    seqs = [await gw.answer_and_rate(f"p{i}", 8, 1.0 if i % 2 else -1.0) for i in range(6)]
    publisher = SlowPublisher([], "token", tmp_path / "store", bus, "tiny", delay=1.0)
    policy = watched(LoraPolicy(make_cfg()), publisher.log)
    try:
        await asyncio.wait_for(online.run(
            job(tmp_path, batch_size=1, batch_window_s=0, checkpoint_interval=3, max_steps=6),
            make_cfg(), tiny_model, online.OnlineMesh(bus, publisher), tmp_path / "run",
            policy=policy), 180)
        info = await acks_landed(bus, 0)
    finally:
        await publisher.close()
        await bus.close()

    log = publisher.log
    pushes = [(v, t) for kind, v, t in log if kind in ("start", "end")]
    assert [v for v, _ in pushes] == [v for v in range(1, 7) for _ in (0, 1)]  # in order, one at a time
    spans = {v: (t0, t1) for (v, t0), (_, t1) in zip(pushes[::2], pushes[1::2])}
    trains = [t for kind, _, t in log if kind == "train"]
    assert any(t0 < t < t1 for t in trains for t0, t1 in spans.values())  # trained while pushing
    for kind, v, t in log:  # a checkpoint never holds a version still on its way
        if kind == "checkpoint":
            assert spans[v][1] <= t
    assert [v for kind, v, _ in log if kind == "checkpoint"] == [3, 6]
    assert sorted(s for r in records(tmp_path, "step") for s in r["seqs"]) == seqs
    assert info.num_ack_pending == 0 and info.num_pending == 0


@pytest.mark.parametrize("queued", [4, 0], ids=["while-training", "while-waiting-for-feedback"])
async def test_a_failed_publish_stops_the_loop_and_acks_nothing_it_carried(
        nats_server, tmp_path, make_cfg, tiny_model, queued) -> None:
    """Version 2's push fails while the loop trains the next update, or while it idles for
    feedback: the run ends with that error (it does not train on past it or wait forever),
    no checkpoint holds version 2, and none of its feedback is acked (redelivered next run)."""
    bus = await Bus.connect(nats_server.url, "gateway")
    await bus.ensure_streams()
    gw = Gateway(bus)
    for i in range(queued + 2):  # one each for versions 1 and 2, `queued` after them
        await gw.answer_and_rate(f"f{i}", 8, 1.0 if i % 2 else -1.0)
    publisher = SlowPublisher([], "token", tmp_path / "store", bus, "tiny", delay=0.5, fail_at=2)
    try:
        with pytest.raises(RuntimeError, match="replica refused version 2"):
            await asyncio.wait_for(online.run(
                job(tmp_path, batch_size=1, batch_window_s=0, checkpoint_interval=10),
                make_cfg(), tiny_model, online.OnlineMesh(bus, publisher), tmp_path / "run"), 120)
        trained = {s for r in records(tmp_path, "step") if r["version"] == 2 for s in r["seqs"]}
        info = await bus.js.consumer_info("FEEDBACK", DURABLE)
    finally:
        await publisher.close()
        await bus.close()
    assert len(trained) == 1
    assert info.ack_floor.stream_seq == 0 and info.num_ack_pending == queued + 2  # none acked
    assert not list((tmp_path / "run").glob("checkpoints/*/"))


async def test_a_stop_during_a_checkpoint_still_records_the_step_its_acks_cover(
        nats_server, tmp_path, make_cfg, tiny_model) -> None:
    """A SIGTERM that lands while a checkpoint acks its feedback: the acks finish and so does
    the record of the step they cover, so every feedback is either in a step record (and
    acked) or still in JetStream; none is acked unrecorded."""
    from services.trainer.learner.policy import LoraPolicy

    bus = await Bus.connect(nats_server.url, "gateway")
    await bus.ensure_streams()
    gw = Gateway(bus)
    seqs = [await gw.answer_and_rate(f"s{i}", 8, 1.0 if i % 2 else -1.0) for i in range(3)]
    publisher = Publisher([], "token", tmp_path / "store", bus, "tiny")
    policy = LoraPolicy(make_cfg())
    save = policy.save_checkpoint

    def save_then_stop(*args, **kwargs):  # the stop arrives between the checkpoint and its acks
        out = save(*args, **kwargs)
        run.cancel()
        return out

    policy.save_checkpoint = save_then_stop
    run = asyncio.create_task(online.run(
        job(tmp_path, batch_size=1, batch_window_s=0, checkpoint_interval=2),
        make_cfg(), tiny_model, online.OnlineMesh(bus, publisher), tmp_path / "run", policy=policy))
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, 120)
        recorded = [s for r in records(tmp_path, "step") for s in r["seqs"]]
        deadline = time.monotonic() + 10
        while True:  # the server applies acks from its own queue (acks_landed)
            info = await bus.js.consumer_info("FEEDBACK", DURABLE)
            waiting = info.num_pending + info.num_ack_pending
            if len(recorded) + waiting == len(seqs) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    finally:
        await publisher.close()
        await bus.close()
    assert len(recorded) == 2  # both updates of the checkpoint, the second's record included
    assert len(recorded) + waiting == len(seqs), (recorded, info)


async def test_a_second_trainer_of_one_lineage_is_refused_until_the_first_stops(
        nats_server, tmp_path, make_cfg, tiny_model) -> None:
    """Two runs (two run directories) learning the default lineage: the second is refused at
    start, before it restored, consumed or published anything, while the first renews its lease;
    once the first stops, its lease is given up and the lineage is free at once."""
    from hotloop.leases import Holder, LineageLease, LineageTaken, lease_key, leases_kv

    bus = await Bus.connect(nats_server.url, "gateway")
    await bus.ensure_streams()
    await Gateway(bus).answer_and_rate("q0", 8, 1.0)
    first_pub = Publisher([], "token", tmp_path / "a-store", bus, "tiny")
    second_pub = Publisher([], "token", tmp_path / "b-store", bus, "tiny")
    first = asyncio.create_task(online.run(job(tmp_path, batch_size=1, batch_window_s=0), make_cfg(),
                                           tiny_model, online.OnlineMesh(bus, first_pub), tmp_path / "a"))
    try:
        kv = await leases_kv(bus)
        deadline = time.monotonic() + 120
        while not await _has_keys(kv):  # the first holds the lineage
            assert not first.done(), first.exception()
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        with pytest.raises(LineageTaken, match=rf"lineage 'default' is learned by another trainer "
                                               rf"\(pid \d+ on .*, run directory {tmp_path / 'a'}\)"):
            await asyncio.wait_for(online.run(
                job(tmp_path, batch_size=1, batch_window_s=0, durable="second"), make_cfg(), tiny_model,
                online.OnlineMesh(bus, second_pub), tmp_path / "b"), 60)
        assert not first.done()  # the refusal took nothing from the first
        assert not [f for f in (tmp_path / "b-store").rglob("*") if f.is_file()]  # no version stored
        assert not (tmp_path / "b" / "checkpoints").exists()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        # given up at its close: another run holds it without waiting out a lease
        lease = await asyncio.wait_for(LineageLease.claim(bus, "", Holder.here(str(tmp_path / "b"))), 5)
        assert Holder.decode((await kv.get(lease_key(""))).value).run_dir == str(tmp_path / "b")
        await lease.release()
    finally:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await first_pub.close()
        await second_pub.close()
        await bus.close()


async def _has_keys(kv) -> bool:
    from nats.js.errors import NoKeysError

    try:
        return bool(await kv.keys())
    except NoKeysError:
        return False
