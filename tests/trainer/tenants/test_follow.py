"""A multi-tenant trainer following the tenant registry (follow.py): tenants created, reset,
held and deleted through the registry (as the gateway's admin API writes it) start, reset,
hold and stop lanes. Real nats-server, the registry's real KV bucket, a real gRPC replica that keeps a
lineage per tenant (`LineageReplica`), one shared `LoraPolicy` on the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from nats.js.errors import NotFoundError

from hotloop.bus import announced_key
from hotloop.proto.v1 import bus_pb2
from hotloop.tenants import Registry
from services.trainer.tenants.follow import RegistryFollower, held_tenants
from tests.trainer.tenants.test_lanes import DURABLE, TOKEN, Mesh, steps, stop, until

pytestmark = [pytest.mark.slow]
MAX_WAIT_S = 2.0  # the held lineage's test: its feedback waits longer than this, held


@pytest.fixture
async def mesh(nats_server):
    m = await Mesh(nats_server.url).start()
    yield m
    await m.close()


def b_tensors(policy) -> list:
    """The LoRA B matrices (zero at the fresh init: the adapter is the base model)."""
    return [p.detach().clone() for n, p in policy.trainable_parameters() if "lora_B" in n]


async def test_created_reset_and_deleted_tenants_start_reset_and_stop_lanes(
        mesh, tmp_path, make_cfg, tiny_model):
    from services.trainer.learner.policy import LoraPolicy

    registry = Registry(mesh.bus)  # the gateway's side
    await registry.create("early")  # created before the trainer starts: replayed at start
    policy = LoraPolicy(make_cfg())
    lanes = mesh.lanes(tmp_path, [], policy, make_cfg(), tiny_model, follow_registry=True)
    state = tmp_path / "run" / "registry.json"
    ready = asyncio.Event()
    lanes.follow = lambda lanes: RegistryFollower(lanes, Registry(mesh.trainer_bus),
                                                  mesh.trainer_bus, state).run(ready)
    task = asyncio.create_task(lanes.run())
    try:
        await until(lambda: ready.is_set() and set(lanes.lanes) == {"", "early"},
                    "the replayed tenant has a lane", task=task)
        await registry.create("acme")
        await until(lambda: "acme" in lanes.lanes and lanes.lanes["acme"].online.started.is_set(),
                    "a created tenant gets a lane", task=task)
        await mesh.feedback("acme", 1.0)
        await until(lambda: len(steps(tmp_path, "acme")) == 1, "acme's feedback trains", task=task)
        trained = await mesh.kv("acme")
        async with lanes.turns.turn("acme"):
            assert any(float(b.abs().max()) > 0 for b in b_tensors(policy))  # trained away from base

        # reset: a new version above the trained one, and the lane's adapter is the base again
        await registry.reset("acme")
        await until(lambda: lanes.lanes["acme"].online.version > trained, "the reset publishes",
                    task=task)
        assert await mesh.kv("acme") > trained
        async with lanes.turns.turn("acme"):
            assert all(float(b.abs().max()) == 0 for b in b_tensors(policy))
        await until(lambda: '"acme": 1' in state.read_text(), "the generation applied is kept "
                    "for a restart", task=task)

        # delete: the lane stops, its consumer and its lineage's KV key go, the name is free
        reset_version = await mesh.kv("acme")
        await registry.delete("acme")
        await until(lambda: "acme" not in lanes.lanes, "a deleted tenant's lane stops", task=task)
        await until(lambda: not (tmp_path / "run" / "tenants" / "acme").exists(), "files moved aside",
                    task=task)
        assert await mesh.kv("acme") == 0
        assert await mesh.bus.kv_get(announced_key("acme"), bus_pb2.WeightsUpdated) is None
        with pytest.raises(Exception, match="consumer not found"):
            await mesh.consumer("acme")
        # what the replica serves for the deleted lineage is the base model (the reset's version)
        status = await mesh.rollout.status()
        served = {t.tenant: int(t.latest_version) for t in status.tenants}
        assert served.get("acme", 0) >= reset_version
        assert set(lanes.lanes) == {"", "early"}  # the others go on
        await mesh.feedback("early", 1.0)
        await until(lambda: len(steps(tmp_path, "early")) == 1, "another tenant still trains",
                    task=task)
    finally:
        await stop(task)


async def test_a_reset_made_while_the_trainer_was_down_is_applied_once(
        mesh, tmp_path, make_cfg, tiny_model):
    from services.trainer.learner.policy import LoraPolicy

    registry = Registry(mesh.bus)
    await registry.create("acme")
    state = tmp_path / "run" / "registry.json"
    policy = LoraPolicy(make_cfg())

    async def run_until(cond, what: str):
        lanes = mesh.lanes(tmp_path, [""], policy, make_cfg(), tiny_model, follow_registry=True)
        ready = asyncio.Event()
        lanes.follow = lambda lanes: RegistryFollower(lanes, Registry(mesh.trainer_bus),
                                                      mesh.trainer_bus, state).run(ready)
        task = asyncio.create_task(lanes.run())
        try:
            await until(lambda: ready.is_set() and "acme" in lanes.lanes and cond(lanes), what,
                        task=task)
            return lanes.lanes["acme"].online.version
        finally:
            await stop(task)

    first = await run_until(lambda lanes: True, "acme's lane starts")
    await registry.reset("acme")  # while no trainer runs
    second = await run_until(lambda lanes: lanes.lanes["acme"].online.version > first,
                             "the missed reset is applied at start")
    third = await run_until(lambda lanes: True, "a start with nothing missed")
    assert third == second  # applied once: no second reset on the next start


async def test_a_held_lineage_takes_no_update_until_it_is_resumed(
        mesh, tmp_path, make_cfg, tiny_model):
    from services.trainer.learner.policy import LoraPolicy

    registry = Registry(mesh.bus)
    await registry.create("acme")
    await registry.hold("acme")  # held while no trainer runs: held from its lane's start
    await registry.hold("cfg", config=True)  # a config tenant too, before its lane consumes
    await mesh.feedback("cfg", 1.0)  # its backlog
    policy = LoraPolicy(make_cfg())
    lanes = mesh.lanes(tmp_path, ["", "cfg"], policy, make_cfg(), tiny_model, follow_registry=True,
                       batch_size=2, max_wait_s=MAX_WAIT_S)
    lanes.held = await held_tenants(Registry(mesh.trainer_bus))  # as the trainer's job does
    ready = asyncio.Event()
    lanes.follow = lambda lanes: RegistryFollower(lanes, Registry(mesh.trainer_bus),
                                                  mesh.trainer_bus, tmp_path / "registry.json").run(ready)
    task = asyncio.create_task(lanes.run())
    try:
        await until(lambda: ready.is_set() and "acme" in lanes.lanes, "acme's lane starts", task=task)
        acme = lanes.lanes["acme"].online
        held_at = await mesh.kv("acme")
        await mesh.feedback("acme", 1.0)
        await mesh.feedback("acme", -1.0)
        await until(lambda: acme.queue.qsize() == 2 and lanes.lanes["cfg"].online.queue.qsize() == 1,
                    "the held lanes' feedback reaches their queues", task=task)
        # another lineage trains meanwhile; the held one took its feedback and no update
        await mesh.feedback("", 1.0)
        await until(lambda: len(steps(tmp_path, "")) == 1, "the default lineage trains", task=task)
        assert steps(tmp_path, "acme") == [] and acme.queue.qsize() == 2
        assert await mesh.kv("acme") == held_at and acme.version == held_at
        assert steps(tmp_path, "cfg") == [] and lanes.lanes["cfg"].online.queue.qsize() == 1
        await registry.hold("cfg", False, config=True)
        await until(lambda: len(steps(tmp_path, "cfg")) == 1, "the config tenant, resumed, trains",
                    task=task)

        # both waited past max_wait_s, held: on resume they train, none is shed as too old
        await until(lambda: time.monotonic() - acme.queue.newest().arrived > MAX_WAIT_S,
                    "acme's feedback waits past max_wait_s", task=task)
        await registry.hold("acme", False)
        await until(lambda: len(steps(tmp_path, "acme")) == 1, "resumed, it trains what waited",
                    task=task)
        (step,) = steps(tmp_path, "acme")
        assert step["feedback"] == 2 and step["shed"] == 0
        assert step["queue_wait_s"] > MAX_WAIT_S  # the wait it reports is the whole wait
        assert await mesh.kv("acme") == held_at + 1

        # held again while it learns: the next feedback waits, and a reset keeps the hold
        await registry.hold("acme")
        await until(lambda: not acme.learning.is_set(), "the hold reaches the lane", task=task)
        await registry.reset("acme")
        await until(lambda: lanes.lanes["acme"].online is not acme
                    and lanes.lanes["acme"].online.started.is_set(), "the reset restarts the lane",
                    task=task)
        reset_version = await mesh.kv("acme")
        assert reset_version == held_at + 2  # the base model, published by the reset
        await mesh.feedback("acme", 1.0)
        again = lanes.lanes["acme"].online
        await until(lambda: again.queue.qsize() == 1, "the feedback reaches the new lane", task=task)
        await mesh.feedback("", 1.0)
        await until(lambda: len(steps(tmp_path, "")) == 2, "the default lineage trains", task=task)
        assert len(steps(tmp_path, "acme")) == 1 and await mesh.kv("acme") == reset_version
    finally:
        await stop(task)


async def test_two_trainers_following_the_registry_split_its_tenants_first_come(
        mesh, tmp_path, make_cfg, tiny_model, caplog):
    """Each created tenant is learned by one trainer: the first to claim its lineage. The other,
    refused (`hotloop.leases`), leaves it alone and goes on with its own lanes."""
    from services.trainer.learner.policy import LoraPolicy

    caplog.set_level("INFO", logger="services.trainer.tenants.follow")
    registry = Registry(mesh.bus)
    runs = []
    for name, own in (("t1", "own1"), ("t2", "own2")):
        lanes = mesh.lanes(tmp_path / name, [own], LoraPolicy(make_cfg()), make_cfg(), tiny_model,
                           follow_registry=True)
        ready = asyncio.Event()
        lanes.follow = lambda lanes, ready=ready, name=name: RegistryFollower(
            lanes, Registry(mesh.trainer_bus), mesh.trainer_bus,
            tmp_path / name / "registry.json").run(ready)
        runs.append((lanes, ready, asyncio.create_task(lanes.run())))
    try:
        for lanes, ready, task in runs:
            await until(lambda: ready.is_set() and len(lanes.lanes) == 1, "each trainer's own lane",
                        task=task)
        await registry.create("acme")
        await until(lambda: sum("acme" in lanes.lanes for lanes, _, _ in runs) == 1
                    and all(lanes.lanes.get("acme") is None or lanes.lanes["acme"].online.started.is_set()
                            for lanes, _, _ in runs), "one trainer learns acme", task=runs[0][2])
        # the other's claim sees the holder renew its lease (every 10 s) and gives up
        await until(lambda: "tenant 'acme': not trained here: lineage 'acme' is learned by another "
                    "trainer" in caplog.text, "the other trainer is refused", timeout_s=60, task=runs[1][2])
        assert sum("acme" in lanes.lanes for lanes, _, _ in runs) == 1
        assert not any(task.done() for _, _, task in runs)  # the refusal stopped neither
        holder = next(lanes for lanes, _, _ in runs if "acme" in lanes.lanes)
        await mesh.feedback("acme", 1.0)
        await until(lambda: holder.lanes["acme"].online.version >= 1 and len(steps(
            holder.run_dir.parent, "acme")) == 1, "acme's feedback trains where its lane is",
            task=runs[0][2])
    finally:
        for _, _, task in runs:
            await stop(task)


def mesh_config(mesh, tiny_model):
    """The trainer's view of the mesh: the test's NATS and replica, the replica's admin token."""
    from hotloop.config import MeshConfig

    return MeshConfig.model_validate({
        "nats": {"url": mesh.nats_url}, "endpoints": {"rollout": [mesh.addr]},
        "security": {"admin_token": TOKEN}, "model": {"name": str(tiny_model)}})


