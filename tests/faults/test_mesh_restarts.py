"""A rollout replica killed under `hotloop up` comes back by itself on the latest version.

The whole mesh as `hotloop up` runs it (`apps.launcher.Mesh`, real processes): NATS, two
rollout replicas (vLLM, the tiny model), the gateway and the online trainer. Users chat through
the gateway (official openai client) and rate the answers; the trainer trains on each rating
and publishes a version to both replicas. Then one replica is killed with SIGKILL; meanwhile
users are answered by the other replica (or get a clean 503), and a rating trains a version
the dead replica misses. The supervisor restarts it on its port; it fetches the missed version
from the trainer before it serves, so its first answer is from the latest version, and no
other process was restarted.

Supervision runs in a thread, as `watch` runs it; it is paused while the replica is killed and
the next version published, so that the replica is certainly down meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import openai
import pytest

from hotloop import config
from hotloop.bus import LATEST_KEY, Bus
from hotloop.clients import RolloutClient
from hotloop.errors import Unavailable
from apps.launcher import Mesh, MeshInfo
from hotloop.proto.v1 import common_pb2

pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "Say hello."}]


def write_config(tmp_path, tiny_model):
    path = tmp_path / "mesh.toml"
    path.write_text(f"""
run_dir = "{tmp_path / 'mesh'}"
[model]
name = "{tiny_model}"
dtype = "float32"
max_model_len = 512
[rollout]
kv_cache_gib = 1
max_prompt_tokens = 200
max_new_tokens = 32
default_max_tokens = 8
[gateway]
served_model = "tiny"
max_tokens = 32
default_max_tokens = 8
health_interval_s = 0.3
[trainer]
torch_threads = 1
micro_batch_tokens = 4096
[trainer.lora]
r = 4
alpha = 8.0
[trainer.optimizer]
lr = 1e-3
[trainer.loss]
kl_beta = 0.0
[online]
batch_size = 1
batch_window_s = 0
checkpoint_interval = 1
out_dir = "{tmp_path / 'trainer'}"
run_id = "run"
[up]
rollout_replicas = 2
restart_backoff_s = 0.2
""")
    return path


class Users:
    def __init__(self, info: MeshInfo):
        self.client = openai.AsyncOpenAI(base_url=info.gateway_url, api_key=info.user_key(),
                                         max_retries=0)
        self.feedback_url = f"{info.gateway_url}/feedback"

    async def ask(self):
        return await self.client.chat.completions.create(model="tiny", messages=HI, max_tokens=8)

    async def rate(self, r, score: float = 1.0) -> None:
        import httpx

        async with httpx.AsyncClient() as http:
            fb = await http.post(self.feedback_url, json={"response_id": r.id, "score": score},
                                 headers={"Authorization": f"Bearer {self.client.api_key}"})
        assert fb.status_code == 200 and fb.json()["accepted"], fb.text


async def latest(info: MeshInfo) -> int:
    bus = await Bus.connect(info.nats_url, "test")
    try:
        kv = await bus.kv_get(LATEST_KEY, common_pb2.VersionInfo)
        return kv.version if kv is not None else 0
    finally:
        await bus.close()


async def until_latest(info: MeshInfo, version: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while await latest(info) < version:
        assert time.monotonic() < deadline, f"v{version} was not published within {timeout_s}s"
        await asyncio.sleep(0.2)


async def train_versions(info: MeshInfo, first: int, last: int) -> None:
    """A rated answer per version; each trains one version, which reaches users."""
    users = Users(info)
    for version in range(first, last + 1):
        await users.rate(await users.ask())
        await until_latest(info, version)
        deadline = time.monotonic() + 30
        while (await users.ask()).model_extra["policy_version"] != version:
            assert time.monotonic() < deadline, f"users never got v{version}"


async def while_one_is_down(info: MeshInfo) -> list[int]:
    """Users are served by the live replica, at the newest version, or refused cleanly; one
    rating trains a version the dead replica misses. Returns the versions users got."""
    users = Users(info)
    served = []
    for _ in range(4):
        try:
            r = await users.ask()
        except openai.APIStatusError as e:
            assert e.status_code == 503, e
            continue
        served.append(r.model_extra["policy_version"])
        last = r
    assert served, "the live replica served nobody"
    before = await latest(info)
    assert set(served) == {before}
    await users.rate(last)
    await until_latest(info, before + 1)  # announced: the live replica took it
    return served


async def first_answers(address: str, timeout_s: float = 240) -> tuple[int, int, int]:
    """The restarted replica's first Status (its version, the newest it knows) and the
    version of its first answer, asked as soon as it answers at all."""
    deadline = time.monotonic() + timeout_s
    while True:
        # a fresh channel per try: one that failed for a minute waits out a long backoff
        client = RolloutClient(address)
        try:
            status = await client.status()
            break
        except Unavailable:
            await client.close()
            assert time.monotonic() < deadline, f"{address} did not come back in {timeout_s}s"
            await asyncio.sleep(0.2)
    try:
        (answer,) = await client.generate([HI], max_tokens=4)
        return status.latest_version, status.known_latest_version, answer.policy_version
    finally:
        await client.close()


def test_a_killed_replica_comes_back_by_itself_on_the_latest_version(tmp_path, tiny_model):
    cfg_path = write_config(tmp_path, tiny_model)
    mesh_cfg = config.load_mesh(config.raw_config(cfg_path, environ={}))
    mesh = Mesh(mesh_cfg, str(cfg_path), [], ["rollout", "gateway", "trainer"], quiet=True)
    info = mesh.start(timeout_s=600)
    stop = threading.Event()
    supervisor = threading.Thread(target=mesh.supervise, args=(stop, 0.2))
    try:
        assert [p.name for p in mesh.procs] == ["rollout", "rollout-1", "gateway", "trainer"]
        assert len(set(info.endpoints["rollout"])) == 2
        supervisor.start()
        asyncio.run(train_versions(info, 1, 2))

        stop.set()
        supervisor.join()
        pids, nats_pid = dict(info.pids), mesh.nats.proc.pid
        (victim,) = [p for p in mesh.procs if p.name == "rollout-1"]
        address = f"127.0.0.1:{victim.port}"
        os.kill(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait()
        assert set(asyncio.run(while_one_is_down(info))) == {2}
        assert asyncio.run(latest(info)) == 3

        stop = threading.Event()
        supervisor = threading.Thread(target=mesh.supervise, args=(stop, 0.2))
        supervisor.start()
        version, known, answered = asyncio.run(first_answers(address))
        assert (version, known, answered) == (3, 3, 3)
        assert supervisor.is_alive(), "the supervisor gave up on the mesh"

        # only the killed replica was restarted, on its port; mesh.json says so
        now = MeshInfo.load(info.run_dir)
        assert now.endpoints == info.endpoints
        assert now.pids["rollout-1"] == victim.popen.pid != pids["rollout-1"]
        assert {k: v for k, v in now.pids.items() if k != "rollout-1"} == {
            k: v for k, v in pids.items() if k != "rollout-1"}
        assert mesh.nats.proc.pid == nats_pid

        async def both_serve_v3():
            users = Users(info)
            return [(await users.ask()).model_extra["policy_version"] for _ in range(4)]

        assert asyncio.run(both_serve_v3()) == [3] * 4
    finally:
        stop.set()
        supervisor.join()
        mesh.stop()
