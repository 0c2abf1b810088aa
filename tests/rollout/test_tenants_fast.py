"""Tenants without an engine: names, the slot manager's bookkeeping (LRU, references, the
bounded wait) against a worker stand-in that records its RPCs, and the lora path's mapping
(one LoRARequest per tenant version), which runs on CUDA only and is checked here for its
imports and config. The real engine: test_tenant_slots.py, test_rollout_tenants.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hotloop import adapters
from hotloop.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from services.rollout.config import RolloutConfig
from services.rollout.core import LoraUpdater, MergedUpdater, make_updater
from services.rollout.tenants import (
    BASE,
    LABEL_KEY,
    LoraSlots,
    NoSlots,
    SlotMetrics,
    WorkerSlots,
)


class Worker:
    """What a worker's slot table would hold after the RPCs it was sent."""

    def __init__(self, n: int):
        self.labels: list[str | None] = [None] * n
        self.calls: list[tuple] = []

    async def collective_rpc(self, method: str, args=(), kwargs=None):
        self.calls.append((method, *args))
        if method == "hotloop_slot_load":
            slot, label, _ = args
            self.labels[slot] = label
            return [{"slot": slot, "label": label, "bytes": self.BYTES}]
        elif method == "hotloop_slot_free":
            self.labels[args[0]] = None
        return [{}]

    BYTES = 1000  # what each loaded adapter's factors take, as the worker reports it


@pytest.mark.parametrize("name", ["acme", "a", "team-7_x", "0" * 32, ""])
def test_good_tenant_names_are_parsed_at_the_grpc_edge(name):
    from hotloop.proto.v1 import rollout_pb2
    from hotloop.tenants import TenantId
    from services.rollout.server import generate_input

    got = generate_input(rollout_pb2.GenerateRequest(tenant=name)).tenant
    assert got == name and type(got) is TenantId


@pytest.mark.parametrize("name", ["Acme", "a b", "-x", "_x", "x/y", "../x", "0" * 33, "é", "a\n"])
def test_bad_tenant_names_are_invalid_arguments_at_the_grpc_edge(name):
    from hotloop.proto.v1 import rollout_pb2
    from services.rollout.core import GenerateInput
    from services.rollout.server import generate_input

    with pytest.raises(InvalidArgument, match="tenant"):
        generate_input(rollout_pb2.GenerateRequest(tenant=name))
    with pytest.raises(InvalidArgument, match="tenant"):  # an in-process caller's input too
        GenerateInput(prompts=[], tenant=name)


async def test_slots_fill_evict_lru_and_never_a_held_one():
    w = Worker(2)
    slots = WorkerSlots(w, 2, wait_s=0.2)
    archive = Path("/nowhere")
    a = await slots.acquire("a", 1, archive)
    assert a.extra_args == {LABEL_KEY: "a@v1"}
    b = await slots.acquire("b", 1, archive)
    await slots.release(b)
    # a is held, b is not: c evicts b
    c = await slots.acquire("c", 1, archive)
    assert sorted(w.labels) == ["a@v1", "c@v1"]
    # everything held: d waits, then fails with the reason; nothing was evicted
    with pytest.raises(ResourceExhausted, match="adapter slots"):
        await slots.acquire("d", 1, archive)
    assert sorted(w.labels) == ["a@v1", "c@v1"]
    # a release while d waits hands d the slot (the least recently used unheld one)
    waiting = asyncio.create_task(slots.acquire("d", 1, archive))
    await asyncio.sleep(0.05)
    await slots.release(c)
    d = await waiting
    assert sorted(w.labels) == ["a@v1", "d@v1"]
    # a resident version is shared, not loaded again; base needs no slot
    loads = slots.loads
    a2 = await slots.acquire("a", 1, archive)
    assert slots.loads == loads and a2.label == a.label
    assert (await slots.acquire("a", 0, None)).extra_args == {LABEL_KEY: BASE}
    for lease in (a, a2, d):
        await slots.release(lease)
    # a retired version frees its slot in the worker
    await slots.forget("a", 1)
    assert "a@v1" not in w.labels and ("hotloop_slot_free", w.labels.index(None)) in w.calls