def online_job(tmp_path, **kw):
    from services.trainer.config import OnlineConfig

    return OnlineConfig(**{"batch_size": 1, "batch_window_s": 0, "durable": DURABLE, "ack_wait_s": 30,
                           "out_dir": str(tmp_path), "run_id": "run",
                           "max_staleness_versions": 1000, **kw})


async def test_a_trainer_of_config_lanes_applies_the_registry_s_resets_and_holds_of_them_only(
        mesh, tmp_path, make_cfg, tiny_model):
    """Without `follow_registry` (the trainer's job wiring, `open_lanes`): a reset or a hold
    through the admin API of a lineage it trains is applied, as by a trainer that follows
    the registry; a tenant created there starts no lane here."""
    from services.trainer.runner import close_lanes, open_lanes

    registry = Registry(mesh.bus)
    await registry.hold("cfg", config=True)  # held before the trainer starts
    await registry.create("acme")  # not this trainer's
    edge, lanes = await open_lanes(mesh_config(mesh, tiny_model),
                                   online_job(tmp_path, tenants=["", "cfg"]), make_cfg())
    task = asyncio.create_task(lanes.run())
    try:
        await until(lambda: "cfg" in lanes.lanes and lanes.lanes["cfg"].online.started.is_set(),
                    "the config lanes start", task=task)
        cfg = lanes.lanes["cfg"].online
        assert not cfg.learning.is_set()
        await mesh.feedback("cfg", 1.0)
        await until(lambda: cfg.queue.qsize() == 1, "the held lane takes its feedback", task=task)
        await mesh.feedback("", 1.0)
        await until(lambda: len(steps(tmp_path, "")) == 1, "the default lineage trains", task=task)
        assert steps(tmp_path, "cfg") == [] and await mesh.kv("cfg") == 0
        await registry.hold("cfg", False, config=True)
        await until(lambda: len(steps(tmp_path, "cfg")) == 1, "resumed, it trains", task=task)
        assert await mesh.kv("cfg") == 1

        await registry.reset("cfg", config=True)
        await until(lambda: lanes.lanes["cfg"].online is not cfg
                    and lanes.lanes["cfg"].online.started.is_set(), "the reset restarts the lane",
                    task=task)
        assert await mesh.kv("cfg") == 2  # the base model, published by the reset
        assert sorted(lanes.lanes) == ["", "cfg"]  # acme is left to a trainer that follows
    finally:
        await stop(task)
        await close_lanes(edge, lanes)


