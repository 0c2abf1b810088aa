"""Publisher, version store and the trainer's gRPC edge, against real servers on port 0.

The replicas are `FakeReplica`, a small `Rollout.PushAdapter` servicer on a real grpc.aio
server behind the real admin-token interceptor: it reassembles the chunks, checks the sha256
and records what it got. A real rollout replica needs a vLLM engine (tens of seconds); the
thing under test here is the publisher, and the replica's own checks are tested with it.
NATS is a real nats-server (fixture `nats_server`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import socket
import time
from pathlib import Path

import grpc
import pytest

from hotloop import adapters, grpcutil
from hotloop.bus import WEIGHTS_UPDATED, Bus
from hotloop.clients import RolloutClient
from hotloop.errors import FailedPrecondition
from hotloop.proto.v1 import (
    bus_pb2,
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.trainer.publish import (
    PublishError,
    Publisher,
    ReplicaRefused,
    ReplicaUnavailable,
    VersionStore,
)
from services.trainer.server import TrainerState, serve

TOKEN = "admin-secret"
BASE = "tiny-base"
SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name


class FakeReplica(rollout_pb2_grpc.RolloutServicer):
    """Reassembles a push, verifies size and sha256 and records it. `unavailable_first` pushes
    are answered UNAVAILABLE (a replica restarting); `refuse` answers FAILED_PRECONDITION."""

    def __init__(self, unavailable_first: int = 0, refuse: str = "") -> None:
        self.unavailable_first = unavailable_first
        self.refuse = refuse
        self.calls = 0
        self.received: dict[int, bytes] = {}
        self.headers: list[common_pb2.VersionInfo] = []
        self.chunk_sizes: list[int] = []

    async def PushAdapter(self, request_iterator, context):
        self.calls += 1
        if self.calls <= self.unavailable_first:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        first = await anext(aiter(request_iterator))
        assert first.WhichOneof("kind") == "header"
        info = first.header.info
        buf = bytearray()
        async for msg in request_iterator:
            assert msg.WhichOneof("kind") == "data"
            self.chunk_sizes.append(len(msg.data))
            buf.extend(msg.data)
        if self.refuse:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refuse)
        if len(buf) != info.bytes or hashlib.sha256(buf).hexdigest() != info.sha256:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sha256 mismatch")
        already = info.version in self.received
        self.received[info.version] = bytes(buf)
        self.headers.append(info)
        return rollout_pb2.PushAdapterResponse(loaded=info, verify_ms=1.0, load_ms=2.0,
                                               already_present=already)


class Replicas:
    """Starts fake replicas on port 0; stops them all at the end of a test."""

    def __init__(self) -> None:
        self.servers: list[grpc.aio.Server] = []

    async def start(self, fake: FakeReplica, token: str = TOKEN) -> str:
        server, port, _ = await grpcutil.create_server(
            [lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(fake, s)], [SERVICE],
            "127.0.0.1:0", admin_methods=[f"/{SERVICE}/PushAdapter"], admin_token=token,
        )
        self.servers.append(server)
        return f"127.0.0.1:{port}"

    async def stop(self) -> None:
        for s in self.servers:
            await s.stop(None)


@pytest.fixture
async def replicas():
    r = Replicas()
    yield r
    await r.stop()


def make_adapter_dir(path: Path, size: int = int(2.5 * 1024 * 1024), seed: int = 0) -> Path:
    """An adapter directory as `adapters.pack` reads it. The bytes are random, not a LoRA:
    nothing on this path parses them, and 2.5 MiB makes the push three chunks."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(f'{{"r": 8, "seed": {seed}}}')
    rng = random.Random(seed)
    (path / "adapter_model.safetensors").write_bytes(rng.randbytes(size))
    return path


