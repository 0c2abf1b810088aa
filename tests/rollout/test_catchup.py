"""Catch-up (services/rollout/catchup.py) against a real NATS (KV "latest" and
"latest.tenant.<name>", `WeightsUpdated` on the default and the tenants' subjects, a server
restart) and a real trainer `FetchAdapter` server on port 0 fed by real `Publisher`s (the
default lineage's and two tenants'), over the real `TrainerClient`.

The replica is `Versions`, a stand-in for the core's version tables: like `RolloutCore.push`
it takes a version only when the bytes match the header's sha256 and refuses one older than
its lineage's latest. Catch-up is what is under test; a real replica (vLLM) catching up the
default and a tenant's lineage under `hotloop up` is tests/faults/test_mesh_restarts.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from hotloop import adapters
from hotloop.adapters import Version
from hotloop.bus import LATEST_KEY, Bus, latest_key
from hotloop.clients import TrainerClient
from hotloop.errors import FailedPrecondition, InvalidArgument, NotFound, Unauthenticated, Unavailable
from hotloop.proto.v1 import common_pb2
from services.rollout.catchup import (
    CatchUp,
    Lineages,
    TrainerFetch,
    bus_latest,
    bus_recorded,
    bus_tenants,
    listen,
)
from services.trainer.publish import Publisher
from services.trainer.server import TrainerState, serve
from tests.trainer.test_publish import free_port, make_adapter_dir

BASE = "tiny-base"
TENANTS = ("acme", "globex")


class Versions:
    """The replica's side: what each lineage holds, what it was given, what it was told."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}  # tenant ("" the default) -> its latest version
        self.loads: dict[str, list[int]] = {}
        self.told: dict[str, int] = {}  # `announced`

    @property
    def latest(self) -> int:
        return self.latest_of("")

    @property
    def loaded(self) -> list[int]:
        return self.loads.get("", [])

    def latest_of(self, tenant: str) -> int:
        return self.held.get(tenant, 0)

    def announced(self, tenant: str, version: int) -> None:
        self.told[tenant] = max(version, self.told.get(tenant, 0))

    async def push(self, info: Version, chunks, make_latest: bool = True, tenant: str = ""):
        data = b"".join([c async for c in chunks])
        if adapters.sha256(data) != info.sha256:
            raise InvalidArgument(f"sha256 mismatch for v{info.version}")
        if info.version < self.latest_of(tenant):
            raise FailedPrecondition(f"v{info.version} is older than the latest "
                                     f"({self.latest_of(tenant)})")
        self.held[tenant] = info.version
        self.loads.setdefault(tenant, []).append(info.version)


class Trainer:
    """Publishers with no replicas (so each version is announced), one per lineage (the
    default one's and each of `tenants`'), and one FetchAdapter server for all of them."""

    def __init__(self, tmp_path, bus: Bus, tenants: tuple[str, ...] = ()) -> None:
        self.tmp, self.bus = tmp_path, bus
        self.publishers = {t: Publisher([], "token", tmp_path / f"store-{t or 'default'}", bus,
                                        BASE, tenant=t) for t in ("", *tenants)}
        self.publisher = self.publishers[""]
        self.server = None
        self.address = ""

    def stores(self, tenant: str):
        if tenant not in self.publishers:
            raise NotFound(f"this trainer does not train tenant {tenant!r}")
        return self.publishers[tenant].store

    async def serve(self, address: str = "127.0.0.1:0") -> str:
        self.server, port, _ = await serve(TrainerState(), self.stores, address, "token")
        self.address = f"127.0.0.1:{port}"
        for p in self.publishers.values():
            p.fetch_from = self.address
        return self.address

    async def stop_serving(self) -> None:
        await self.server.stop(0)
        self.server = None

    async def publish(self, version: int, tenant: str = "") -> Version:
        adapter = make_adapter_dir(self.tmp / f"a{tenant}{version}", size=300_000,
                                   seed=version + 100 * len(tenant))
        return (await self.publishers[tenant].publish(version, adapter)).version

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
        for p in self.publishers.values():
            await p.close()


