"""The online loop against real services: a real nats-server (JetStream), a real rollout
replica (vLLM, lora mode, one engine for the module) on port 0 that receives every published
version, and a real reference server for the KL test. The tests play the gateway: they serve a
completion through the rollout, publish its TrafficEvent and the users' FeedbackEvents with the
gateway's message ids, and read what the trainer did from the stream, the rollout and
metrics.jsonl.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import pytest_asyncio
import torch

from hotloop import grpcutil
from hotloop.bus import (
    DEAD,
    FEEDBACK,
    LATEST_KEY,
    Bus,
    feedback_subject,
    latest_key,
    traffic_subject,
    weights_subject,
)
from hotloop.clients import ReferenceClient, RolloutClient
from hotloop.proto.v1 import bus_pb2, common_pb2, trainer_pb2, trainer_pb2_grpc
from services.trainer.recipes import online
from services.trainer.config import OnlineConfig
from services.trainer.publish import Publisher

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
TOKEN = "test-admin-token"
DURABLE = "online-test"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(tiny_model, tmp_path_factory):
    from services.rollout.config import RolloutConfig
    from services.rollout.core import RolloutCore
    from services.rollout.server import serve

    cfg = RolloutConfig(update_mode="lora", max_lora_rank=16, max_prompt_tokens=200, max_n=8,
                        max_new_tokens=64, default_max_tokens=16, kv_cache_gib=1, swap_drain_timeout_s=30)
    core = RolloutCore(cfg, tiny_model, base_model="tiny", max_model_len=512,
                       storage_dir=tmp_path_factory.mktemp("rollout") / "adapters")
    await core.start()
    server, port, _ = await serve(core, "127.0.0.1:0", TOKEN)
    yield f"127.0.0.1:{port}"
    await server.stop(0)
    await core.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reference(tiny_model):
    from services.reference.config import ReferenceConfig
    from services.reference.core import ReferenceCore
    from services.reference.server import serve

    core = ReferenceCore(ReferenceConfig(model=str(tiny_model), dtype="float32", token_budget=512))
    server, port, _ = await serve(core, "127.0.0.1:0")
    yield f"127.0.0.1:{port}"
    await server.stop(None)


class Gateway:
    """Publishes what the gateway would: traffic per served choice, feedback per user."""

    def __init__(self, bus: Bus, rollout_addr: str) -> None:
        self.bus, self.client = bus, RolloutClient(rollout_addr)

    async def serve(self, rid: str, prompt: str = "hi", seed: int = 0, tenant: str = "",
                    **override) -> bus_pb2.TrafficEvent:
        (c,) = await self.client.generate([[{"role": "user", "content": prompt}]], n=1, max_tokens=8, seed=seed,
                                          tenant=tenant)
        ev = bus_pb2.TrafficEvent(
            response_id=rid, prompt_ids=c.prompt_token_ids, completion_ids=c.token_ids,
            logprobs=c.logprobs, policy_version=c.policy_version, served_at=time.time(),
            version_spans=[common_pb2.VersionSpan(version=c.policy_version, first_token=0)],
            user="u", choice=0, temperature=1.0, finish_reason=c.finish_reason, tenant=tenant)
        for k, v in override.items():  # what a buggy or older gateway might send
            if not isinstance(v, list):
                setattr(ev, k, v)
            else:
                del getattr(ev, k)[:]
                getattr(ev, k).extend(v)
        await self.bus.js_publish_once(traffic_subject(rid, ev.choice), ev, msg_id=f"{rid}:{ev.choice}")
        return ev

    async def feedback(self, rid: str, score: float | None = 1.0, user: str = "u1", choice: int = 0,
                       tenant: str = "") -> int:
        fb = bus_pb2.FeedbackEvent(response_id=rid, user=user, choice=choice, received_at=time.time(),
                                   tenant=tenant)
        if score is not None:
            fb.score = score
        return (await self.bus.js_publish_once(feedback_subject(tenant), fb, msg_id=f"{rid}:{choice}:{user}")).seq

    async def consumer(self):
        return await self.bus.js.consumer_info("FEEDBACK", DURABLE)

    async def close(self) -> None:
        await self.client.close()


@pytest_asyncio.fixture(loop_scope="module")
async def gateway(nats_server, rollout):
    bus = await Bus.connect(nats_server.url, "gateway")
    await bus.ensure_streams()
    gw = Gateway(bus, rollout)
    yield gw
    await gw.close()
    await bus.close()


async def make_mesh(nats_url: str, rollout_addr: str, run_dir, reference_addr: str = "",
                    tenant: str = "") -> online.OnlineMesh:
    bus = await Bus.connect(nats_url, "trainer")
    publisher = Publisher([rollout_addr], TOKEN, run_dir / "store", bus, "tiny", tenant=tenant)
    return online.OnlineMesh(bus, publisher, ReferenceClient(reference_addr) if reference_addr else None,
                             [RolloutClient(rollout_addr)])


async def close_mesh(mesh: online.OnlineMesh) -> None:
    for c in [*mesh.rollout, *([mesh.reference] if mesh.reference else [])]:
        await c.close()
    await mesh.publisher.close()
    await mesh.bus.close()


def job(tmp_path, **kw) -> OnlineConfig:
    base = {"batch_size": 1, "batch_window_s": 0, "max_steps": 1, "durable": DURABLE,
            "ack_wait_s": 30, "out_dir": str(tmp_path), "run_id": "run"}
    return OnlineConfig(**{**base, **kw})


def records(tmp_path, kind: str = "step") -> list[dict]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)[kind] for x in lines if kind in json.loads(x)]


async def test_batch_of_one_trains_publishes_then_acks_in_one_linked_trace(
        gateway, nats_server, rollout, tmp_path, make_cfg, tiny_model, monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.trainer.recipes import base as recipe_base
    from services.trainer import publish as publisher_module
    from services.trainer.runner import online_status
    from services.trainer.server import TrainerState, serve

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    monkeypatch.setattr(online, "_tracer", tracer)
    monkeypatch.setattr(recipe_base, "_tracer", tracer)  # the runner opens each step's span
    monkeypatch.setattr(publisher_module, "_tracer", tracer)

    await gateway.serve("r1")
    with tracer.start_as_current_span("gateway.feedback") as fb_span:
        seq = await gateway.feedback("r1", 1.0)
    mesh = await make_mesh(nats_server.url, rollout, tmp_path)
    pending_at_publish = []
    real_publish = mesh.publisher.publish

    async def publish(version, adapter):
        info = await gateway.consumer()
        pending_at_publish.append(info.num_ack_pending)  # the feedback is still un-acked here
        return await real_publish(version, adapter)

    mesh.publisher.publish = publish
    state = TrainerState(algorithm="reinforce_tis", dtype="float32")
    server, port, _ = await serve(state, mesh.publisher, "127.0.0.1:0", TOKEN)
    try:
        summary = await asyncio.wait_for(
            online.run(job(tmp_path), make_cfg(), tiny_model, mesh, tmp_path / "run",
                       on_step=online_status(state)), 120)
        async with grpcutil.channel(f"127.0.0.1:{port}") as ch:
            status = await trainer_pb2_grpc.TrainerStub(ch).Status(trainer_pb2.TrainerStatusRequest())
        served = await mesh.rollout[0].status()
    finally:
        await server.stop(None)
        await close_mesh(mesh)

    v = summary["version"]
    assert summary["updates"] == 1 and summary["counters"]["trained"] == 1
    assert pending_at_publish[-1] == 1
    info = await gateway.consumer()
    assert info.num_ack_pending == 0 and info.num_pending == 0
    assert served.latest_version == v  # the replica serves the version trained on the feedback
    assert (status.step, status.latest_version, status.runtime.dtype) == (1, v, "float32")
    (rec,) = records(tmp_path)
    assert rec["seqs"] == [seq] and rec["version"] == v and rec["feedback"] == 1
    assert (tmp_path / "run" / "checkpoints").is_dir()

    spans = exporter.get_finished_spans()
    (step,) = [s for s in spans if s.name == "online.step"]
    assert step.context.trace_id == fb_span.get_span_context().trace_id
    assert step.parent.span_id == fb_span.get_span_context().span_id
    in_step = {s.name for s in spans if s.context.trace_id == step.context.trace_id}
    assert {"consume", "join", "train", "pack", "publish", "checkpoint", "ack"} <= in_step


async def test_a_tenants_loop_trains_its_own_lineage_from_its_own_feedback(
        gateway, nats_server, rollout, tmp_path, make_cfg, tiny_model):
    """[online] tenant = "acme": only acme's feedback trains, the version goes into acme's
    lineage on the replica and is announced for acme only; the default lineage is untouched."""
    before = await gateway.client.status()
    default_kv = await gateway.bus.kv_get(LATEST_KEY, common_pb2.VersionInfo)
    heard: dict[str, list[int]] = {"": [], "acme": []}
    for name in heard:
        async def on(msg, headers, name=name):
            heard[name].append(msg.info.version)
        await gateway.bus.subscribe(weights_subject(name), bus_pb2.WeightsUpdated, on)
    await gateway.serve("acme-1", tenant="acme")
    await gateway.serve("default-1")
    seq = await gateway.feedback("acme-1", 1.0, tenant="acme")
    await gateway.feedback("default-1", 1.0)  # the default tenant's: never this loop's
    mesh = await make_mesh(nats_server.url, rollout, tmp_path, tenant="acme")
    try:
        summary = await asyncio.wait_for(online.run(
            job(tmp_path, tenant="acme"), make_cfg(), tiny_model, mesh, tmp_path / "run"), 120)
    finally:
        await close_mesh(mesh)
    v = summary["version"]
    (rec,) = records(tmp_path)
    assert rec["seqs"] == [seq] and summary["counters"]["trained"] == 1
    after = await gateway.client.status()
    assert [(t.tenant, t.latest_version) for t in after.tenants if t.tenant == "acme"] == [("acme", v)]
    assert after.latest_version == before.latest_version  # the default lineage is untouched
    (c,) = await gateway.client.generate([[{"role": "user", "content": "hi"}]], max_tokens=4, tenant="acme")
    assert (c.tenant, c.policy_version) == ("acme", v)
    kv = await gateway.bus.kv_get(latest_key("acme"), common_pb2.VersionInfo)
    assert kv.version == v and await gateway.bus.kv_get(LATEST_KEY, common_pb2.VersionInfo) == default_kv
    for _ in range(100):  # the announcement was published before the run ended; wait for its delivery
        if heard["acme"]:
            break
        await asyncio.sleep(0.1)
    assert heard == {"": [], "acme": [v]}
    acme = await gateway.bus.js.consumer_info("FEEDBACK", f"{DURABLE}-acme")
    assert acme.num_ack_pending == 0 and acme.num_pending == 0


@pytest.mark.parametrize("where", ["service", "colocated"])
async def test_positive_feedback_raises_the_rewarded_completion_and_negative_lowers(
        gateway, nats_server, rollout, reference, tmp_path, make_cfg, tiny_model, where):
    """With the KL term, its reference from the reference service or, colocated, from the
    trainer's own base with the adapter disabled (the mesh then has no reference client),
    there with LoRA on the top layers, so the step runs the layers below once for both."""
    from services.trainer.learner.policy import LoraPolicy

    good = await gateway.serve("good", prompt="write add", seed=1)
    bad = await gateway.serve("bad", prompt="write sub", seed=2)
    for user in ("a", "b", "c"):
        await gateway.feedback("good", 1.0, user)
        await gateway.feedback("bad", -1.0, user)
    lora = {"r": 4, "alpha": 8.0, "top_layers": 2 if where == "colocated" else None}
    cfg = make_cfg(optimizer={"lr": 5e-3}, loss={"kl_beta": 0.01}, lora=lora)
    policy = LoraPolicy(cfg, tiny_model)
    assert policy.split == (2 if where == "colocated" else None)
    pairs = [(list(e.prompt_ids), list(e.completion_ids)) for e in (good, bad)]
    before = [sum(r) for r in policy.logprobs(pairs)]
    mesh = await make_mesh(nats_server.url, rollout, tmp_path, reference if where == "service" else "")
    try:
        summary = await asyncio.wait_for(online.run(
            job(tmp_path, batch_size=2, batch_window_s=5, max_steps=3, reference=where), cfg, tiny_model,
            mesh, tmp_path / "run", policy=policy), 120)
    finally:
        await close_mesh(mesh)
    after = [sum(r) for r in policy.logprobs(pairs)]
    assert summary["counters"]["trained"] == 6
    assert after[0] > before[0] + 1e-3, (before, after)
    assert after[1] < before[1] - 1e-3, (before, after)
    recs = records(tmp_path)
    assert all("kl" in r["train"] and r["stage_seconds"]["reference"] > 0 for r in recs)


async def test_stale_feedback_is_acked_unused_and_counted(gateway, nats_server, rollout, tmp_path, make_cfg, tiny_model):
    # The mesh has seen version base+5: the trainer publishes its policy above it and measures
    # staleness against that.
    base = (await gateway.client.status()).latest_version
    await gateway.bus.kv_put("latest", common_pb2.VersionInfo(version=base + 5))
    tv = base + 6
    await gateway.serve("old", policy_version=tv - 3, version_spans=[])
    await gateway.serve("mixed", policy_version=tv,
                        version_spans=[common_pb2.VersionSpan(version=tv - 3, first_token=0),
                                       common_pb2.VersionSpan(version=tv, first_token=1)])
    await gateway.serve("aged", policy_version=tv, version_spans=[], served_at=time.time() - 7200)
    await gateway.serve("fresh", policy_version=tv - 2, version_spans=[])  # at the bound: kept
    seqs = {rid: await gateway.feedback(rid) for rid in ("old", "mixed", "aged", "fresh")}
    mesh = await make_mesh(nats_server.url, rollout, tmp_path)
    try:
        summary = await asyncio.wait_for(online.run(
            job(tmp_path, batch_size=8, batch_window_s=3, max_staleness_versions=2, max_staleness_s=3600),
            make_cfg(), tiny_model, mesh, tmp_path / "run"), 120)
    finally:
        await close_mesh(mesh)
    c = summary["counters"]
    assert c["dropped"] == {"stale_version": 2, "stale_age": 1} and c["trained"] == 1
    assert summary["version"] == tv + 1
    assert records(tmp_path)[0]["seqs"] == [seqs["fresh"]]
    settled = {s["seq"]: s["kind"] for s in records(tmp_path, "settled")}
    assert settled == {seqs["old"]: "stale_version", seqs["mixed"]: "stale_version", seqs["aged"]: "stale_age"}
    info = await gateway.consumer()
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_malformed_and_unjoinable_feedback_is_dead_lettered_with_reasons(
        gateway, nats_server, rollout, tmp_path, make_cfg, tiny_model):
    ok = await gateway.serve("ok")
    await gateway.serve("short", logprobs=list(ok.logprobs)[:-1] if len(ok.logprobs) > 1 else [])
    await gateway.feedback("nan", float("nan"))
    await gateway.feedback("big", 2.0)
    await gateway.feedback("unset", None)
    await gateway.feedback("", 1.0)
    await gateway.bus.js_publish_once(FEEDBACK, bus_pb2.FeedbackEvent(response_id="a.b", score=1.0), "a.b:0:u1")
    await gateway.feedback("never-served", 1.0)
    await gateway.feedback("short", 1.0)
    # another tenant's: traffic naming it, on this (the default) tenant's subject, is refused;
    # feedback on its own subject never reaches this loop's consumer
    await gateway.serve("acme-served", tenant="acme")
    await gateway.feedback("acme-served", 1.0)
    acme_fb = bus_pb2.FeedbackEvent(response_id="acme-served", user="u1", score=1.0, tenant="acme")
    await gateway.bus.js_publish_once(feedback_subject("acme"), acme_fb, "acme-served:0:u1")
    good = await gateway.feedback("ok", 1.0)
    mesh = await make_mesh(nats_server.url, rollout, tmp_path)
    try:
        summary = await asyncio.wait_for(online.run(
            job(tmp_path, batch_size=16, batch_window_s=3), make_cfg(), tiny_model, mesh, tmp_path / "run"), 120)
    finally:
        await close_mesh(mesh)
    assert summary["counters"]["dead_lettered"] == {"malformed": 5, "missing_traffic": 1, "bad_traffic": 1,
                                                    "other_tenant": 1}
    assert records(tmp_path)[0]["seqs"] == [good]
    dead = await gateway.bus.pull("DEADLETTER", DEAD, "inspect", bus_pb2.DeadLetter)
    reasons = [m.payload.reason for m in await dead.fetch(20, 2)]
    assert len(reasons) == 8
    for needle in ("outside [-1, 1]", "score not set", "empty response_id", "cannot be a subject",
                   "no traffic record for never-served:0", "completion ids but",
                   "feedback of tenant '' on traffic of tenant 'acme'"):
        assert any(needle in r for r in reasons), (needle, reasons)
    info = await gateway.consumer()
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_metrics_count_feedback_steps_versions_and_the_loop(
        gateway, nats_server, rollout, tmp_path, make_cfg, tiny_model):
    from hotloop import metrics
    from tests.scrape import scrape

    await gateway.serve("ok")
    await gateway.feedback("ok", 1.0)
    await gateway.feedback("never-served", 1.0)  # dead-lettered: no traffic record
    mesh = await make_mesh(nats_server.url, rollout, tmp_path)
    republish = await online.mesh_latest(mesh) > 0  # the policy goes above the mesh's latest first
    om = online.OnlineMetrics()
    endpoint = metrics.serve(om.registry)
    try:
        summary = await asyncio.wait_for(online.run(
            job(tmp_path, batch_size=2, batch_window_s=5), make_cfg(), tiny_model, mesh,
            tmp_path / "run", metrics=om), 120)
        got = await scrape(endpoint.port)
    finally:
        endpoint.close()
        await close_mesh(mesh)
    assert summary["updates"] == 1
    assert got.value("hotloop_trainer_steps_total", result="published") == 1
    assert got.value("hotloop_trainer_steps_total", result="skipped") == 0
    assert got.value("hotloop_trainer_versions_published_total") == 1 + republish
    assert got.value("hotloop_trainer_version") == summary["version"] > 0
    assert got.value("hotloop_trainer_feedback_received_total") == 2
    assert got.value("hotloop_trainer_feedback_trained_total") == 1
    assert got.value("hotloop_trainer_feedback_dead_lettered_total", reason="missing_traffic") == 1
    assert got.value("hotloop_trainer_feedback_dead_lettered_total", reason="malformed") == 0
    assert got.labels("hotloop_trainer_feedback_dropped_total", "reason") == {"stale_version", "stale_age",
                                                                              "shed"}
    assert got.value("hotloop_trainer_feedback_held") == 0 and got.value("hotloop_trainer_feedback_queued") == 0
    # one update, one trained feedback: one step, each stage once, one loop from the gateway
    assert got.value("hotloop_trainer_step_seconds_count") == 1
    assert got.value("hotloop_trainer_stage_seconds_count", stage="train") == 1
    assert got.value("hotloop_trainer_stage_seconds_sum", stage="train") > 0
    assert got.value("hotloop_trainer_loop_seconds_count") == 1
    assert got.value("hotloop_trainer_loop_seconds_sum") >= got.value("hotloop_trainer_stage_seconds_sum",
                                                                       stage="train")
    assert got.type_of("hotloop_trainer_loop_seconds") == "histogram"


def _kill_current_task():
    """Cancel the task running the loop, at this exact point (a kill between two stages)."""
    asyncio.current_task().cancel()


@pytest.mark.parametrize("kill_at", ["after_publish", "after_checkpoint"])
async def test_killed_trainer_resumes_with_nothing_lost_and_nothing_trained_twice(
        kill_at, gateway, nats_server, rollout, tmp_path, make_cfg, tiny_model, monkeypatch):
    from services.trainer.learner.policy import LoraPolicy

    await gateway.serve("x", seed=3)
    await gateway.serve("y", seed=4)
    x = await gateway.feedback("x", 1.0)
    cfg = make_cfg()
    run_job = job(tmp_path, ack_wait_s=2, max_steps=0)

    # ---- first run: killed after its update is published, before the ack
    start = (await gateway.client.status()).latest_version
    first_update = start + 2 if start else 1  # above the policy's own (re)publication
    mesh = await make_mesh(nats_server.url, rollout, tmp_path)
    if kill_at == "after_publish":
        real = mesh.publisher.publish

        async def publish_then_die(version, adapter):
            res = await real(version, adapter)
            if version >= first_update:
                _kill_current_task()
            await asyncio.sleep(0)  # the cancellation lands here: before checkpoint and ack
            return res

        mesh.publisher.publish = publish_then_die
    else:
        async def die_before_ack(items, bus):
            _kill_current_task()
            await asyncio.sleep(0)

        monkeypatch.setattr(online, "ack_all", die_before_ack)
    first = asyncio.create_task(online.run(run_job, cfg, tiny_model, mesh, tmp_path / "run"))
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(first, 120)
    await close_mesh(mesh)
    monkeypatch.undo()
    assert (await gateway.consumer()).num_ack_pending == 1  # not acked: it will come back
    published_first = (await gateway.client.status()).latest_version

    # ---- restart from the checkpoint; y arrives after x's redelivery (ack_wait 2 s)
    async def later():
        await asyncio.sleep(3)
        return await gateway.feedback("y", 1.0)

    y_task = asyncio.create_task(later())
    policy = LoraPolicy(cfg, tiny_model)
    mesh = await make_mesh(nats_server.url, rollout, tmp_path)
    expected = 2 if kill_at == "after_publish" else 1  # x again (its update was lost), then y
    try:
        summary = await asyncio.wait_for(online.run(
            run_job.model_copy(update={"max_steps": expected}), cfg, tiny_model, mesh,
            tmp_path / "run", policy=policy), 120)
    finally:
        await close_mesh(mesh)
    y = await y_task
    trained = [s for r in records(tmp_path) for s in r["seqs"]]
    # after_publish: x's update was lost with the kill, so x trains again (once), then y;
    # after_checkpoint: x is in the checkpoint's trained set, so only y trains
    assert trained == ([x, y] if kill_at == "after_publish" else [y])
    assert policy.step == 2  # two updates in the policy, one per feedback
    assert summary["counters"]["already_trained"] == (0 if kill_at == "after_publish" else 1)
    info = await gateway.consumer()
    assert info.num_ack_pending == 0 and info.num_pending == 0  # nothing lost
    assert summary["version"] > published_first
    assert (await gateway.client.status()).latest_version == summary["version"]


async def test_a_restart_goes_on_with_the_steered_kl_coefficient_only_while_steering(
        gateway, nats_server, rollout, tmp_path, make_cfg, tiny_model):
    """`[online] kl_target`: the lineage's coefficient is in its checkpoint, and a restarted
    trainer trains its next update with it; without a target the configured kl_beta holds."""
    from services.trainer.learner.policy import LoraPolicy

    beta = 0.05
    cfg = make_cfg(optimizer={"lr": 1e-2}, loss={"kl_beta": beta})
    # a target no KL stays under: every update after the first (at the base, KL 0) raises it
    steered = job(tmp_path, reference="colocated", kl_target=1e-12, kl_horizon=1)

    async def train(run_job, n: int, tag: str) -> list[dict]:
        for i in range(n):
            await gateway.serve(f"{tag}{i}", seed=20 + i)
            await gateway.feedback(f"{tag}{i}", 1.0 if i % 2 == 0 else -1.0)
        mesh = await make_mesh(nats_server.url, rollout, tmp_path)
        try:
            await asyncio.wait_for(online.run(run_job.model_copy(update={"max_steps": n}), cfg, tiny_model,
                                              mesh, tmp_path / "run", policy=LoraPolicy(cfg, tiny_model)), 120)
        finally:
            await close_mesh(mesh)
        return records(tmp_path)[-n:]

    first = await train(steered, 2, "k")
    assert [r["kl_coef"] for r in first] == pytest.approx([beta, beta])  # KL 0 at the base: the floor
    assert first[1]["train"]["kl"] > 0
    raised = beta * 1.2  # the second update's KL, far above the target: +20% per feedback at most
    (again,) = await train(steered, 1, "r")  # a new process: a fresh policy, the same run dir
    assert again["kl_coef"] == pytest.approx(raised)
    (fixed,) = await train(job(tmp_path, reference="colocated"), 1, "f")
    assert fixed["kl_coef"] == pytest.approx(beta)


async def test_negative_weight_scales_what_a_rating_below_the_baseline_teaches(
        gateway, nats_server, rollout, tmp_path, make_cfg, tiny_model):
    """`[online] negative_weight` reaches the update: a -1 at the starting baseline (0) is an
    advantage of -1, halved."""
    from services.trainer.learner.policy import LoraPolicy

    cfg = make_cfg()
    await gateway.serve("n0", seed=5)
    await gateway.feedback("n0", -1.0)
    mesh = await make_mesh(nats_server.url, rollout, tmp_path)
    try:
        await asyncio.wait_for(online.run(job(tmp_path, negative_weight=0.5), cfg, tiny_model, mesh,
                                          tmp_path / "run", policy=LoraPolicy(cfg, tiny_model)), 120)
    finally:
        await close_mesh(mesh)
    (rec,) = records(tmp_path)
    assert (rec["score_mean"], rec["advantage_mean"]) == (-1.0, pytest.approx(-0.5))


def _published(tmp_path, version: int) -> dict:
    """The adapter tensors of `version` as the publisher stored (and pushed) it."""
    from safetensors.torch import load

    from hotloop.adapters import read_archive

    archive = read_archive(tmp_path / "store" / "versions" / f"v{version}.tar")
    return load(bytes(archive["adapter_model.safetensors"]))


def _checkpointed(tmp_path, step: int) -> dict:
    """The trained adapter of the run's checkpoint at `step`."""
    from safetensors.torch import load_file

    return load_file(str(tmp_path / "run" / "checkpoints" / f"step-{step:08d}" / "adapter"
                         / "adapter_model.safetensors"))