def only_replica(pub: Publisher) -> str:
    (addr,) = pub.replicas
    return addr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_publish_pushes_every_replica_in_chunks_and_keeps_a_durable_copy(tmp_path, replicas):
    fakes = [FakeReplica(), FakeReplica()]
    addrs = [await replicas.start(f) for f in fakes]
    pub = Publisher(addrs, TOKEN, tmp_path / "store", None, BASE)
    adapter = make_adapter_dir(tmp_path / "a1")
    try:
        res = await pub.publish(1, adapter)
    finally:
        await pub.close()
    data = adapters.pack(adapter)
    assert (res.version.version, res.version.sha256, res.version.bytes) == (1, adapters.sha256(data), len(data))
    assert res.version.base_model == BASE
    assert set(res.pushes) == set(addrs) and set(res.push_ms) == set(addrs)
    assert all(p.attempts == 1 and p.push_ms > 0 and p.load_ms == 2.0 for p in res.pushes.values())
    assert res.total_ms >= max(res.push_ms.values())
    assert not res.announced  # no bus
    for fake in fakes:
        assert fake.received == {1: data}
        assert fake.chunk_sizes == [grpcutil.CHUNK_BYTES, grpcutil.CHUNK_BYTES, len(data) - 2 * grpcutil.CHUNK_BYTES]
        assert fake.headers[0].base_model == BASE
    store = VersionStore(tmp_path / "store")
    assert (tmp_path / "store" / "versions" / "v1.tar").read_bytes() == data
    assert (tmp_path / "store" / "versions" / "v1.json").exists()
    assert store.get(1) == res.version == store.get(0)


async def test_republish_is_idempotent_and_versions_are_immutable_and_monotonic(tmp_path, replicas):
    fake = FakeReplica()
    pub = Publisher([await replicas.start(fake)], TOKEN, tmp_path / "store", None, BASE)
    a1, a2 = make_adapter_dir(tmp_path / "a1", 1000, seed=1), make_adapter_dir(tmp_path / "a2", 1000, seed=2)
    try:
        first = await pub.publish(1, a1)
        again = await pub.publish(1, a1)  # a retried publish
        assert again.version == first.version  # same record, same created_at
        assert again.pushes[only_replica(pub)].already_present
        with pytest.raises(FailedPrecondition, match="already published"):
            await pub.publish(1, a2)
        await pub.publish(3, a2)
        with pytest.raises(FailedPrecondition, match="older than the latest"):
            await pub.publish(2, a1)
        with pytest.raises(FailedPrecondition, match="older than the latest"):
            await pub.publish(1, a1)  # stored, but re-announcing it would go backwards
    finally:
        await pub.close()
    assert [v.version for v in VersionStore(tmp_path / "store").versions()] == [1, 3]


async def test_wrong_token_and_refusal_are_typed_errors_naming_replica_and_reason(tmp_path, replicas):
    good, refusing = FakeReplica(), FakeReplica(refuse="adapter rank 64 is outside 1..16")
    wrong_token = FakeReplica()
    addrs = {
        "good": await replicas.start(good),
        "token": await replicas.start(wrong_token, token="another-token"),
        "refuse": await replicas.start(refusing),
    }
    pub = Publisher(list(addrs.values()), TOKEN, tmp_path / "store", None, BASE)
    try:
        with pytest.raises(PublishError) as e:
            await pub.publish(1, make_adapter_dir(tmp_path / "a", 1000))
    finally:
        await pub.close()
    failures = e.value.failures
    assert set(failures) == {addrs["token"], addrs["refuse"]}
    assert isinstance(failures[addrs["token"]], ReplicaRefused)
    assert failures[addrs["token"]].code == "PERMISSION_DENIED"
    assert isinstance(failures[addrs["refuse"]], ReplicaRefused)
    assert failures[addrs["refuse"]].code == "FAILED_PRECONDITION"
    msg = str(e.value)
    assert addrs["refuse"] in msg and "adapter rank 64 is outside 1..16" in msg
    assert addrs["token"] in msg and "admin token" in msg
    assert wrong_token.calls == 0 and refusing.calls == 1  # refusals are not retried
    assert set(e.value.result.pushes) == {addrs["good"]} and 1 in good.received