async def test_tenants_that_always_have_a_request_running_do_not_starve_a_waiting_one():
    """Every slot held by a tenant whose users keep a request running at every moment (each
    new one starts before the last ends): a third tenant's request is served once the
    least busy of them has finished what it was running, not refused after `wait_s`. The
    tenant it replaced waits in line behind it, then gets a slot back, never two at once."""
    w = Worker(2)
    slots = WorkerSlots(w, 2, wait_s=5.0, drain_after_s=0.0)  # it marks at once
    archive = Path("/nowhere")
    a = [await slots.acquire("a", 1, archive)]
    b = [await slots.acquire("b", 1, archive), await slots.acquire("b", 1, archive)]
    c = asyncio.create_task(slots.acquire("c", 1, archive))
    await asyncio.sleep(0.05)
    assert not c.done()
    # a is the least busy (one running): it drains for c; its next user waits in line
    a_next = asyncio.create_task(slots.acquire("a", 1, archive))
    b.append(await slots.acquire("b", 1, archive))  # b is not draining: admitted at once
    await asyncio.sleep(0.05)
    assert not a_next.done() and not c.done()
    await slots.release(a.pop())  # a's last running request ends: c takes its slot
    c_lease = await asyncio.wait_for(c, 1.0)
    assert sorted(w.labels) == ["b@v1", "c@v1"]
    # a waits for the next slot to free (b keeps going meanwhile, but b's slot now drains)
    b_after = asyncio.create_task(slots.acquire("b", 1, archive))
    await asyncio.sleep(0.05)
    assert not a_next.done() and not b_after.done()
    for lease in b:
        await slots.release(lease)
    a_lease = await asyncio.wait_for(a_next, 1.0)
    assert sorted(w.labels) == ["a@v1", "c@v1"] and w.labels.count("a@v1") == 1
    await slots.release(c_lease)
    b_lease = await asyncio.wait_for(b_after, 1.0)  # and b is back in c's slot
    assert sorted(w.labels) == ["a@v1", "b@v1"]
    assert slots.stats()["refusals"] == 0
    for lease in (a_lease, b_lease):
        await slots.release(lease)


@pytest.mark.parametrize("drain_after_s", [0.0, 0.01])
@pytest.mark.parametrize("seed", range(4))
async def test_many_tenants_on_few_slots_all_get_served_and_never_share_or_double_a_slot(
        seed, drain_after_s):
    """Users of 9 tenants, each user one request at a time of 0-20 ms, on 3 slots, with loads
    of 0-5 ms: every request is served within the bound (no refusal: nobody waits for ever
    behind a line that cannot move), each on its own version's slot for as long as it runs,
    and no version is ever in two slots. Waiters mark the version they replace at once, or
    after 10 ms."""
    import random

    rng = random.Random(seed)

    class Slow(Worker):
        """Loads take time, and run one at a time in the order sent, as an engine core
        takes its utility calls."""

        lock = asyncio.Lock()

        async def collective_rpc(self, method, args=(), kwargs=None):
            async with self.lock:
                if method == "hotloop_slot_load":
                    await asyncio.sleep(rng.random() * 0.005)
                return await super().collective_rpc(method, args, kwargs)

    w = Slow(3)
    slots = WorkerSlots(w, 3, wait_s=10.0, drain_after_s=drain_after_s)
    running: dict[str, int] = {}
    served = 0

    async def user(u: int) -> None:
        nonlocal served
        for _ in range(25):
            t = f"t{rng.randrange(9)}"
            lease = await slots.acquire(t, 1, Path("/nowhere"))
            running[t] = running.get(t, 0) + 1
            for labels in (w.labels, slots.status()["resident"]):  # the worker's, the table's
                assert labels.count(lease.label) == 1, labels  # resident, once
            await asyncio.sleep(rng.random() * 0.02)
            assert w.labels.count(lease.label) == 1, w.labels  # not evicted under it
            running[t] -= 1
            await slots.release(lease)
            served += 1

    await asyncio.wait_for(asyncio.gather(*(user(u) for u in range(8))), 60)
    assert served == 8 * 25 and slots.stats()["refusals"] == 0
    assert len([x for x in w.labels if x]) == len({x for x in w.labels if x})


async def test_a_waiter_that_gives_up_leaves_no_slot_draining():
    w = Worker(1)
    slots = WorkerSlots(w, 1, wait_s=0.1)
    archive = Path("/nowhere")
    a1 = await slots.acquire("a", 1, archive)
    with pytest.raises(ResourceExhausted):
        await slots.acquire("b", 1, archive)  # a1 never ends within its wait
    # a is not draining now: held at once (a mark left behind would refuse it after 0.1 s)
    a2 = await asyncio.wait_for(slots.acquire("a", 1, archive), 5.0)
    assert w.labels == ["a@v1"] and a2.label == a1.label