def single(catchup: CatchUp) -> Lineages:
    """`Lineages` of the default lineage alone (no tenant is announced in these tests)."""
    async def none() -> list[str]:
        return []

    def make(tenant: str) -> CatchUp:
        assert tenant == "", f"unexpected tenant {tenant!r}"
        return catchup

    return Lineages(make, none)


def lineages(replica: Versions, bus: Bus, fetch, trainers, **kw) -> Lineages:
    """What the rollout service builds (services/rollout/__main__.py): one `CatchUp` per
    lineage, each reading its own KV key. `trainers`: tenant -> its configured addresses."""
    def make(tenant: str) -> CatchUp:
        return CatchUp(replica, bus_latest(bus, tenant), fetch, trainers(tenant), tenant=tenant,
                       read_recorded=bus_recorded(bus, tenant), **kw)

    return Lineages(make, bus_tenants(bus), poll_s=kw.get("poll_s", 30.0))


@pytest.fixture
async def rig(tmp_path, nats_server):
    """(trainer, the replica's bus, fetch); everything closed afterwards."""
    trainer_bus = await Bus.connect(nats_server.url, "trainer")
    replica_bus = await Bus.connect(nats_server.url, "rollout")
    trainer, fetch = Trainer(tmp_path, trainer_bus), TrainerFetch("token")
    yield trainer, replica_bus, fetch
    await fetch.close()
    await trainer.close()
    await replica_bus.close()
    await trainer_bus.close()


async def wait_for(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)


def stop_task(task: asyncio.Task):
    task.cancel()
    return asyncio.gather(task, return_exceptions=True)


async def test_a_starting_replica_loads_the_announced_version_before_serving(rig):
    trainer, bus, fetch = rig
    await trainer.serve()
    await trainer.publish(1)
    v2 = await trainer.publish(2)
    replica = Versions()
    catchup = CatchUp(replica, bus_latest(bus), fetch, trainer.address)
    assert await catchup.start(timeout_s=30)
    assert replica.loaded == [2] and replica.latest == 2  # straight to the latest
    assert (catchup.known_latest, catchup.behind, catchup.error) == (2, False, "")
    assert (await bus.kv_get(LATEST_KEY, common_pb2.VersionInfo)).sha256 == v2.sha256


async def test_nothing_announced_starts_at_once_on_the_base(rig):
    trainer, bus, fetch = rig
    replica = Versions()
    catchup = CatchUp(replica, bus_latest(bus), fetch, "127.0.0.1:1")  # never asked
    assert await catchup.start(timeout_s=30)
    assert replica.loaded == [] and not catchup.behind and catchup.known_latest == 0


async def test_an_unreachable_trainer_is_retried_then_the_replica_starts_behind_and_says_so(rig, caplog):
    trainer, bus, fetch = rig
    await trainer.serve()
    await trainer.publish(1)
    address = trainer.address
    await trainer.stop_serving()
    replica = Versions()
    catchup = CatchUp(replica, bus_latest(bus), fetch, address, retry_max_s=0.2)
    with caplog.at_level(logging.WARNING, "services.rollout.catchup"):
        assert not await catchup.start(timeout_s=1.5)
    assert replica.loaded == [] and catchup.behind and catchup.known_latest == 1
    assert address in catchup.error and "unavailable" in catchup.error
    assert "retrying in" in caplog.text and "starting on v0, behind the announced v1" in caplog.text

    follower = asyncio.create_task(catchup.follow())
    try:
        await trainer.serve(address)  # the trainer is back where it was
        await wait_for(lambda: replica.latest == 1, "caught up once the trainer is back")
        assert not catchup.behind and catchup.error == ""
    finally:
        await stop_task(follower)