def _mix(a: dict, b: dict, decay: float) -> dict:
    return {k: decay * a[k] + (1 - decay) * b[k] for k in a}


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


async def test_serve_average_publishes_the_running_average_and_a_restart_goes_on_from_it(
        gateway, nats_server, rollout, tmp_path, make_cfg, tiny_model):
    """`[online] serve_average`: each version is s <- d s + (1 - d) theta of the adapter as
    trained (its checkpoint), starting from the lineage's start; a restarted trainer takes
    s from the checkpoint, so its next version goes on from the last one served."""
    from safetensors.torch import load_file

    from services.trainer.learner.policy import LoraPolicy

    decay = 0.5
    cfg = make_cfg(optimizer={"lr": 1e-2})
    averaged = job(tmp_path, serve_average=decay, reference="colocated")

    async def train(n: int, tag: str, policy: LoraPolicy) -> list[dict]:
        for i in range(n):
            await gateway.serve(f"{tag}{i}", seed=40 + i)
            await gateway.feedback(f"{tag}{i}", 1.0 if i % 2 == 0 else -1.0)
        mesh = await make_mesh(nats_server.url, rollout, tmp_path)
        try:
            await asyncio.wait_for(online.run(averaged.model_copy(update={"max_steps": n}), cfg,
                                              tiny_model, mesh, tmp_path / "run", policy=policy), 120)
        finally:
            await close_mesh(mesh)
        return records(tmp_path)[-n:]

    fresh = LoraPolicy(cfg, tiny_model)
    start = load_file(str(fresh.save_adapter(tmp_path / "start") / "adapter_model.safetensors"))
    first = await train(2, "a", fresh)
    v1, v2 = (r["version"] for r in first)
    theta1, theta2 = _checkpointed(tmp_path, 1), _checkpointed(tmp_path, 2)
    assert not _close(theta1, start) and not _close(theta2, theta1)  # the updates moved it
    assert _close(_published(tmp_path, v1), _mix(start, theta1, decay))
    assert _close(_published(tmp_path, v2), _mix(_published(tmp_path, v1), theta2, decay))
    assert not _close(_published(tmp_path, v2), theta2)
    assert (await gateway.client.status()).latest_version == v2  # what users are served

    (again,) = await train(1, "b", LoraPolicy(cfg, tiny_model))  # a new process, the same run dir
    assert again["version"] == v2 + 1
    assert _close(_published(tmp_path, v2 + 1),
                  _mix(_published(tmp_path, v2), _checkpointed(tmp_path, 3), decay))