async def test_slot_metrics_count_loads_evictions_waits_refusals_and_residency():
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    m = SlotMetrics(reg)
    slots = WorkerSlots(Worker(2), 2, wait_s=0.2, metrics=m)
    archive = Path("/nowhere")

    def sample(name: str, **labels) -> float:
        return reg.get_sample_value(name, labels) or 0.0

    a = await slots.acquire("a", 1, archive)
    b = await slots.acquire("b", 1, archive)
    st = slots.stats()
    assert (st["loads"], st["evictions"], st["waits"], st["refusals"]) == (2, 0, 0, 0)
    assert (st["resident_adapters"], st["resident_bytes"]) == (2, 2 * Worker.BYTES)
    assert len(st["load_s"]) == 2 and all(x >= 0 for x in st["load_s"])
    # a resident version is shared: no load, no wait; the base model needs no slot
    a2 = await slots.acquire("a", 1, archive)
    await slots.acquire("a", 0, None)
    assert slots.stats()["loads"] == 2 and slots.stats()["waits"] == 0
    # b released: c evicts it (one eviction, still two resident)
    await slots.release(b)
    c = await slots.acquire("c", 1, archive)
    st = slots.stats()
    assert (st["loads"], st["evictions"], st["resident_adapters"]) == (3, 1, 2)
    # everything held: d waits its 0.2 s and is refused (a wait and a refusal)
    with pytest.raises(ResourceExhausted):
        await slots.acquire("d", 1, archive)
    st = slots.stats()
    assert (st["waits"], st["refusals"], st["evictions"]) == (1, 1, 1) and st["wait_s"] >= 0.2
    # d waits again and gets c's slot when c ends: a wait, no refusal, an eviction
    waiting = asyncio.create_task(slots.acquire("d", 1, archive))
    await asyncio.sleep(0.05)
    await slots.release(c)
    d = await waiting
    st = slots.stats()
    assert (st["loads"], st["waits"], st["refusals"], st["evictions"]) == (4, 2, 1, 2)
    # the same numbers on the registry
    assert sample("hotloop_rollout_tenant_slot_load_seconds_count", result="ok") == 4
    assert sample("hotloop_rollout_tenant_slot_load_seconds_count", result="failed") == 0
    assert sample("hotloop_rollout_tenant_slot_evictions_total") == 2
    assert sample("hotloop_rollout_tenant_slot_wait_seconds_count") == 2
    assert sample("hotloop_rollout_tenant_slot_wait_seconds_sum") == pytest.approx(st["wait_s"])
    assert sample("hotloop_rollout_tenant_slot_refusals_total") == 1
    assert sample("hotloop_rollout_tenant_resident_adapters") == 2
    assert sample("hotloop_rollout_tenant_resident_adapter_bytes") == 2 * Worker.BYTES
    # a retired version's slot is freed: one fewer resident, its bytes gone
    for lease in (a, a2, d):
        await slots.release(lease)
    await slots.forget("a", 1)
    st = slots.stats()
    assert (st["resident_adapters"], st["resident_bytes"]) == (1, Worker.BYTES)
    assert sample("hotloop_rollout_tenant_resident_adapters") == 1
    assert st["evictions"] == 2  # a retirement is not an eviction


async def test_a_failed_load_leaves_the_slot_empty():
    class Failing(Worker):
        async def collective_rpc(self, method, args=(), kwargs=None):
            if method == "hotloop_slot_load":
                raise ValueError("bad adapter")
            return await super().collective_rpc(method, args, kwargs)

    slots = WorkerSlots(Failing(1), 1, wait_s=0.1)
    with pytest.raises(ValueError, match="bad adapter"):
        await slots.acquire("a", 1, Path("/nowhere"))
    assert slots.status()["resident"] == [None] and slots.status()["held"] == [0]
    st = slots.stats()
    assert (st["loads"], st["failed_loads"], st["resident_adapters"]) == (0, 1, 0)


def test_one_factory_gives_each_mode_its_tenant_path():
    merged = make_updater("merged", None, Path("/m"), 16, "inflight", tenant_slots=3)
    assert isinstance(merged, MergedUpdater) and merged.tenant_slots == 3
    assert isinstance(merged.slots, NoSlots)  # until init() sees the platform
    lora = make_updater("lora", None, Path("/m"), 16)
    assert isinstance(lora, LoraUpdater) and isinstance(lora.slots, LoraSlots)
    assert RolloutConfig().tenant_slots == 4
    with pytest.raises(ValueError):
        RolloutConfig(tenant_slots=-1)
    with pytest.raises(ValueError):
        RolloutConfig(tenant_slot_wait_s=0)


async def test_lora_path_one_request_per_tenant_version(adapter_factory, tmp_path):
    slots = LoraSlots(engine=None)
    for t, v in (("acme", 1), ("beta", 1), ("acme", 2)):
        d = tmp_path / f"{t}-{v}"
        d.mkdir()
        (d / "adapter.tar").write_bytes(adapters.pack(adapter_factory(seed=7)))
        await slots.prepare(t, v, d / "adapter.tar")
    leases = [await slots.acquire(t, v, None) for t, v in (("acme", 1), ("beta", 1), ("acme", 2))]
    ids = [x.lora_request.lora_int_id for x in leases]
    assert len(set(ids)) == 3 and min(ids) >= LoraSlots.FIRST_ID
    assert [x.lora_request.lora_name for x in leases] == ["acme@v1", "beta@v1", "acme@v2"]
    assert Path(leases[0].lora_request.lora_path, "adapter_config.json").exists()
    assert (await slots.acquire("acme", 0, None)).lora_request is None


async def test_no_slots_refuses_clearly():
    with pytest.raises(FailedPrecondition, match="tenant_slots = 0"):
        await NoSlots("tenants are off ([rollout] tenant_slots = 0)").acquire("a", 1, None)