async def test_with_no_trainer_address_it_starts_at_once_and_an_announcement_names_one(rig):
    trainer, bus, fetch = rig
    await trainer.serve()
    trainer.publisher.fetch_from = ""  # an announcement that names no trainer
    await trainer.publish(1)
    replica = Versions()
    catchup = CatchUp(replica, bus_latest(bus), fetch, "")
    await listen(single(catchup), bus)
    t0 = time.monotonic()
    assert not await catchup.start(timeout_s=600)  # waiting could not help: it does not
    assert time.monotonic() - t0 < 60
    assert catchup.behind and "no trainer address is known" in catchup.error

    follower = asyncio.create_task(catchup.follow())
    try:
        trainer.publisher.fetch_from = trainer.address
        await trainer.publisher.reannounce()  # what a trainer does when it starts
        await wait_for(lambda: replica.latest == 1, "caught up from the announced address")
        await trainer.publish(2)  # an announcement while it is up
        await wait_for(lambda: replica.latest == 2, "caught up with a new announcement")
        assert replica.loaded == [1, 2]
    finally:
        await stop_task(follower)


async def test_a_store_that_differs_from_the_announcement_is_not_loaded(rig):
    trainer, bus, fetch = rig
    await trainer.serve()
    v1 = await trainer.publish(1)
    # the KV names other content under the same number (e.g. another run's trainer)
    await trainer.bus.kv_put(LATEST_KEY, common_pb2.VersionInfo(
        version=1, sha256="0" * 64, bytes=v1.bytes, base_model=BASE))
    replica = Versions()
    catchup = CatchUp(replica, bus_latest(bus), fetch, trainer.address)
    assert not await catchup.sync()
    assert replica.loaded == [] and "the announced v1 has 000000000000" in catchup.error


async def test_a_missed_announcement_is_caught_when_the_bus_comes_back(rig, nats_server):
    trainer, bus, fetch = rig
    await trainer.serve()
    await trainer.publish(1)
    replica = Versions()
    catchup = CatchUp(replica, bus_latest(bus), fetch, trainer.address, poll_s=3600)
    # v1's announcement reaches the server before this replica subscribes, so it never hears
    # it (heard during the first look, it would wake the follower once more, which would
    # look at the KV and find v2 before the reconnect does)
    await trainer.bus.flush()
    await listen(single(catchup), bus)
    assert await catchup.start(timeout_s=30) and replica.latest == 1
    follower = asyncio.create_task(catchup.follow())
    try:
        # v2 is stored and in the KV, but its announcement never reached this replica
        adapter = make_adapter_dir(trainer.tmp / "a2", size=300_000, seed=2)
        data = adapters.pack(adapter)
        v2 = trainer.publisher.store.put(Version(2, adapters.sha256(data), len(data), BASE), data)
        await trainer.bus.kv_put(LATEST_KEY, adapters.version_to_proto(v2))
        await asyncio.sleep(0.5)
        assert replica.latest == 1  # nothing told it (the poll is an hour away)
        await asyncio.to_thread(nats_server.restart)
        await wait_for(lambda: replica.latest == 2, "caught up after the reconnect")
    finally:
        await stop_task(follower)


async def test_trainer_client_fetches_a_stored_version_and_names_what_is_missing(rig):
    trainer, bus, fetch = rig
    await trainer.serve()
    v1 = await trainer.publish(1)
    client = TrainerClient(trainer.address, "token")
    try:
        info, chunks = await client.fetch_adapter(0)
        data = b"".join([c async for c in chunks])
        assert info == v1 and adapters.sha256(data) == v1.sha256
        with pytest.raises(NotFound, match="version 7 is not in the trainer's store"):
            await client.fetch_adapter(7)
        with pytest.raises(Unauthenticated, match="admin token"):  # a tenant's model: admin only
            await TrainerClient(trainer.address, "not-the-token").fetch_adapter(0)
    finally:
        await client.close()
    dead = TrainerClient(f"127.0.0.1:{free_port()}")
    try:
        with pytest.raises(Unavailable, match="unavailable"):
            await dead.fetch_adapter(1, timeout_s=5)
    finally:
        await dead.close()