async def test_unavailable_is_retried_a_bounded_number_of_times(tmp_path, replicas):
    flaky = FakeReplica(unavailable_first=2)
    pub = Publisher([await replicas.start(flaky)], TOKEN, tmp_path / "store", None, BASE, max_attempts=3)
    try:
        res = await pub.publish(1, make_adapter_dir(tmp_path / "a", 1000))
    finally:
        await pub.close()
    assert res.pushes[only_replica(pub)].attempts == 3 and flaky.calls == 3


async def test_a_down_replica_fails_fast_with_a_clear_error_and_nothing_is_announced(tmp_path, nats_server):
    down = f"127.0.0.1:{free_port()}"
    bus = await Bus.connect(nats_server.url, "test")
    pub = Publisher([down], TOKEN, tmp_path / "store", bus, BASE, max_attempts=3)
    t0 = time.perf_counter()
    try:
        with pytest.raises(PublishError) as e:
            await pub.publish(1, make_adapter_dir(tmp_path / "a", 1000))
        assert await bus.kv_get("latest", common_pb2.VersionInfo) is None
    finally:
        await pub.close()
        await bus.close()
    assert time.perf_counter() - t0 < 5
    failure = e.value.failures[down]
    assert isinstance(failure, ReplicaUnavailable)
    assert (failure.code, failure.attempts) == ("UNAVAILABLE", 3)
    assert down in str(e.value) and "after 3 attempt(s)" in str(e.value)
    assert not e.value.result.announced
    assert VersionStore(tmp_path / "store").get(1).version == 1  # stored for a later catch-up


async def test_announcement_and_kv_latest_on_nats(tmp_path, replicas, nats_server):
    fake = FakeReplica()
    addr = await replicas.start(fake)
    bus = await Bus.connect(nats_server.url, "trainer")
    listener = await Bus.connect(nats_server.url, "listener")
    got: asyncio.Queue = asyncio.Queue()

    async def on_update(msg: bus_pb2.WeightsUpdated, headers: dict) -> None:
        await got.put((msg, headers))

    await listener.subscribe(WEIGHTS_UPDATED, bus_pb2.WeightsUpdated, on_update)
    await listener.nc.flush()
    pub = Publisher([addr], TOKEN, tmp_path / "store", bus, BASE, fetch_from="127.0.0.1:7000")
    try:
        res = await pub.publish(1, make_adapter_dir(tmp_path / "a1", 1000, seed=1))
        msg, headers = await asyncio.wait_for(got.get(), 5)
        assert res.announced
        assert (msg.info.version, msg.info.sha256, msg.info.bytes) == (1, res.version.sha256, res.version.bytes)
        assert msg.info.base_model == BASE and msg.fetch_from == "127.0.0.1:7000"
        assert headers["hotloop-type"] == "hotloop.v1.WeightsUpdated"
        latest = await listener.kv_get("latest", common_pb2.VersionInfo)
        assert (latest.version, latest.sha256) == (1, res.version.sha256)

        res2 = await pub.publish(2, make_adapter_dir(tmp_path / "a2", 1000, seed=2))
        msg, _ = await asyncio.wait_for(got.get(), 5)
        assert msg.info.version == 2
        assert (await listener.kv_get("latest", common_pb2.VersionInfo)).sha256 == res2.version.sha256
    finally:
        await pub.close()
        await bus.close()
        await listener.close()


async def fetch(stub, version: int, tenant: str = "",
                token: str = TOKEN) -> tuple[common_pb2.VersionInfo, bytes, list[int]]:
    info, data, sizes = None, bytearray(), []
    request = trainer_pb2.FetchAdapterRequest(version=version, tenant=tenant)
    async for chunk in stub.FetchAdapter(request, metadata=grpcutil.bearer(token)):
        if chunk.WhichOneof("kind") == "info":
            assert info is None and not data, "VersionInfo must come first, once"
            info = chunk.info
        else:
            sizes.append(len(chunk.data))
            data.extend(chunk.data)
    assert info is not None
    return info, bytes(data), sizes


