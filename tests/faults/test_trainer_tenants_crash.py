"""A two-tenant online trainer (`python -m services.trainer`, `[online] tenants`) SIGKILLed in
the middle of an update, then restarted with the same run id: per tenant, every feedback is
trained exactly once into the checkpointed lineage, and no version ever goes to another
tenant's lineage, KV key or subject.

Real: nats-server (JetStream), the trainer process, and a gRPC rollout replica that keeps a
lineage per tenant without an engine (tests/trainer/tenants/lineage_replica.py; a vLLM
replica is not what is under test). The test plays the gateway: traffic and feedback on each
tenant's subjects. The kill comes once a tenant has published a trained version that no
checkpoint holds yet (its metrics.jsonl has a step and its checkpoint interval is not reached),
found by polling, not by a fixed sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hotloop.bus import Bus, feedback_subject, latest_key, traffic_subject, weights_subject
from hotloop.proto.v1 import bus_pb2, common_pb2
from services.trainer.tenants.lanes import lane_dir
from tests.trainer.tenants.lineage_replica import start_replica, traffic

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TOKEN = "tenants-crash-token"
TENANTS = ("", "acme")
PER_TENANT = 6
KILL_INTERVAL = 4  # first run: a checkpoint every 4 updates, so updates 1-3 publish uncheckpointed


class Trainer:
    """`python -m services.trainer` training both tenants in one process."""

    def __init__(self, tmp: Path, nats_url: str, rollout: str, model: Path, checkpoint_interval: int):
        self.dir = tmp
        self.port_file = tmp / f"port-{time.monotonic_ns()}.json"
        self.log = tmp / "trainer.log"
        sets = {
            "nats.url": nats_url, "endpoints.rollout": json.dumps([rollout]), "model.name": str(model),
            "security.admin_token": TOKEN, "run_dir": str(tmp), "model.dtype": "float32",
            "trainer.torch_threads": "1", "trainer.lora.r": "4",
            "online.tenants": json.dumps(list(TENANTS)), "online.batch_size": "1",
            "online.batch_window_s": "0", "online.durable": "crash", "online.out_dir": str(tmp),
            "online.run_id": "run", "online.ack_wait_s": "3", "online.max_staleness_versions": "1000",
            "online.checkpoint_interval": str(checkpoint_interval),
        }
        cmd = [sys.executable, "-m", "services.trainer", "--port-file", str(self.port_file)]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOTLOOP__")}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         env={**env, "PYTHONUNBUFFERED": "1"})

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""

    def alive(self) -> None:
        assert self.proc.poll() is None, f"trainer exited {self.proc.returncode}:\n{self.tail()}"

    def stop(self, sig: int = signal.SIGKILL) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(30)


def steps(run_dir: Path, tenant: str) -> list[dict]:
    path = lane_dir(run_dir, tenant) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if "step" in r]


def checkpoint_step(run_dir: Path, tenant: str) -> int:
    """The step of the tenant's latest complete checkpoint (0: none)."""
    root = lane_dir(run_dir, tenant) / "checkpoints"
    names = [p.name for p in root.glob("step-*")] if root.is_dir() else []
    return max((int(n.split("-")[1]) for n in names), default=0)


async def poll(cond, what: str, trainer: Trainer, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        trainer.alive()
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}\n{trainer.tail()}"
        await asyncio.sleep(0.02)