async def test_config_lanes_end_at_max_steps_beside_the_registry(mesh, tmp_path, make_cfg, tiny_model):
    """The hold-and-reset follower does not keep a trainer up past its last update (only
    one that adds lanes from the registry waits for tenants to come)."""
    from services.trainer.runner import close_lanes, open_lanes

    edge, lanes = await open_lanes(mesh_config(mesh, tiny_model),
                                   online_job(tmp_path, tenants=[""], max_steps=1), make_cfg())
    assert lanes.follow is not None
    task = asyncio.create_task(lanes.run())
    try:
        await until(lambda: "" in lanes.lanes, "the lane starts", task=task)
        await mesh.feedback("", 1.0)
        summaries = await asyncio.wait_for(task, 90)
        assert summaries[""]["version"] == 1 and summaries[""]["updates"] == 1
    finally:
        if not task.done():
            await stop(task)
        await close_lanes(edge, lanes)


async def one_lineage(mesh, tmp_path, make_cfg, tiny_model):
    """A trainer of the one named lineage "cfg" (`[online] tenant`; the trainer's wiring,
    `open_online`), running: (job, edge, its mesh, run dir, policy, task)."""
    from services.trainer.learner.policy import LoraPolicy
    from services.trainer.recipes import online
    from services.trainer.runner import open_online

    job = online_job(tmp_path, tenant="cfg")
    edge, omesh, run_dir = await open_online(mesh_config(mesh, tiny_model), job, make_cfg())
    policy = LoraPolicy(make_cfg())
    task = asyncio.create_task(online.run(job, make_cfg(), tiny_model, omesh, run_dir,
                                          policy=policy))
    return job, edge, omesh, run_dir, policy, task