async def test_fetch_adapter_and_status_through_a_real_trainer_server(tmp_path):
    pub = Publisher([], TOKEN, tmp_path / "store", None, BASE)  # no replicas: store only
    res1 = await pub.publish(1, make_adapter_dir(tmp_path / "a1", seed=1))
    res2 = await pub.publish(2, make_adapter_dir(tmp_path / "a2", 1000, seed=2))
    state = TrainerState(algorithm="grpo")
    server, port, _ = await serve(state, pub, "127.0.0.1:0", TOKEN)  # the Publisher itself is accepted
    try:
        async with grpcutil.channel(f"127.0.0.1:{port}") as ch:
            stub = trainer_pb2_grpc.TrainerStub(ch)
            info, data, sizes = await fetch(stub, 1)
            assert (info.version, info.sha256, info.bytes) == (1, res1.version.sha256, len(data))
            assert adapters.sha256(data) == info.sha256
            assert max(sizes) == grpcutil.CHUNK_BYTES and len(sizes) == 3
            info, data, _ = await fetch(stub, 0)  # 0: the latest
            assert info.version == 2 and adapters.sha256(data) == res2.version.sha256

            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fetch(stub, 9)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "version 9" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:  # a lineage this trainer does not train
                await fetch(stub, 1, tenant="acme")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'acme'" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:  # a name no tenant may have
                await fetch(stub, 1, tenant="../acme")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant name" in e.value.details()
            for token in ("", "wrong-token"):  # a version is a tenant's model: admin only
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await fetch(stub, 1, token=token)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

            status = await stub.Status(trainer_pb2.TrainerStatusRequest())
            assert (status.algorithm, status.step, status.latest_version) == ("grpo", 0, 0)
            state.step, state.latest_version = 5, 2  # the loop updates the object in place
            state.last_metrics = {"loss": 0.25, "reward_mean": 0.5}
            status = await stub.Status(trainer_pb2.TrainerStatusRequest())
            assert (status.step, status.latest_version) == (5, 2)
            assert dict(status.last_metrics) == {"loss": 0.25, "reward_mean": 0.5}
    finally:
        await server.stop(None)
        await pub.close()


async def test_fetch_before_any_publish_is_not_found(tmp_path):
    server, port, _ = await serve(TrainerState(), VersionStore(tmp_path / "store"), "127.0.0.1:0", TOKEN)
    try:
        async with grpcutil.channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await fetch(trainer_pb2_grpc.TrainerStub(ch), 0)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(None)


def test_store_never_shows_a_partial_version(tmp_path):
    store = VersionStore(tmp_path)
    # a crash after the archive but before the metadata leaves no visible version
    (store.dir / "v1.tar").write_bytes(b"partial")
    (store.dir / f".tmp-v1.json-{os.getpid()}").write_text("{")
    assert store.versions() == [] and store.latest() is None


async def test_publish_span_has_one_child_span_per_replica(tmp_path, replicas, monkeypatch):
    # A private provider, not the process-global one (set once per process, by telemetry.setup).
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.trainer import publish as publisher_module

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(publisher_module, "_tracer", provider.get_tracer("test"))
    addrs = [await replicas.start(FakeReplica()), await replicas.start(FakeReplica())]
    pub = Publisher(addrs, TOKEN, tmp_path / "store", None, BASE)
    try:
        await pub.publish(1, make_adapter_dir(tmp_path / "a", 1000))
    finally:
        await pub.close()
    finished = exporter.get_finished_spans()
    (publish,) = [s for s in finished if s.name == "publish"]
    pushes = [s for s in finished if s.name == "push"]
    assert publish.attributes["hotloop.version"] == 1
    assert sorted(s.attributes["hotloop.replica"] for s in pushes) == sorted(addrs)
    assert all(s.parent.span_id == publish.context.span_id for s in pushes)


