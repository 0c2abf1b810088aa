"""A rollout replica killed under `hotloop up` comes back by itself on every tenant's latest
version.

The whole mesh as `hotloop up` runs it (`launch.mesh.Mesh`, real processes): NATS, two
rollout replicas (vLLM, the tiny model, merged mode with tenant slots), the gateway and one
online trainer for two tenants (`[online] tenants = ["", "acme"]`: a lane each). Each tenant's
users (an API key each: the default's and acme's, `[tenants.acme] keys`) chat through the
gateway (official openai client) and rate the answers; the trainer trains each lineage on its
own tenant's ratings and publishes its versions to both replicas (the default lineage to v2,
acme's to v1: numbers that differ, so that a mix-up shows). Then one replica is killed with
SIGKILL; meanwhile each tenant's users are answered by the other replica from their own
lineage (or get a clean 503), and a rating of each trains a version of each lineage that the
dead replica misses (v3, acme v2). The supervisor restarts it on its port (it starts empty);
it lists the lineages on the bus and fetches each one's missed version from the trainer before
it serves, so its first answer to each tenant (its own Generate, asked directly) is from that
tenant's latest version: the version spans say so, and its tokens and logprobs are the live
replica's at that version, not the base model's nor the other lineage's. No other process was
restarted.

Supervision runs in a thread, as `watch` runs it; it is paused while the replica is killed and
the next versions published, so that the replica is certainly down meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import threading
import time
from urllib.parse import urlparse

import openai
import pytest

from hotloop import config
from hotloop.bus import Bus, latest_key
from hotloop.clients import Completion, RolloutClient
from hotloop.errors import Unavailable
from launch.mesh import Mesh, MeshInfo
from hotloop.proto.v1 import common_pb2
from tests.scrape import scrape

pytestmark = pytest.mark.slow
HI = [{"role": "user", "content": "Say hello."}]
TENANTS = ("", "acme")
BEFORE = {"": 2, "acme": 1}  # each lineage's latest when the replica is killed
LATEST = {t: v + 1 for t, v in BEFORE.items()}  # ... and when it is back: one it missed
BASE_PROBE = "never-announced"  # a tenant with no lineage: served the base model


def write_config(tmp_path, tiny_model) -> tuple[object, dict[str, str]]:
    """The mesh's config and each tenant's user key (a key file of `id:key` lines)."""
    keys = {t: f"sk-hotloop-{secrets.token_hex(24)}" for t in TENANTS}
    keys_file = tmp_path / "user-keys"
    keys_file.write_text(f"local:{keys['']}\nacme-user:{keys['acme']}\n")
    keys_file.chmod(0o600)
    path = tmp_path / "mesh.toml"
    path.write_text(f"""
run_dir = "{tmp_path / 'mesh'}"
[model]
name = "{tiny_model}"
dtype = "float32"
max_model_len = 512
[security]
user_tokens_file = "{keys_file}"
[tenants.acme]
keys = ["acme-user"]
[rollout]
update_mode = "merged"
tenant_slots = 2
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
tenants = ["", "acme"]
batch_size = 1
batch_window_s = 0
checkpoint_interval = 1
out_dir = "{tmp_path / 'trainer'}"
run_id = "run"
[up]
rollout_replicas = 2
restart_backoff_s = 0.2
""")
    return path, keys


class Users:
    """One tenant's users, through the gateway with the tenant's key."""

    def __init__(self, info: MeshInfo, tenant: str, key: str):
        self.tenant = tenant
        self.client = openai.AsyncOpenAI(base_url=info.gateway_url, api_key=key, max_retries=0)
        self.feedback_url = f"{info.gateway_url}/feedback"

    async def ask(self):
        """An answer, checked to come from this tenant's lineage (the gateway says which)."""
        raw = await self.client.chat.completions.with_raw_response.create(
            model="tiny", messages=HI, max_tokens=8)
        assert raw.headers["x-hotloop-tenant"] == self.tenant, dict(raw.headers)
        return raw.parse()

    async def version(self) -> int:
        return (await self.ask()).model_extra["policy_version"]

    async def rate(self, r, score: float = 1.0) -> None:
        import httpx

        async with httpx.AsyncClient() as http:
            fb = await http.post(self.feedback_url, json={"response_id": r.id, "score": score},
                                 headers={"Authorization": f"Bearer {self.client.api_key}"})
        assert fb.status_code == 200 and fb.json()["accepted"], fb.text


async def latest(info: MeshInfo, tenant: str) -> int:
    """The version the mesh announced last for `tenant`'s lineage (0: none)."""
    bus = await Bus.connect(info.nats_url, "test")
    try:
        kv = await bus.kv_get(latest_key(tenant), common_pb2.VersionInfo)
        return kv.version if kv is not None else 0
    finally:
        await bus.close()