async def test_a_trainer_of_one_named_lineage_applies_the_registry_s_hold_and_reset(
        mesh, tmp_path, make_cfg, tiny_model):
    """`[online] tenant = "cfg"` (no lanes; the trainer's wiring, `open_online`): the hold
    holds its lineage, read before its first update; a reset publishes the base model as its
    next version and the loop goes on from there; a reset made while it was down is applied
    once when it is back, and not again after."""
    from services.trainer.recipes import online
    from services.trainer.runner import close_online

    registry = Registry(mesh.bus)
    await registry.hold("cfg", config=True)
    job, edge, omesh, run_dir, policy, task = await one_lineage(mesh, tmp_path, make_cfg,
                                                                tiny_model)
    try:
        await mesh.feedback("cfg", 1.0)
        held_s = 1.5
        info = None
        deadline = time.monotonic() + 60
        while info is None or info.num_ack_pending != 1:  # fetched into the held loop's queue
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.05)
            with contextlib.suppress(NotFoundError):  # until the loop has made it
                info = await mesh.consumer("cfg")
        await asyncio.sleep(held_s)
        assert steps(tmp_path, "") == [] and await mesh.kv("cfg") == 0
        await registry.hold("cfg", False, config=True)
        await until(lambda: len(steps(tmp_path, "")) == 1, "resumed, it trains", task=task)
        (step,) = steps(tmp_path, "")
        assert step["queue_wait_s"] > held_s and await mesh.kv("cfg") == 1
        assert any(float(b.abs().max()) > 0 for b in b_tensors(policy))  # trained away from base

        # reset: the base model is the lineage's next version, checkpointed; training goes on.
        # The lineage's lease stays held from the loop's stop to the next loop's start: never
        # deleted in between, where another trainer could claim it and publish beside the reset.
        from hotloop.leases import lease_key, leases_kv

        watcher = await (await leases_kv(mesh.bus)).watch(lease_key("cfg"))
        await registry.reset("cfg", config=True)
        await until(lambda: '"cfg": 1' in (run_dir / "registry.json").read_text()
                    if (run_dir / "registry.json").exists() else False,
                    "the reset is applied and kept for a restart", task=task)
        assert await mesh.kv("cfg") == 2
        await watcher.stop()
        ops = [e.operation async for e in watcher if e is not None]
        assert ops and "DEL" not in ops and "PURGE" not in ops, ops
        assert all(float(b.abs().max()) == 0 for b in b_tensors(policy))
        await mesh.feedback("cfg", 1.0)
        await until(lambda: len(steps(tmp_path, "")) == 2, "after the reset, it trains again",
                    task=task)
        assert await mesh.kv("cfg") == 3
        await stop(task)
        # cancelled, the call leaves neither the loop nor the registry's follower running
        assert not [t for t in asyncio.all_tasks() if t.get_name() in ("online-loop", "registry-hold")]

        # a reset while no trainer runs: applied once when it is back, not again after
        await registry.reset("cfg", config=True)
        task = asyncio.create_task(online.run(job, make_cfg(), tiny_model, omesh, run_dir))
        await until(lambda: '"cfg": 2' in (run_dir / "registry.json").read_text(),
                    "the missed reset is applied at start", task=task)
        assert await mesh.kv("cfg") == 4
        await stop(task)
        task = asyncio.create_task(online.run(job, make_cfg(), tiny_model, omesh, run_dir))
        # A reset made now is read after the replay of generation 2 (the registry is read in
        # commit order), so once it is applied the replay was too: one reset since the start,
        # version 5, where a replayed generation 2 would have made it 6.
        await registry.reset("cfg", config=True)
        await until(lambda: '"cfg": 3' in (run_dir / "registry.json").read_text(),
                    "the reset made after the third start is applied", task=task)
        assert await mesh.kv("cfg") == 5
    finally:
        if not task.done():
            await stop(task)
        await close_online(edge, omesh)