@pytest.mark.slow  # the replica that is down is asked with the client's bounded retries (~7 s)
async def test_the_online_loop_trains_on_when_an_away_replica_can_catch_up(tmp_path, replicas, nats_server):
    """`online.publish_tolerant`: a replica that could not be reached does not stop training
    once another one took the version (it is announced: the away one catches up from the
    store); a refusal, or a version nobody took, still raises."""
    from services.trainer.recipes.online import OnlineMesh, mesh_latest, publish_tolerant

    up, down = await replicas.start(FakeReplica()), f"127.0.0.1:{free_port()}"
    bus = await Bus.connect(nats_server.url, "trainer")
    pub = Publisher([up, down], TOKEN, tmp_path / "store", bus, BASE, max_attempts=2)
    mesh = OnlineMesh(bus, pub, rollout=[RolloutClient(down)])
    try:
        await publish_tolerant(mesh, 1, make_adapter_dir(tmp_path / "a1", 1000, seed=1))
        assert (await bus.kv_get("latest", common_pb2.VersionInfo)).version == 1
        assert await mesh_latest(mesh) == 1  # the replica that does not answer is left out

        pub.replicas = [down]  # nobody takes it: nothing is announced, and the loop stops
        with pytest.raises(PublishError):
            await publish_tolerant(mesh, 2, make_adapter_dir(tmp_path / "a2", 1000, seed=2))
        refusing = await replicas.start(FakeReplica(refuse="rank too large"))
        pub.replicas = [up, refusing]  # announced, but a refusal is not a replica away
        with pytest.raises(PublishError, match="rank too large"):
            await publish_tolerant(mesh, 3, make_adapter_dir(tmp_path / "a3", 1000, seed=3))
    finally:
        await mesh.rollout[0].close()
        await pub.close()
        await bus.close()


async def test_reannounce_says_the_latest_announced_version_again_with_this_trainers_address(
        tmp_path, replicas, nats_server):
    bus = await Bus.connect(nats_server.url, "trainer")
    listener = await Bus.connect(nats_server.url, "listener")
    got: asyncio.Queue = asyncio.Queue()

    async def on_update(msg: bus_pb2.WeightsUpdated, headers: dict) -> None:
        await got.put(msg)

    await listener.subscribe(WEIGHTS_UPDATED, bus_pb2.WeightsUpdated, on_update)
    await listener.nc.flush()
    down = f"127.0.0.1:{free_port()}"
    pub = Publisher([down], TOKEN, tmp_path / "store", bus, BASE, max_attempts=1)
    try:
        assert await pub.reannounce() is None  # nothing stored
        with pytest.raises(PublishError):  # stored, never announced: every replica was away
            await pub.publish(1, make_adapter_dir(tmp_path / "a1", 1000, seed=1))
        assert await pub.reannounce() is None and got.empty()

        pub.replicas = [await replicas.start(FakeReplica())]
        res = await pub.publish(2, make_adapter_dir(tmp_path / "a2", 1000, seed=2))
        assert (await asyncio.wait_for(got.get(), 5)).info.version == 2
        # a restarted trainer: same store, another address
        again = Publisher([], TOKEN, tmp_path / "store", bus, BASE, fetch_from="127.0.0.1:7001")
        assert (await again.reannounce()).sha256 == res.version.sha256
        msg = await asyncio.wait_for(got.get(), 5)
        assert (msg.info.version, msg.info.sha256, msg.fetch_from) == (2, res.version.sha256, "127.0.0.1:7001")
        await again.close()
    finally:
        await pub.close()
        await bus.close()
        await listener.close()


def test_the_announced_fetch_address_is_one_a_replica_can_reach():
    import socket

    from services.trainer.runner import advertised

    assert advertised("127.0.0.1", 50055) == "127.0.0.1:50055"
    assert advertised("0.0.0.0", 50055, "online-trainer:50055") == "online-trainer:50055"
    assert advertised("10.0.0.5", 7, "trainer:50055") == "trainer:50055"  # what the others reach
    for wildcard in ("0.0.0.0", "::", "[::]", ""):
        assert advertised(wildcard, 50055) == f"{socket.getfqdn()}:50055"