async def test_a_stop_that_a_library_swallows_mid_step_still_ends_the_loop(
        gateway, nats_server, rollout, tmp_path, make_cfg, tiny_model):
    """Python 3.11's wait_for (under nats-py's requests) returns its reply when the reply and a
    cancellation land together, and the loop never sees the CancelledError. The loop must end
    after the step in flight, not idle for feedback until its process gives up on it (CI saw a
    SIGTERM'd trainer do that for 10 s). What it trained but did not checkpoint is redelivered."""
    await gateway.serve("s1")
    await gateway.feedback("s1", 1.0)
    mesh = await make_mesh(nats_server.url, rollout, tmp_path)
    real_traffic = mesh.bus.traffic

    async def traffic_swallowing_the_stop(rid, choice):
        tr = await real_traffic(rid, choice)
        asyncio.current_task().cancel()  # the stop lands as the reply does ...
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:  # ... and wait_for returns the reply instead
            pass
        return tr

    mesh.bus.traffic = traffic_swallowing_the_stop
    loop = asyncio.create_task(online.run(job(tmp_path, max_steps=0, checkpoint_interval=10),
                                          make_cfg(), tiny_model, mesh, tmp_path / "run"))
    try:
        done, _ = await asyncio.wait({loop}, timeout=60)
    finally:
        loop.cancel()
        await asyncio.wait({loop})
        await close_mesh(mesh)
    assert done and loop.cancelled(), "the loop idled on after its stop"
    assert [r["feedback"] for r in records(tmp_path)] == [1]  # the step in flight finished
    assert (await gateway.consumer()).num_ack_pending == 1  # not checkpointed: redelivered later