async def test_a_one_lineage_trainer_resets_to_the_version_the_registry_names(
        mesh, tmp_path, make_cfg, tiny_model):
    """A registry reset with `to_version` N (the admin API's reset with a version) publishes
    the lineage's version N again as its next version; one its store does not hold, or holds
    damaged, is logged and skipped (the gateway checks before it writes), training going on."""
    import torch

    from hotloop.adapters import read_archive
    from services.trainer.runner import close_online

    registry = Registry(mesh.bus)
    job, edge, omesh, run_dir, policy, task = await one_lineage(mesh, tmp_path, make_cfg,
                                                                tiny_model)
    try:
        for i in range(2):
            await mesh.feedback("cfg", 1.0)
            await until(lambda: len(steps(tmp_path, "")) == i + 1, f"update {i + 1}", task=task)
        assert await mesh.kv("cfg") == 2
        store = omesh.publisher.store
        await registry.reset("cfg", config=True, to_version=9)  # not stored: skipped
        await until(lambda: '"cfg": 1' in (run_dir / "registry.json").read_text()
                    if (run_dir / "registry.json").exists() else False, "the reset is seen",
                    task=task)
        assert await mesh.kv("cfg") == 2 and not task.done()
        good = store.archive(2).read_bytes()
        store.archive(2).write_bytes(good[:1000])  # a damaged archive: skipped, not fatal
        await registry.reset("cfg", config=True, to_version=2)
        await until(lambda: '"cfg": 2' in (run_dir / "registry.json").read_text(),
                    "the reset to a damaged v2 is seen", task=task)
        assert await mesh.kv("cfg") == 2 and not task.done()
        store.archive(2).write_bytes(good)
        await registry.reset("cfg", config=True, to_version=1)
        await until(lambda: '"cfg": 3' in (run_dir / "registry.json").read_text(),
                    "the reset to v1 is applied", task=task)
        assert await mesh.kv("cfg") == 3
        v1, v3 = (policy.read_adapter(read_archive(store.archive(v))) for v in (1, 3))
        assert all(torch.equal(a, b) for a, b in zip(v1, v3))
        await mesh.feedback("cfg", 1.0)
        await until(lambda: len(steps(tmp_path, "")) == 3, "it trains on", task=task)
        assert await mesh.kv("cfg") == 4
    finally:
        if not task.done():
            await stop(task)
        await close_online(edge, omesh)