async def until_latest(info: MeshInfo, tenant: str, version: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while await latest(info, tenant) < version:
        assert time.monotonic() < deadline, f"{tenant!r} v{version} not published in {timeout_s}s"
        await asyncio.sleep(0.2)


async def train_versions(users: Users, info: MeshInfo, last: int) -> None:
    """A rated answer per version of the users' lineage; each trains one, which reaches them."""
    for version in range(1, last + 1):
        await users.rate(await users.ask())
        await until_latest(info, users.tenant, version)
        deadline = time.monotonic() + 30
        while await users.version() != version:
            assert time.monotonic() < deadline, f"{users.tenant!r} users never got v{version}"


async def while_one_is_down(users: Users, info: MeshInfo) -> list[int]:
    """The tenant's users are served by the live replica, at their lineage's newest version, or
    refused cleanly; one rating trains a version the dead replica misses. Returns the versions
    users got."""
    served = []
    for _ in range(4):
        try:
            r = await users.ask()
        except openai.APIStatusError as e:
            assert e.status_code == 503, e
            continue
        served.append(r.model_extra["policy_version"])
        last = r
    assert served, f"the live replica served none of {users.tenant!r}'s users"
    before = await latest(info, users.tenant)
    assert set(served) == {before}
    await users.rate(last)
    await until_latest(info, users.tenant, before + 1)  # announced: the live replica took it
    return served


async def greedy(client: RolloutClient, tenant: str) -> Completion:
    (c,) = await client.generate([HI], max_tokens=6, temperature=0, tenant=tenant)
    return c


async def first_answers(address: str, live: str, timeout_s: float = 240):
    """The restarted replica's first Status and its first answer to each tenant (asked as soon
    as it answers at all), and the live replica's answers to the same (and to a tenant with no
    lineage: the base model)."""
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
    other = RolloutClient(live)
    try:
        first = {t: await greedy(client, t) for t in TENANTS}
        theirs = {t: await greedy(other, t) for t in (*TENANTS, BASE_PROBE)}
        return status, first, theirs
    finally:
        await client.close()
        await other.close()


def same(a: Completion, b: Completion) -> bool:
    """The same tokens with the same logprobs (the same weights: one version, merged or in a
    slot from the same archive on either replica)."""
    return a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_killed_replica_comes_back_by_itself_on_every_tenants_latest_version(tmp_path, tiny_model):
    cfg_path, keys = write_config(tmp_path, tiny_model)
    mesh_cfg = config.load_mesh(config.raw_config(cfg_path, environ={}))
    mesh = Mesh(mesh_cfg, str(cfg_path), [], ["rollout", "gateway", "trainer"], quiet=True)
    info = mesh.start(timeout_s=600)

    def users():  # an HTTP client belongs to one event loop: one per asyncio.run
        return {t: Users(info, t, keys[t]) for t in TENANTS}

    stop = threading.Event()
    supervisor = threading.Thread(target=mesh.supervise, args=(stop, 0.2))
    try:
        assert [p.name for p in mesh.procs] == ["rollout", "rollout-1", "gateway", "trainer"]
        assert len(set(info.endpoints["rollout"])) == 2
        supervisor.start()

        async def train_both():  # the trainer's two lanes train side by side
            u = users()
            await asyncio.gather(*(train_versions(u[t], info, BEFORE[t]) for t in TENANTS))

        asyncio.run(train_both())

        stop.set()
        supervisor.join()
        pids, nats_pid = dict(info.pids), mesh.nats.proc.pid
        (victim,) = [p for p in mesh.procs if p.name == "rollout-1"]
        address = f"127.0.0.1:{victim.port}"
        (live,) = set(info.endpoints["rollout"]) - {address}
        os.kill(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait()

        async def both_while_down():
            u = users()
            return await asyncio.gather(*(while_one_is_down(u[t], info) for t in TENANTS))

        served = asyncio.run(both_while_down())
        assert [set(s) for s in served] == [{BEFORE[t]} for t in TENANTS]
        assert {t: asyncio.run(latest(info, t)) for t in TENANTS} == LATEST

        stop = threading.Event()
        supervisor = threading.Thread(target=mesh.supervise, args=(stop, 0.2))
        supervisor.start()
        status, first, theirs = asyncio.run(first_answers(address, live))
        assert supervisor.is_alive(), "the supervisor gave up on the mesh"
        # it serves only once every lineage caught up: its first Status says so ...
        assert (status.latest_version, status.known_latest_version) == (LATEST[""], LATEST[""])
        assert {v.tenant: (v.latest_version, v.known_latest_version, v.catch_up)
                for v in status.tenants} == {"acme": (LATEST["acme"], LATEST["acme"], "")}
        # ... and its first answer to each tenant is from that tenant's latest version: the
        # live replica's answer at it, never the base model's nor the other lineage's
        assert theirs[BASE_PROBE].version_spans == [(0, 0)]
        for t in TENANTS:
            assert first[t].tenant == t and first[t].version_spans == [(LATEST[t], 0)], (t, first[t])
            assert theirs[t].version_spans == [(LATEST[t], 0)]
            assert same(first[t], theirs[t]), (t, first[t], theirs[t])
            for other in {BASE_PROBE, *TENANTS} - {t}:
                assert not same(first[t], theirs[other]), (t, other)
        # each lineage was fetched once at start-up; it is not behind on any
        got = asyncio.run(scrape(urlparse(info.metrics["rollout-1"]).port))
        for t, v in LATEST.items():
            assert got.value("hotloop_rollout_known_latest_version", tenant=t) == v
            assert got.value("hotloop_rollout_behind", tenant=t) == 0
            assert got.value("hotloop_rollout_catchup_fetches_total", tenant=t,
                             result="loaded") == 1, t

        # only the killed replica was restarted, on its port; mesh.json says so
        now = MeshInfo.load(info.run_dir)
        assert now.endpoints == info.endpoints
        assert now.pids["rollout-1"] == victim.popen.pid != pids["rollout-1"]
        assert {k: v for k, v in now.pids.items() if k != "rollout-1"} == {
            k: v for k, v in pids.items() if k != "rollout-1"}
        assert mesh.nats.proc.pid == nats_pid

        async def all_serve_latest():
            u = users()
            return {t: [await u[t].version() for _ in range(4)] for t in TENANTS}

        assert asyncio.run(all_serve_latest()) == {t: [v] * 4 for t, v in LATEST.items()}
    finally:
        stop.set()
        supervisor.join()
        mesh.stop()