async def test_a_flood_meets_the_bounded_queue_and_nothing_is_lost(
        gateway, nats_server, rollout, tmp_path, make_cfg, tiny_model):
    await gateway.serve("f")
    seqs = [await gateway.feedback("f", 1.0 if i % 2 else -1.0, f"user{i}") for i in range(16)]
    mesh = await make_mesh(nats_server.url, rollout, tmp_path)
    recs = []

    def on_step(rec):
        recs.append(rec)
        if sum(r.feedback for r in recs) == len(seqs):
            _kill_current_task()  # everything trained: stop the endless loop

    task = asyncio.create_task(online.run(
        job(tmp_path, batch_size=2, batch_window_s=0.5, max_queue=4, max_steps=0),
        make_cfg(), tiny_model, mesh, tmp_path / "run", on_step=on_step))
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 180)
        info = await gateway.consumer()
    finally:
        await close_mesh(mesh)
    assert recs[-1].counters["queue_full"] >= 1
    assert info.config.max_ack_pending == 4 + 2
    assert all(r.queue_depth <= 4 for r in recs)
    assert sorted(s for r in recs for s in r.seqs) == seqs  # each once, none lost
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_reference_in_another_dtype_stops_the_job_before_training(
        nats_server, rollout, reference, tmp_path, make_cfg):
    from hotloop.config import MeshConfig
    from services.trainer.runner import open_online

    mesh_cfg = MeshConfig.model_validate({
        "nats": {"url": nats_server.url},
        "endpoints": {"rollout": [rollout], "reference": reference}})
    with pytest.raises(SystemExit, match="reference service computes in float32"):
        await open_online(mesh_cfg, job(tmp_path), make_cfg(dtype="bfloat16", loss={"kl_beta": 0.1}))
