"""Many tenants in one online trainer (lanes.py), in-process: a real nats-server (JetStream),
a real gRPC rollout replica that keeps a lineage per tenant without an engine
(`LineageReplica`), the trainer's real gRPC server, and one `LoraPolicy` on the tiny model
shared by every lane. The tests play the gateway: traffic and feedback on each tenant's
subjects, with the gateway's message ids."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from hotloop.bus import Bus, feedback_subject, latest_key, traffic_subject
from hotloop.clients import RolloutClient, TrainerClient
from hotloop.errors import NotFound
from hotloop.proto.v1 import bus_pb2, common_pb2
from services.trainer.config import OnlineConfig
from services.trainer.tenants.lanes import Lanes, lane_dir
from services.trainer.publish import Publisher
from tests.trainer.tenants.lineage_replica import start_replica, traffic

pytestmark = [pytest.mark.slow]
TOKEN = "lanes-admin-token"
DURABLE = "lanes-test"


class Mesh:
    """NATS, the replica, and the gateway's side of the bus."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.served = 0

    async def start(self) -> "Mesh":
        self.replica, self.server, self.addr = await start_replica(TOKEN)
        self.bus = await Bus.connect(self.nats_url, "gateway")
        await self.bus.ensure_streams()
        self.trainer_bus = await Bus.connect(self.nats_url, "trainer")
        return self

    async def feedback(self, tenant: str, score: float = 1.0) -> int:
        """One served choice of `tenant` and its user's rating; returns the stream sequence."""
        self.served += 1
        rid = f"{tenant or 'default'}-{self.served}"
        await self.bus.js_publish_once(traffic_subject(rid, 0), traffic(rid, tenant, self.served),
                                       msg_id=f"{rid}:0")
        fb = bus_pb2.FeedbackEvent(response_id=rid, user="u1", choice=0, score=score,
                                   received_at=time.time(), tenant=tenant)
        return (await self.bus.js_publish_once(feedback_subject(tenant), fb, msg_id=f"{rid}:0:u1")).seq

    def lanes(self, tmp_path: Path, tenants: list[str], policy, cfg, tiny_model, registry=None,
              **kw) -> Lanes:
        job = OnlineConfig(**{"batch_size": 1, **kw}, tenants=tenants, batch_window_s=0,
                           durable=DURABLE, ack_wait_s=30, out_dir=str(tmp_path), run_id="run",
                           max_staleness_versions=1000)

        def publisher_for(tenant: str, store_dir: Path) -> Publisher:
            return Publisher([self.addr], TOKEN, store_dir, self.trainer_bus, "tiny", tenant=tenant)

        self.rollout = RolloutClient(self.addr)
        return Lanes(job, cfg, tiny_model, bus=self.trainer_bus, publisher_for=publisher_for,
                     run_dir=tmp_path / "run", rollout=[self.rollout], policy=policy,
                     registry=registry)

    async def consumer(self, tenant: str):
        return await self.bus.js.consumer_info("FEEDBACK", f"{DURABLE}-{tenant}" if tenant else DURABLE)

    async def kv(self, tenant: str) -> int:
        got = await self.bus.kv_get(latest_key(tenant), common_pb2.VersionInfo)
        return got.version if got is not None else 0

    async def close(self) -> None:
        await self.server.stop(None)
        await self.bus.close()
        await self.trainer_bus.close()


@pytest.fixture
async def mesh(nats_server):
    m = await Mesh(nats_server.url).start()
    yield m
    await m.close()


def steps(tmp_path: Path, tenant: str) -> list[dict]:
    path = lane_dir(tmp_path / "run", tenant) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if "step" in r]