async def test_metrics_say_what_was_announced_whether_it_is_behind_and_what_was_fetched(rig):
    from prometheus_client import CollectorRegistry

    from hotloop import metrics
    from tests.scrape import scrape

    trainer, bus, fetch = rig
    await trainer.serve()
    await trainer.publish(1)
    replica = Versions()
    catchup = CatchUp(replica, bus_latest(bus), fetch, trainer.address)
    reg = CollectorRegistry()
    metrics.StateCollector(single(catchup).metric_families, reg)
    endpoint = metrics.serve(reg)
    try:
        assert await catchup.start(timeout_s=30)
        current = await scrape(endpoint.port)
        await trainer.stop_serving()
        await trainer.publish(2)  # announced; the store that has it cannot be reached
        assert not await catchup.sync(timeout_s=5)
        behind = await scrape(endpoint.port)
    finally:
        endpoint.close()
    assert current.value("hotloop_rollout_known_latest_version") == 1
    assert current.value("hotloop_rollout_behind") == 0
    assert current.value("hotloop_rollout_catchup_fetches_total", result="loaded") == 1
    assert current.value("hotloop_rollout_catchup_fetches_total", result="failed") == 0
    assert behind.value("hotloop_rollout_known_latest_version") == 2
    assert behind.value("hotloop_rollout_behind") == 1
    assert behind.value("hotloop_rollout_catchup_fetches_total", result="failed") == 1


# ---- tenants' lineages -----------------------------------------------------------------------
@pytest.fixture
async def tenant_rig(tmp_path, nats_server):
    """(a trainer of the default lineage and of TENANTS, the replica's bus, fetch)."""
    trainer_bus = await Bus.connect(nats_server.url, "trainer")
    replica_bus = await Bus.connect(nats_server.url, "rollout")
    trainer, fetch = Trainer(tmp_path, trainer_bus, TENANTS), TrainerFetch("token")
    yield trainer, replica_bus, fetch
    await fetch.close()
    await trainer.close()
    await replica_bus.close()
    await trainer_bus.close()


async def test_a_starting_replica_catches_up_every_announced_lineage_before_serving(tenant_rig):
    trainer, bus, fetch = tenant_rig
    await trainer.serve()
    await trainer.publish(1)
    for v in (1, 2, 3):
        await trainer.publish(v, "acme")
    await trainer.publish(1, "globex")
    replica = Versions()
    catchup = lineages(replica, bus, fetch, lambda t: trainer.address)
    assert await catchup.start(timeout_s=30)
    # each lineage straight to its own latest, from its own store (the sha256 says so)
    assert replica.loads == {"": [1], "acme": [3], "globex": [1]}
    assert catchup.tenants() == ["acme", "globex"] and not catchup.behind
    for t, want in (("", 1), ("acme", 3), ("globex", 1)):
        assert (catchup[t].known_latest, catchup[t].error) == (want, "")
        assert replica.told.get(t, 0) == want  # the core is told what was announced
    acme3 = await bus.kv_get(latest_key("acme"), common_pb2.VersionInfo)
    assert acme3.version == 3 and acme3.sha256 == trainer.publishers["acme"].store.get(3).sha256


