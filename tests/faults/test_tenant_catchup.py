"""A rollout replica killed with SIGKILL comes back serving every tenant its latest version.

Real processes and wires: `python -m services.rollout` (vLLM, the tiny model, merged mode with
adapter slots), a real NATS, and a real trainer `FetchAdapter` server on port 0 with one
`Publisher` per tenant (acme at v2, globex at v1), which push into the replica's lineages and
announce on each tenant's KV key and subject. The replica is killed and restarted on its port
(it starts empty); before it serves it lists the tenants' KV keys and fetches each tenant's
latest version from the trainer, so its first answer to each tenant is from that version, not
the base model.
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

from hotloop import grpcutil
from hotloop.bus import Bus
from hotloop.errors import NotFound
from hotloop.proto.v1 import rollout_pb2, rollout_pb2_grpc
from services.trainer.recipes.publisher import Publisher
from services.trainer.server import TrainerState, serve
from tests.rollout.test_rollout_tenants import greedy, spans
from tests.scrape import scrape
from tests.trainer.recipes.test_publisher import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-admin-token-tenant-catchup"
LATEST = {"acme": 2, "globex": 1}


def write_config(tmp_path: Path, tiny_model: Path, nats_url: str, trainer: str, port: int) -> Path:
    path = tmp_path / "replica.toml"
    path.write_text(f"""
run_dir = "{tmp_path / 'run'}"
[model]
name = "{tiny_model}"
max_model_len = 512
[nats]
url = "{nats_url}"
[security]
admin_token = "{TOKEN}"
[endpoints]
trainer = "{trainer}"
[rollout]
port = {port}
update_mode = "merged"
tenant_slots = 2
kv_cache_gib = 1
max_prompt_tokens = 200
max_new_tokens = 32
catchup_timeout_s = 60
""")
    return path


class ReplicaProcess:
    def __init__(self, config: Path, tmp_path: Path):
        self.config, self.port_file = config, tmp_path / "replica.port"
        self.log = tmp_path / "replica.log"
        self.proc: subprocess.Popen | None = None
        self.groups: list[int] = []  # process groups started (the engine's processes are in them)

    def start(self) -> None:
        self.port_file.unlink(missing_ok=True)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO))
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.rollout", "--config", str(self.config),
                 "--port-file", str(self.port_file)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.groups.append(self.proc.pid)

    async def serving(self, timeout_s: float = 300) -> dict:
        """The port file, once the replica serves (it is written after catch-up)."""
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            assert self.proc.poll() is None, f"the replica exited:\n{self.tail()}"
            assert time.monotonic() < deadline, f"not serving in {timeout_s}s:\n{self.tail()}"
            await asyncio.sleep(0.2)
        return json.loads(self.port_file.read_text())

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Kill every process either replica started, its engine's included (a process
        killed mid-start may leave an engine process that had not armed its death signal)."""
        for group in self.groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""


async def test_a_restarted_replica_serves_each_tenant_its_latest_version_first(
        tmp_path, tiny_model, adapter_factory, nats_server):
    adapters_for = {("acme", 1): adapter_factory(seed=71, scale=5.0),
                    ("acme", 2): adapter_factory(seed=72, scale=5.0),
                    ("globex", 1): adapter_factory(seed=73, scale=5.0)}
    port = free_port()
    address = f"127.0.0.1:{port}"
    bus = await Bus.connect(nats_server.url, "trainer")
    publishers = {t: Publisher([address], TOKEN, tmp_path / f"store-{t}", bus, str(tiny_model),
                               tenant=t) for t in LATEST}

    def stores(tenant: str):
        if tenant not in publishers:
            raise NotFound(f"this trainer does not train tenant {tenant!r}")
        return publishers[tenant].store

    server, trainer_port, _ = await serve(TrainerState(), stores, "127.0.0.1:0", TOKEN)
    for p in publishers.values():
        p.fetch_from = f"127.0.0.1:{trainer_port}"
    replica = ReplicaProcess(
        write_config(tmp_path, tiny_model, nats_server.url, f"127.0.0.1:{trainer_port}", port),
        tmp_path)
    ch = grpcutil.channel(address)
    stub = rollout_pb2_grpc.RolloutStub(ch)
    try:
        replica.start()
        await replica.serving()
        for (tenant, version), adapter in adapters_for.items():
            result = await publishers[tenant].publish(version, adapter)
            assert result.announced and address in result.pushes
        base = await greedy(stub, "")  # the default lineage has no version: the base model
        before = {t: await greedy(stub, t) for t in LATEST}
        for t, c in before.items():
            assert c.tenant == t and spans(c) == [(LATEST[t], 0)]
            assert list(c.token_ids) != list(base.token_ids), t

        replica.kill()
        replica.start()  # on its port, empty: versions lived in the engine and a scratch dir
        ports = await replica.serving()
        # its first answer to each tenant: that tenant's latest version, never the base
        for t in LATEST:
            first = await greedy(stub, t)
            assert first.tenant == t and spans(first) == [(LATEST[t], 0)], (t, spans(first))
            assert list(first.token_ids) == list(before[t].token_ids), t
        st = await stub.Status(rollout_pb2.StatusRequest())
        listed = {v.tenant: (v.latest_version, v.known_latest_version, v.catch_up)
                  for v in st.tenants}
        assert listed == {t: (v, v, "") for t, v in LATEST.items()}
        got = await scrape(ports["metrics_port"])
        for t, v in LATEST.items():
            assert got.value("hotloop_rollout_known_latest_version", tenant=t) == v
            assert got.value("hotloop_rollout_behind", tenant=t) == 0
            assert got.value("hotloop_rollout_catchup_fetches_total", tenant=t,
                             result="loaded") == 1
    finally:
        replica.stop()
        await ch.close()
        await server.stop(0)
        for p in publishers.values():
            await p.close()
        await bus.close()