async def until(cond, what: str, timeout_s: float = 90, task: asyncio.Task | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if task is not None and task.done():
            task.result()  # its error
            raise AssertionError(f"the lanes ended before {what}")
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_two_tenants_train_their_own_lineages_and_a_burst_does_not_starve_the_quiet_one(
        mesh, tmp_path, make_cfg, tiny_model):
    from prometheus_client import CollectorRegistry

    from hotloop import metrics
    from services.trainer.learner.policy import LoraPolicy
    from services.trainer.server import TrainerState, serve
    from tests.scrape import scrape

    registry = CollectorRegistry()
    lanes = mesh.lanes(tmp_path, ["", "acme"], LoraPolicy(make_cfg()), make_cfg(), tiny_model,
                       registry=registry)
    server, port, _ = await serve(TrainerState(), lanes.store, "127.0.0.1:0", TOKEN)
    endpoint = metrics.serve(registry)
    task = asyncio.create_task(lanes.run())
    try:
        await until(lambda: set(lanes.lanes) == {"", "acme"} and all(
            lane.online.started.is_set() for lane in lanes.lanes.values()), "both lanes consume",
            task=task)
        bursty = [await mesh.feedback("", 1.0 if i % 2 else -1.0) for i in range(8)]
        await until(lambda: len(steps(tmp_path, "")) >= 2, "the burst trains", task=task)
        granted_before = len(lanes.turns.grants)
        quiet = [await mesh.feedback("acme", 1.0)]
        await until(lambda: len(steps(tmp_path, "")) == 8 and len(steps(tmp_path, "acme")) == 1,
                    "every feedback trains", task=task)
        # the quiet tenant became ready with six of the burst's updates still to come: the
        # fair share granted it right after the update that was running or next in line
        quiet_at = lanes.turns.grants.index("acme")
        assert quiet_at <= granted_before + 2, (granted_before, lanes.turns.grants)
        versions = {t: lanes.lanes[t].online.version for t in ("", "acme")}
        got = await scrape(endpoint.port)
        client = TrainerClient(f"127.0.0.1:{port}", TOKEN)
        try:
            info, chunks = await client.fetch_adapter(0, tenant="acme")
            data = b"".join([c async for c in chunks])
            with pytest.raises(NotFound):
                await client.fetch_adapter(0, tenant="nobody")
        finally:
            await client.close()
        with pytest.raises(NotFound):
            lanes.store("nobody")
    finally:
        await stop(task)
        endpoint.close()
        await server.stop(None)
        await mesh.rollout.close()

    assert sorted(s for r in steps(tmp_path, "") for s in r["seqs"]) == bursty
    assert [s for r in steps(tmp_path, "acme") for s in r["seqs"]] == quiet
    for tenant, v in versions.items():  # each lineage's versions went to its own key and lineage
        assert await mesh.kv(tenant) == v
        assert mesh.replica.latest[tenant] == v
        assert [r["version"] for r in steps(tmp_path, tenant)][-1] == v
        info_c = await mesh.consumer(tenant)
        assert info_c.num_ack_pending == 0 and info_c.num_pending == 0
    assert all("turn_wait" in r["stage_seconds"] for t in versions for r in steps(tmp_path, t))
    pushed = {t: [v for tt, v in mesh.replica.pushes if tt == t] for t in versions}
    assert pushed[""] == sorted(pushed[""]) and len(pushed[""]) >= 8 and len(pushed["acme"]) >= 1
    assert info.version == versions["acme"] and len(data) == info.bytes
    assert got.value("hotloop_trainer_steps_total", result="published", tenant="acme") == 1
    assert got.value("hotloop_trainer_steps_total", result="published", tenant="") == 8
    assert got.value("hotloop_trainer_feedback_trained_total", tenant="acme") == 1
    assert got.value("hotloop_trainer_version", tenant="acme") == versions["acme"]
    # the default lineage kept the single-tenant layout; the others are under tenants/
    assert (tmp_path / "run" / "checkpoints").is_dir()
    assert (tmp_path / "run" / "tenants" / "acme" / "checkpoints").is_dir()


async def test_tenants_are_added_reset_and_removed_at_runtime(mesh, tmp_path, make_cfg, tiny_model):
    import torch

    from services.trainer.learner.checkpoint import latest_checkpoint
    from services.trainer.learner.policy import LoraPolicy

    policy = LoraPolicy(make_cfg())
    initial = [p.detach().clone() for p in policy.trainable_tensors()]
    names = [n.replace(".default", "") for n, _ in policy.trainable_parameters()]  # as saved
    # each version serves a running average of the lane's adapter (`serve_average`)
    lanes = mesh.lanes(tmp_path, ["acme"], policy, make_cfg(), tiny_model, serve_average=0.5)
    task = asyncio.create_task(lanes.run())
    try:
        await until(lambda: "acme" in lanes.lanes and lanes.lanes["acme"].online.started.is_set(),
                    "acme consumes", task=task)
        with pytest.raises(ValueError, match="already"):
            await lanes.add_tenant("acme")
        with pytest.raises(ValueError, match="tenant name"):
            await lanes.add_tenant("Not A Name")
        await lanes.add_tenant("beta")  # returns once beta's lane consumes
        b1 = await mesh.feedback("beta")
        a1 = await mesh.feedback("acme")
        await until(lambda: steps(tmp_path, "beta") and steps(tmp_path, "acme"), "both train",
                    task=task)
        trained_v = steps(tmp_path, "acme")[-1]["version"]
        assert steps(tmp_path, "beta")[0]["seqs"] == [b1]

        # ---- reset acme: base weights, published above its lineage, checkpointed, all of it
        # under the lineage's lease: released between the loops, another trainer could claim
        # acme there and publish beside the reset
        from hotloop.leases import Holder, lease_key, leases_kv

        kv = await leases_kv(mesh.bus)
        owner = Holder.decode((await kv.get(lease_key("acme"))).value).owner
        lease = lanes.lanes["acme"].online.lease
        publisher, at_publish = lanes.lanes["acme"].mesh.publisher, []
        inner = publisher.publish

        async def publish(version, adapter):
            entry = await kv.get(lease_key("acme"))  # gone: KeyNotFoundError fails the reset
            at_publish.append(Holder.decode(entry.value).owner)
            return await inner(version, adapter)

        publisher.publish = publish
        try:
            v = await lanes.reset_tenant("acme")
        finally:
            publisher.publish = inner
        assert at_publish == [owner]
        assert lanes.lanes["acme"].online.lease is lease and not lease.lost  # handed over
        assert Holder.decode((await kv.get(lease_key("acme"))).value).owner == owner
        assert v > trained_v
        assert mesh.replica.latest["acme"] == v and await mesh.kv("acme") == v
        ckpt = latest_checkpoint(tmp_path / "run" / "tenants" / "acme" / "checkpoints")
        position = json.loads((ckpt / "state.json").read_text())["data_position"]
        assert position["version"] == v and position["baseline"] == 0.0
        assert a1 in position["trained"] or (await mesh.consumer("acme")).ack_floor.stream_seq >= a1
        state = lanes.turns.adapters.state("acme")
        assert all(torch.equal(t, i) for t, i in zip(state.params, initial)) and not state.optimizer
        a2 = await mesh.feedback("acme")
        await until(lambda: len(steps(tmp_path, "acme")) == 2, "acme trains after its reset",
                    task=task)
        rec = steps(tmp_path, "acme")[-1]
        assert rec["seqs"] == [a2] and rec["version"] == v + 1  # a1 was not trained again
        # the average started over at the base: v + 1 is half the base, half the update
        published = _adapter(lanes.store("acme").archive(v + 1))
        trained = lanes.turns.adapters.state("acme").params
        assert not all(torch.equal(t, i) for t, i in zip(trained, initial))
        for name, t, i in zip(names, trained, initial):
            torch.testing.assert_close(published[name], 0.5 * i + 0.5 * t)

        # ---- remove beta: its consumer goes, its feedback stays in the stream
        beta_dir = tmp_path / "run" / "tenants" / "beta"
        aside = await lanes.remove_tenant("beta")
        assert not beta_dir.exists() and (aside / "checkpoints").is_dir()
        with pytest.raises(NotFoundError):
            await mesh.consumer("beta")
        before = (await mesh.bus.js.stream_info("FEEDBACK")).state.messages
        b2 = await mesh.feedback("beta")  # nobody trains beta now; the stream keeps it
        assert (await mesh.bus.js.stream_info("FEEDBACK")).state.messages == before + 1
        with pytest.raises(NotFound):
            lanes.store("beta")
        with pytest.raises(NotFound):
            await lanes.reset_tenant("beta")
        a3 = await mesh.feedback("acme")  # the other lane goes on
        await until(lambda: len(steps(tmp_path, "acme")) == 3, "acme trains on", task=task)
        assert steps(tmp_path, "acme")[-1]["seqs"] == [a3]
        assert not task.done()
    finally:
        await stop(task)
        await mesh.rollout.close()
    assert b2 > b1
    assert [t for t, _ in mesh.replica.pushes].count("beta") == 1


def _adapter(archive: Path) -> dict:
    """The adapter tensors in a stored version's archive."""
    from safetensors.torch import load

    from hotloop.adapters import read_archive

    return load(bytes(read_archive(archive)["adapter_model.safetensors"]))


async def test_turns_one_at_a_time_short_ones_first_and_a_stopped_waiter_leaves_no_trace(make_cfg):
    from services.trainer.learner.policy import LoraPolicy
    from services.trainer.tenants.lanes import Turns

    turns = Turns(LoraPolicy(make_cfg()))
    for t in ("a", "b"):
        turns.add(t)
    order: list[str] = []
    a_in = asyncio.Event()
    release_a = asyncio.Event()

    async def use(tenant: str, train: bool, hold: asyncio.Event | None = None, tokens: int = 0):
        async with turns.turn(tenant, train) as grant:
            order.append(f"{tenant}:{'train' if train else 'short'}")
            assert turns.adapters.current == tenant and turns.holder == tenant
            if hold is not None:
                a_in.set()
                await hold.wait()
            grant.tokens = tokens

    first = asyncio.create_task(use("a", True, release_a, tokens=100))
    await a_in.wait()
    b_train = asyncio.create_task(use("b", True, tokens=10))
    gone = asyncio.create_task(use("a", False))  # a short turn, stopped before it is granted
    b_short = asyncio.create_task(use("b", False))
    await asyncio.sleep(0.05)
    assert order == ["a:train"]  # one at a time
    gone.cancel()
    release_a.set()
    await asyncio.gather(first, b_train, b_short)
    assert order == ["a:train", "b:short", "b:train"]  # the short turn first
    assert turns.fair.vtime == {"a": 100, "b": 10}

    # a training waiter that stops is withdrawn; the next grant goes on as if it never asked
    release_a.clear()
    a_in.clear()
    holder = asyncio.create_task(use("b", True, release_a, tokens=5))
    await a_in.wait()
    waiter = asyncio.create_task(use("a", True))
    await asyncio.sleep(0.05)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert turns.fair.waiting() == []
    release_a.set()
    await holder
    assert turns.holder is None and turns.grants == ["a", "b", "b"]
    turns.remove("a")
    with pytest.raises(KeyError):
        turns.adapters.use("a")


async def test_a_reset_to_one_of_its_versions_publishes_it_again_and_trains_on_from_it(
        mesh, tmp_path, make_cfg, tiny_model):
    """`reset_tenant(t, to_version=N)` (the admin API's reset with a version): the lineage's
    version N, read from its store, is published as the next version with no optimizer state,
    and training goes on from it. A version the store does not hold is NotFound, one it holds
    damaged VersionUnusable, and the lane goes on untouched."""
    import torch

    from hotloop.adapters import read_archive
    from hotloop.errors import NotFound
    from services.trainer.learner.policy import LoraPolicy
    from services.trainer.recipes.online import VersionUnusable

    policy = LoraPolicy(make_cfg())
    lanes = mesh.lanes(tmp_path, ["acme"], policy, make_cfg(), tiny_model)
    task = asyncio.create_task(lanes.run())
    try:
        await until(lambda: "acme" in lanes.lanes and lanes.lanes["acme"].online.started.is_set(),
                    "acme consumes", task=task)
        for i, score in enumerate((1.0, -1.0, 1.0)):
            await mesh.feedback("acme", score)
            await until(lambda: len(steps(tmp_path, "acme")) == i + 1, f"update {i + 1}", task=task)
        first, last = steps(tmp_path, "acme")[0]["version"], steps(tmp_path, "acme")[-1]["version"]
        store = lanes.store("acme")
        want = policy.read_adapter(read_archive(store.archive(first)))
        now = policy.read_adapter(read_archive(store.archive(last)))
        assert not all(torch.equal(a, b) for a, b in zip(want, now))  # training moved it

        online = lanes.lanes["acme"].online
        with pytest.raises(NotFound, match="not in the trainer's store"):
            await lanes.reset_tenant("acme", to_version=last + 5)
        assert lanes.lanes["acme"].online is online and not task.done()  # untouched
        good = store.archive(last).read_bytes()
        store.archive(last).write_bytes(good[:1000])
        with pytest.raises(VersionUnusable, match=f"v{last} in the store is not an adapter"):
            await lanes.reset_tenant("acme", to_version=last)
        assert lanes.lanes["acme"].online is online and not task.done()  # untouched
        store.archive(last).write_bytes(good)

        v = await lanes.reset_tenant("acme", to_version=first)
        assert v == last + 1 and mesh.replica.latest["acme"] == v and await mesh.kv("acme") == v
        again = policy.read_adapter(read_archive(store.archive(v)))
        assert all(torch.equal(a, b) for a, b in zip(again, want))
        state = lanes.turns.adapters.state("acme")
        assert all(torch.equal(t, w) for t, w in zip(state.params, want)) and not state.optimizer
        seq = await mesh.feedback("acme")
        await until(lambda: len(steps(tmp_path, "acme")) == 4, "acme trains on", task=task)
        rec = steps(tmp_path, "acme")[-1]
        assert rec["version"] == v + 1 and rec["seqs"] == [seq]
    finally:
        await stop(task)
        await mesh.rollout.close()