async def test_tenants_announced_while_it_runs_are_followed_and_a_new_tenant_is_found(tenant_rig):
    trainer, bus, fetch = tenant_rig
    await trainer.serve()
    await trainer.publish(1, "acme")
    replica = Versions()
    catchup = lineages(replica, bus, fetch, lambda t: trainer.address, poll_s=3600)
    await listen(catchup, bus)
    assert await catchup.start(timeout_s=30) and replica.loads == {"acme": [1]}
    follower = asyncio.create_task(catchup.follow())
    try:
        await trainer.publish(2, "acme")  # heard on acme's subject (the wildcard)
        await wait_for(lambda: replica.latest_of("acme") == 2, "acme's v2 followed")
        await trainer.publish(1, "globex")  # a tenant it never heard of: its first announcement
        await wait_for(lambda: replica.latest_of("globex") == 1, "globex found and caught up")
        await trainer.publish(2, "globex")  # and followed from then on
        await wait_for(lambda: replica.latest_of("globex") == 2, "globex's v2 followed")
        assert replica.loads == {"acme": [1, 2], "globex": [1, 2]} and replica.latest == 0
    finally:
        await stop_task(follower)


async def test_a_tenant_announced_while_the_bus_was_away_is_found_when_it_comes_back(
        tenant_rig, nats_server):
    trainer, bus, fetch = tenant_rig
    await trainer.serve()
    replica = Versions()
    catchup = lineages(replica, bus, fetch, lambda t: trainer.address, poll_s=3600)
    await listen(catchup, bus)
    assert await catchup.start(timeout_s=30) and catchup.tenants() == []
    follower = asyncio.create_task(catchup.follow())
    try:
        # globex's v1 is stored and in the KV, but its announcement never reached the replica
        store = trainer.publishers["globex"].store
        data = adapters.pack(make_adapter_dir(trainer.tmp / "g1", size=300_000, seed=7))
        v1 = store.put(Version(1, adapters.sha256(data), len(data), BASE), data)
        await trainer.bus.kv_put(latest_key("globex"), adapters.version_to_proto(v1))
        await asyncio.sleep(0.5)
        assert catchup.tenants() == []  # nothing told it (the poll is an hour away)
        await asyncio.to_thread(nats_server.restart)
        await wait_for(lambda: replica.latest_of("globex") == 1, "found and caught up after "
                       "the reconnect")
    finally:
        await stop_task(follower)


async def test_a_listing_that_fails_after_a_reconnect_is_retried_before_the_poll():
    """The bus came back but could not list yet (JetStream still recovering its store): the
    next listing comes after a short wait, not `poll_s` later."""
    replica = Versions()
    answers: list = [Unavailable("no JetStream responder yet"), ["acme"]]

    async def tenants() -> list[str]:
        answer = answers.pop(0) if answers else ["acme"]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def nothing_announced():
        return None

    def make(tenant: str) -> CatchUp:
        return CatchUp(replica, nothing_announced, TrainerFetch(), tenant=tenant, poll_s=3600)

    catchup = Lineages(make, tenants, poll_s=3600)
    answers.insert(0, [])  # the listing at start: nothing yet
    assert await catchup.start(timeout_s=5) and catchup.tenants() == []
    follower = asyncio.create_task(catchup.follow())
    try:
        catchup.wake()  # the reconnect: this listing fails, the next one finds acme
        await wait_for(lambda: catchup.tenants() == ["acme"], "listed again after the failure",
                       timeout_s=5)
        assert catchup.error == "" and answers == []
    finally:
        await stop_task(follower)


async def test_a_trainer_that_does_not_train_the_tenant_is_passed_over_for_the_next(
        tenant_rig, tmp_path, nats_server):
    trainer, bus, fetch = tenant_rig
    await trainer.serve()
    v1 = await trainer.publish(1, "acme")
    # the mesh's trainer trains the default lineage only; acme's own trainer is `trainer`
    mesh_bus = await Bus.connect(nats_server.url, "mesh-trainer")
    other = Trainer(tmp_path / "other", mesh_bus)
    await other.serve()
    try:
        replica = Versions()
        catchup = lineages(replica, bus, fetch, lambda t: [other.address, trainer.address])
        assert await catchup.start(timeout_s=30)
        assert replica.loads == {"acme": [1]} and catchup["acme"].failed == 1
        assert catchup["acme"].error == ""
        # with only the mesh's trainer, and acme's own (the one the KV recorded) down, the
        # tenant's version cannot be had, and it says why
        await trainer.stop_serving()
        replica = Versions()
        catchup = lineages(replica, bus, fetch, lambda t: other.address, retry_max_s=0.2)
        assert not await catchup.start(timeout_s=1)
        assert replica.loads == {} and catchup["acme"].behind and replica.told == {"acme": 1}
        error = catchup["acme"].error
        assert "does not train tenant 'acme'" in error and other.address in error
        assert f"{trainer.address}: " in error  # the recorded one was asked next
        assert v1.version == catchup["acme"].known_latest
    finally:
        await other.close()
        await mesh_bus.close()