async def test_a_killed_two_tenant_trainer_trains_each_feedback_once_into_its_own_lineage(
        nats_server, tiny_model, tmp_path):
    replica, server, rollout = await start_replica(TOKEN)
    gateway = await Bus.connect(nats_server.url, "gateway")
    await gateway.ensure_streams()
    announced: list[tuple[str, str, int, str]] = []  # (subject's tenant, message's tenant, version, sha)
    for tenant in TENANTS:
        async def on(msg, headers, tenant=tenant):
            announced.append((tenant, msg.tenant, msg.info.version, msg.info.sha256))
        await gateway.subscribe(weights_subject(tenant), bus_pb2.WeightsUpdated, on)
    sent: dict[str, list[int]] = {t: [] for t in TENANTS}
    for i in range(PER_TENANT):
        for tenant in TENANTS:
            rid = f"{tenant or 'default'}-{i}"
            await gateway.js_publish_once(traffic_subject(rid), traffic(rid, tenant, i + 17 * len(tenant)),
                                          msg_id=f"{rid}:0")
            fb = bus_pb2.FeedbackEvent(response_id=rid, user="u1", choice=0, tenant=tenant,
                                       score=1.0 if i % 2 else -1.0, received_at=time.time())
            sent[tenant].append(
                (await gateway.js_publish_once(feedback_subject(tenant), fb, msg_id=f"{rid}:0:u1")).seq)
    run_dir = tmp_path / "run"
    first = second = None
    try:
        # ---- first run: SIGKILL once a tenant's trained version is out but not checkpointed
        first = Trainer(tmp_path, nats_server.url, rollout, tiny_model, KILL_INTERVAL)
        def published_unsaved(t: str) -> bool:
            recs = steps(run_dir, t)
            return bool(recs) and replica.latest.get(t, 0) >= recs[0]["version"] \
                and not checkpoint_step(run_dir, t)

        await poll(lambda: any(published_unsaved(t) for t in TENANTS),
                   "a published update that no checkpoint holds", first)
        first.stop(signal.SIGKILL)
        before = {t: len(steps(run_dir, t)) for t in TENANTS}
        restored = {t: checkpoint_step(run_dir, t) for t in TENANTS}
        assert any(n and not restored[t] for t, n in before.items()), (before, restored)

        # ---- second run, same run id: every feedback ends up trained, checkpointed and acked
        second = Trainer(tmp_path, nats_server.url, rollout, tiny_model, 1)

        def lineage(tenant: str) -> list[int]:
            recs = steps(run_dir, tenant)
            kept = [r for r in recs[:before[tenant]] if r["step"] <= restored[tenant]]
            return [s for r in kept + recs[before[tenant]:] for s in r["seqs"]]

        await poll(lambda: all(sorted(set(lineage(t))) == sent[t] for t in TENANTS),
                   "every feedback in its lineage", second)
        for tenant in TENANTS:  # acked after its checkpoint: nothing left for a next run
            durable = f"crash-{tenant}" if tenant else "crash"
            deadline = time.monotonic() + 30
            while True:
                info = await gateway.js.consumer_info("FEEDBACK", durable)
                if info.num_ack_pending == 0 and info.num_pending == 0:
                    break
                second.alive()
                assert time.monotonic() < deadline, (tenant, info)
                await asyncio.sleep(0.05)
        assert second.stop(signal.SIGTERM) == 0, second.tail()
    finally:
        for t in (first, second):
            if t is not None:
                t.stop()
        await server.stop(None)

    for tenant in TENANTS:
        trained = lineage(tenant)
        assert sorted(trained) == sent[tenant], (tenant, trained)  # none missing, none twice
        recs = steps(run_dir, tenant)
        # the second run's lineage continues the checkpoint it restored, step by step
        assert [r["step"] for r in recs[before[tenant]:]] == list(
            range(restored[tenant] + 1, restored[tenant] + 1 + len(recs) - before[tenant]))
    # a version of one tenant never went to another's lineage, key or subject
    stores = {t: {v["version"]: v["sha256"] for v in map(
        lambda p: json.loads(p.read_text()), (lane_dir(run_dir, t) / "store" / "versions").glob("v*.json"))}
        for t in TENANTS}
    assert announced and all(subject == said for subject, said, _, _ in announced)
    for tenant, _, version, sha in announced:
        assert stores[tenant][version] == sha
    for tenant in TENANTS:
        kv = await gateway.kv_get(latest_key(tenant), common_pb2.VersionInfo)
        assert stores[tenant][kv.version] == kv.sha256
        assert replica.latest[tenant] == max(stores[tenant])
    assert {t for t, _ in replica.pushes} == set(TENANTS)
    await gateway.close()