async def test_with_no_trainer_configured_each_lineage_is_fetched_where_the_kv_recorded_it(
        tenant_rig, tmp_path, nats_server):
    """A replica that starts after the announcements (it heard none) in a mesh with a trainer
    per lineage and none configured: the KV recorded with each version the address of the
    trainer that announced it, and only for that version."""
    trainer, bus, fetch = tenant_rig
    await trainer.serve()
    await trainer.publish(1)
    await trainer.publish(1, "acme")
    own_bus = await Bus.connect(nats_server.url, "globex-trainer")
    own = Trainer(tmp_path / "globex", own_bus, ("globex",))  # globex's own trainer
    await own.serve()
    try:
        await own.publish(1, "globex")
        await own.publish(2, "globex")
        replica = Versions()
        catchup = lineages(replica, bus, fetch, lambda t: [])
        assert await catchup.start(timeout_s=30)
        assert replica.loads == {"": [1], "acme": [1], "globex": [2]}
        assert catchup["acme"].sources() == [trainer.address]
        assert catchup["globex"].sources() == [own.address]
        # the record of another version than the latest names none: a v3 in the KV whose
        # announcement (with its address) never came
        await own_bus.kv_put(latest_key("globex"), common_pb2.VersionInfo(
            version=3, sha256="f" * 64, bytes=1, base_model=BASE))
        replica = Versions()
        catchup = lineages(replica, bus, fetch, lambda t: [], retry_max_s=0.2)
        assert not await catchup.start(timeout_s=5)
        assert replica.loads == {"": [1], "acme": [1]} and catchup["globex"].known_latest == 3
        assert "no trainer address is known" in catchup["globex"].error
    finally:
        await own.close()
        await own_bus.close()


async def test_metrics_are_per_lineage(tenant_rig):
    from prometheus_client import CollectorRegistry

    from hotloop import metrics
    from tests.scrape import scrape

    trainer, bus, fetch = tenant_rig
    await trainer.serve()
    await trainer.publish(1)
    await trainer.publish(2, "acme")
    replica = Versions()
    catchup = lineages(replica, bus, fetch, lambda t: trainer.address)
    reg = CollectorRegistry()
    metrics.StateCollector(catchup.metric_families, reg)
    endpoint = metrics.serve(reg)
    try:
        assert await catchup.start(timeout_s=30)
        await trainer.stop_serving()
        await trainer.publish(3, "acme")  # announced; its store cannot be reached
        assert not await catchup["acme"].sync(timeout_s=5)
        got = await scrape(endpoint.port)
    finally:
        endpoint.close()
    assert got.labels("hotloop_rollout_behind", "tenant") == {"", "acme"}
    assert got.value("hotloop_rollout_known_latest_version", tenant="") == 1
    assert got.value("hotloop_rollout_known_latest_version", tenant="acme") == 3
    assert got.value("hotloop_rollout_behind", tenant="") == 0
    assert got.value("hotloop_rollout_behind", tenant="acme") == 1
    assert got.value("hotloop_rollout_catchup_fetches_total", tenant="acme", result="loaded") == 1
    assert got.value("hotloop_rollout_catchup_fetches_total", tenant="acme", result="failed") == 1
    assert got.value("hotloop_rollout_catchup_fetches_total", tenant="", result="loaded") == 1
