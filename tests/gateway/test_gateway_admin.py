"""The tenant admin API through real gateways (HTTP on port 0) sharing one real NATS: tenants
created on one replica serve on another, deletes cut keys off everywhere, resets and holds
reach a registry watcher, exports come from a real trainer `FetchAdapter` and are checked, and every
admin endpoint refuses anyone without the admin token."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import tarfile
import time

import httpx
import openai
import pytest
import pytest_asyncio

from hotloop import adapters
from hotloop import bus as hbus
from hotloop.proto.v1 import bus_pb2, common_pb2
from hotloop.tenants import Registry

from .conftest import ANON_KEY, KEY, start_gateway
from .fake_rollout import start_fake

pytestmark = pytest.mark.asyncio(loop_scope="module")
ADMIN = "admin-token-0123456789"
HI = [{"role": "user", "content": "hi"}]
TENANTS = {"acme": ["alice"]}  # a config tenant; alice's key is KEY
BASE = "tiny-base"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(nats_module):
    fake, server, addr = await start_fake(version=3)
    one = await start_gateway([addr], nats_module.url, tenants=TENANTS, admin_token=ADMIN)
    two = await start_gateway([addr], nats_module.url, tenants=TENANTS, admin_token=ADMIN)
    yield fake, one, two, addr
    await two.stop()
    await one.stop()
    await server.stop(0)


async def call(method: str, url: str, token: str | None = ADMIN, **kw) -> httpx.Response:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.request(method, url, headers=headers, **kw)


async def chat(gw, key: str) -> str:
    async with gw.openai(key) as client:  # closed here, not at GC on a closed loop
        r = await client.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
    return r.choices[0].message.content


async def until(cond, what: str, timeout_s: float = 10.0) -> float:
    """Poll the async `cond()` until true; returns the seconds it took."""
    t0 = time.monotonic()
    while not await cond():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def works(gw, key: str) -> bool:
    try:
        await chat(gw, key)
        return True
    except openai.AuthenticationError:
        return False


async def refused(gw, key: str) -> bool:
    return not await works(gw, key)


async def test_a_created_tenant_serves_on_every_replica_until_deleted(rig):
    fake, one, two, _ = rig
    r = await call("POST", f"{one.admin_url}/tenants", json={"name": "initech"})
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["tenant"] == "initech" and made["key_id"].startswith("initech-")
    key = made["api_key"]
    assert await chat(one, key) and fake.requests[-1].tenant == "initech"  # served as the tenant
    took = await until(lambda: works(two, key), "the key works on the second gateway")
    assert fake.requests[-1].tenant == "initech"
    print(f"a key minted on one gateway worked on the other after {took * 1e3:.0f} ms")

    r = await call("POST", f"{two.admin_url}/tenants/initech/keys")
    assert r.status_code == 201 and r.json()["key_id"] != made["key_id"]
    second = r.json()["api_key"]
    await until(lambda: works(one, second), "the second key works on the first gateway")

    record = (await call("GET", f"{one.admin_url}/tenants/initech")).json()
    assert record["source"] == "api" and sorted(record["key_ids"]) == sorted(
        [made["key_id"], r.json()["key_id"]]) and record["generation"] == 0
    assert key not in str(await Registry(one.bus).get("initech"))  # digests only

    await two.admin.close()  # the replica that deletes applies it itself, not via its watch
    try:
        r = await call("DELETE", f"{two.admin_url}/tenants/initech")
        assert r.status_code == 200 and r.json()["deleted"]
        for k in (key, second):  # at once on the gateway that deleted it
            assert await refused(two, k)
    finally:
        await two.admin.start()
    took = await until(lambda: refused(one, key), "the key is refused on the other gateway")
    assert await refused(one, second)
    print(f"a deleted tenant's key was refused by the other gateway after {took * 1e3:.0f} ms")
    assert (await call("GET", f"{one.admin_url}/tenants/initech")).status_code == 404
    assert (await call("DELETE", f"{one.admin_url}/tenants/initech")).status_code == 404
    assert await works(one, KEY)  # config keys never depended on the registry


async def test_a_restarted_gateway_knows_registry_keys_before_its_first_request(rig, nats_module):
    _, one, _, addr = rig
    key = (await call("POST", f"{one.admin_url}/tenants", json={"name": "hooli"})).json()["api_key"]
    fresh = await start_gateway([addr], nats_module.url, tenants=TENANTS, admin_token=ADMIN)
    try:
        assert fresh.core.tenants.tenant_of(fresh.core.authenticate(f"Bearer {key}")) == "hooli"
    finally:
        await fresh.stop()
        await call("DELETE", f"{one.admin_url}/tenants/hooli")


async def test_a_gateway_with_no_config_keys_serves_the_tenants_created_through_it(rig, nats_module):
    """Tenants only from the admin API: with an admin token a gateway needs no config key; it
    refuses every key until a tenant is created, then serves that tenant's."""
    fake, _, _, addr = rig
    bare = await start_gateway([addr], nats_module.url, keys=[], admin_token=ADMIN)
    try:
        assert await refused(bare, KEY)  # another gateway's config key is not this one's
        r = await call("POST", f"{bare.admin_url}/tenants", json={"name": "globex"})
        assert r.status_code == 201, r.text
        assert await chat(bare, r.json()["api_key"]) and fake.requests[-1].tenant == "globex"
    finally:
        await call("DELETE", f"{bare.admin_url}/tenants/globex")
        await bare.stop()


async def test_the_same_name_created_on_two_gateways_at_once_is_created_once(rig):
    _, one, two, _ = rig
    for i in range(4):
        name = f"race-{i}"
        got = await asyncio.gather(*(call("POST", f"{gw.admin_url}/tenants", json={"name": name})
                                     for gw in (one, two)))
        assert sorted(r.status_code for r in got) == [201, 409], [r.text for r in got]
        (winner,) = [r.json() for r in got if r.status_code == 201]
        record = (await call("GET", f"{one.admin_url}/tenants/{name}")).json()
        assert record["key_ids"] == [winner["key_id"]]
        await call("DELETE", f"{one.admin_url}/tenants/{name}")


@contextlib.asynccontextmanager
async def watching(bus, view):
    """A registry watcher past its replay: yields a queue of `view(name, record)` for each
    change after it (a view of None is left out)."""
    ready, seen = asyncio.Event(), asyncio.Queue()

    async def watch():
        async for name, record in Registry(bus).watch(ready):
            if (v := view(name, record)) is not None:
                await seen.put(v)

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait_for(ready.wait(), 10)
        while not seen.empty():
            seen.get_nowait()  # the replay
        yield seen
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def test_a_reset_bumps_the_generation_and_a_watcher_sees_it(rig):
    _, one, two, _ = rig
    await call("POST", f"{one.admin_url}/tenants", json={"name": "umbrella"})
    async with watching(one.bus, lambda name, record: (
            name, record and record.generation, record and record.config)) as seen:
        r = await call("POST", f"{two.admin_url}/tenants/umbrella/reset")
        assert r.status_code == 202 and r.json() == {"tenant": "umbrella", "generation": 1,
                                                     "to_version": 0}
        assert await asyncio.wait_for(seen.get(), 10) == ("umbrella", 1, False)
        # a config tenant can be reset too: its record carries the generation only
        r = await call("POST", f"{one.admin_url}/tenants/acme/reset")
        assert r.status_code == 202 and r.json()["generation"] == 1
        assert await asyncio.wait_for(seen.get(), 10) == ("acme", 1, True)
        await call("DELETE", f"{one.admin_url}/tenants/umbrella")
        assert await asyncio.wait_for(seen.get(), 10) == ("umbrella", None, None)
    listed = {t["name"]: t for t in (await call("GET", f"{one.admin_url}/tenants")).json()["tenants"]}
    assert listed["acme"] == {"name": "acme", "source": "config", "key_ids": ["alice"],
                              "generation": 1, "created_at": None, "latest_version": 0,
                              "held": False}
    assert "umbrella" not in listed
    assert await works(one, KEY)  # a reset changes no key


async def test_a_hold_and_a_resume_reach_a_watcher_and_the_tenant_view(rig):
    _, one, two, _ = rig
    await call("POST", f"{one.admin_url}/tenants", json={"name": "parasol"})
    try:
        async with watching(one.bus, lambda name, record: None if record is None else (
                name, record.held, record.generation, record.config)) as seen:
            r = await call("POST", f"{two.admin_url}/tenants/parasol/hold")
            assert r.status_code == 202 and r.json() == {"tenant": "parasol", "held": True,
                                                         "latest_version": 0}
            assert await asyncio.wait_for(seen.get(), 10) == ("parasol", True, 0, False)
            assert (await call("GET", f"{one.admin_url}/tenants/parasol")).json()["held"] is True
            r = await call("POST", f"{two.admin_url}/tenants/parasol/hold")  # held already: no change
            assert r.status_code == 202 and r.json()["held"] is True
            r = await call("POST", f"{one.admin_url}/tenants/parasol/resume")
            assert r.status_code == 202 and r.json()["held"] is False
            assert await asyncio.wait_for(seen.get(), 10) == ("parasol", False, 0, False)
            # a config tenant can be held too (its record carries the hold and generation only),
            # and a hold keeps the generation a reset wrote
            r = await call("POST", f"{one.admin_url}/tenants/acme/hold")
            assert r.status_code == 202 and r.json()["held"] is True
            name, held, generation, config = await asyncio.wait_for(seen.get(), 10)
            assert (name, held, config) == ("acme", True, True)
            assert generation == (await Registry(one.bus).get("acme")).generation
            assert (await call("GET", f"{two.admin_url}/tenants/acme")).json()["held"] is True
            assert (await call("POST", f"{one.admin_url}/tenants/acme/resume")).json()["held"] is False
            assert await asyncio.wait_for(seen.get(), 10) == ("acme", False, generation, True)
    finally:
        await call("DELETE", f"{one.admin_url}/tenants/parasol")
    assert await works(one, KEY)  # a hold changes no key


async def test_config_tenants_and_bad_names_are_refused_with_the_reason(rig):
    _, one, _, _ = rig
    for method, path, body in (("POST", "/tenants", {"name": "acme"}), ("POST", "/tenants/acme/keys", None),
                               ("DELETE", "/tenants/acme", None)):
        r = await call(method, one.admin_url + path, json=body)
        assert r.status_code == 409 and "declared in config" in r.json()["error"]["message"], r.text
    for name in ("Acme", "a.b", "x" * 33, ""):
        r = await call("POST", f"{one.admin_url}/tenants", json={"name": name})
        assert r.status_code == 400, (name, r.text)
    assert (await call("POST", f"{one.admin_url}/tenants", json={})).status_code == 400
    assert (await call("POST", f"{one.admin_url}/tenants/nobody/keys")).status_code == 404
    assert (await call("POST", f"{one.admin_url}/tenants/nobody/reset")).status_code == 404
    assert (await call("POST", f"{one.admin_url}/tenants/nobody/hold")).status_code == 404
    assert (await call("POST", f"{one.admin_url}/tenants/nobody/resume")).status_code == 404
    assert (await call("POST", f"{one.admin_url}/tenants/Acme/hold")).status_code == 400
    assert (await call("GET", f"{one.admin_url}/tenants/nobody/adapter")).status_code == 404


ADMIN_CALLS = [("POST", "/admin/tenants", {"name": "mallory"}), ("GET", "/admin/tenants", None),
               ("GET", "/admin/tenants/acme", None), ("POST", "/admin/tenants/acme/keys", None),
               ("POST", "/admin/tenants/acme/reset", None), ("POST", "/admin/tenants/acme/hold", None),
               ("POST", "/admin/tenants/acme/resume", None), ("DELETE", "/admin/tenants/acme", None),
               ("GET", "/admin/tenants/acme/adapter", None)]


async def test_every_admin_endpoint_refuses_without_the_admin_token(rig, nats_module):
    _, one, _, addr = rig
    root = f"http://127.0.0.1:{one.http.port}"
    for method, path, body in ADMIN_CALLS:
        for token, status in ((None, 401), ("wrong-token-123456", 401), (ADMIN + "x", 401),
                              (KEY, 403), (ANON_KEY, 403)):
            r = await call(method, root + path, token, json=body)
            assert r.status_code == status, (method, path, token, r.text)
    assert "mallory" not in {t["name"] for t in (await call("GET", f"{root}/admin/tenants")).json()["tenants"]}
    closed = await start_gateway([addr], nats_module.url, tenants=TENANTS)  # no admin token
    try:
        for method, path, body in ADMIN_CALLS:
            for token in (None, ADMIN, KEY):
                r = await call(method, f"http://127.0.0.1:{closed.http.port}{path}", token, json=body)
                assert r.status_code == 403 and "admin API disabled" in r.json()["error"]["message"]
    finally:
        await closed.stop()


# ---- export ------------------------------------------------------------------------------
class Trainer:
    """A real trainer `FetchAdapter` server over a tenant's `Publisher` (no replicas: each
    version is announced at once)."""

    async def start(self, tmp_path, bus, tenant: str, token: str = ADMIN):
        from services.trainer.publish import Publisher
        from services.trainer.server import TrainerState, serve

        self.publisher = Publisher([], token, tmp_path / "store", bus, BASE, tenant=tenant)
        self.server, port, _ = await serve(TrainerState(), self.publisher, "127.0.0.1:0", token)
        self.address = self.publisher.fetch_from = f"127.0.0.1:{port}"
        return self

    async def stop(self):
        await self.server.stop(0)
        await self.publisher.close()


def unpack(data: bytes, dest) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
        tar.extractall(dest, filter="data")
    return names


async def test_export_streams_the_latest_version_checked_and_only_to_its_tenant(
        rig, nats_module, tmp_path, adapter_factory):
    from peft import PeftConfig
    from safetensors import safe_open

    from apps.audit import ADAPTERS, load_exports
    from apps.tenant_demo import export_adapters

    _, one, two, _ = rig
    made = (await call("POST", f"{one.admin_url}/tenants", json={"name": "wayne"})).json()
    user = made["api_key"]
    await until(lambda: works(two, user), "the key works on the second gateway")
    r = await call("GET", f"{one.admin_url}/tenants/wayne/adapter")
    assert r.status_code == 404 and "no adapter version yet" in r.json()["error"]["message"]

    trainer = await Trainer().start(tmp_path, one.bus, "wayne")
    try:
        published = (await trainer.publisher.publish(1, adapter_factory(seed=3, r=4))).version
        # gateway one learns the trainer from the announcement; gateway two may have heard it too
        await until(lambda: _async(one.admin.fetch_from.get("wayne") == trainer.address),
                    "the announcement reached the gateway")
        r = await call("GET", f"{one.admin_url}/tenants/wayne/adapter")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/x-tar"
        assert r.headers["x-hotloop-policy-version"] == "1"
        kv = await one.bus.kv_get(hbus.latest_key("wayne"), common_pb2.VersionInfo)
        assert hashlib.sha256(r.content).hexdigest() == kv.sha256 == published.sha256
        assert r.headers["x-hotloop-adapter-sha256"] == kv.sha256
        names = unpack(r.content, tmp_path / "export")
        assert sorted(names) == sorted(adapters.FILES)
        cfg = PeftConfig.from_pretrained(tmp_path / "export")
        assert cfg.peft_type.value == "LORA" and cfg.r == 4
        with safe_open(tmp_path / "export" / "adapter_model.safetensors", "np") as f:
            tensors = list(f.keys())
        assert tensors and all("lora_" in t for t in tensors)

        # the tenant's own user gets the same archive; nobody else gets it
        mine = await call("GET", f"{one.base_url}/adapter", user)
        assert mine.status_code == 200 and mine.content == r.content
        # as the tenant demo exports each tenant's adapter for its audit (apps/audit.py)
        got = await export_adapters(one.base_url.removesuffix("/v1"), {"wayne": user, "acme": KEY},
                                    tmp_path / "demo" / ADAPTERS)
        assert got["wayne"] == 1 and got["acme"].startswith("HTTP 404")
        (saved,) = load_exports(tmp_path / "demo").values()
        assert (saved.tenant, saved.version, saved.sha256) == ("wayne", 1, kv.sha256)
        assert PeftConfig.from_pretrained(saved.path).r == 4
        r = await call("GET", f"{one.base_url}/adapter", KEY)  # acme's user: acme has no version
        assert r.status_code == 404 and "acme" in r.json()["error"]["message"]
        r = await call("GET", f"{one.base_url}/adapter", ANON_KEY)
        assert r.status_code == 404 and "no tenant" in r.json()["error"]["message"]
        assert (await call("GET", f"{one.base_url}/adapter", None)).status_code == 401
        for path in ("/tenants/wayne/adapter", "/tenants/wayne"):
            assert (await call("GET", one.admin_url + path, KEY)).status_code == 403
            assert (await call("GET", one.admin_url + path, user)).status_code == 403

        # a gateway that never heard the announcement finds the trainer where the KV recorded
        # it with the version; without that record, in [endpoints] trainer
        said = await one.bus.kv_get(hbus.announced_key("wayne"), bus_pb2.WeightsUpdated)
        assert said.fetch_from == trainer.address and said.info.sha256 == kv.sha256
        for recorded, configured in ((True, ""), (False, ""), (False, trainer.address)):
            if not recorded:
                await one.bus.kv_delete(hbus.announced_key("wayne"))
            cold = await start_gateway([], nats_module.url, tenants=TENANTS,
                                       admin_token=ADMIN, trainer=configured)
            try:
                assert "wayne" not in cold.admin.fetch_from
                r = await call("GET", f"http://127.0.0.1:{cold.http.port}/admin/tenants/wayne/adapter")
                if recorded or configured:
                    assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == kv.sha256
                else:
                    assert r.status_code == 503 and "no trainer address known" in r.text
            finally:
                await cold.stop()

        # a version that is not the one announced is never sent
        await one.bus.kv_put(hbus.latest_key("wayne"), common_pb2.VersionInfo(
            version=1, sha256="0" * 64, bytes=kv.bytes, base_model=BASE))
        r = await call("GET", f"{one.admin_url}/tenants/wayne/adapter")
        assert r.status_code == 503 and "announced" in r.json()["error"]["message"]
        await one.bus.kv_put(hbus.latest_key("wayne"), kv)
    finally:
        await trainer.stop()
    # the lineage still holds a version: the name cannot be taken by a new tenant until the
    # trainer has removed it
    await call("DELETE", f"{one.admin_url}/tenants/wayne")
    r = await call("POST", f"{one.admin_url}/tenants", json={"name": "wayne"})
    assert r.status_code == 409 and "still holds version 1" in r.json()["error"]["message"]


async def test_a_reset_to_a_version_is_checked_against_the_lineage_and_its_trainer(
        rig, tmp_path, adapter_factory):
    """`POST /admin/tenants/<name>/reset {"version": N}` goes back to the lineage's own version
    N (the trainer publishes it again and trains on from it, tests/trainer/recipes): refused
    before anything is written for a version above the latest, one its trainer does not hold,
    a negative one or a misspelt field; accepted, the record says where to go back to."""
    _, one, _, _ = rig
    await call("POST", f"{one.admin_url}/tenants", json={"name": "rolly"})
    registry = Registry(one.bus)
    trainer = await Trainer().start(tmp_path, one.bus, "rolly")
    try:
        for v in (1, 2):
            await trainer.publisher.publish(v, adapter_factory(seed=v, r=4))
        url = f"{one.admin_url}/tenants/rolly/reset"
        r = await call("POST", url, json={"version": 3})
        assert r.status_code == 400 and "no version 3: its latest is 2" in r.text, r.text
        for body in ({"version": -1}, {"versoin": 1}, {"version": "two"}):
            assert (await call("POST", url, json=body)).status_code == 400, body
        (trainer.publisher.store.dir / "v1.json").unlink()  # a version the store lost
        r = await call("POST", url, json={"version": 1})
        assert r.status_code == 404 and "not in the trainer's store" in r.text, r.text
        assert (await registry.get("rolly")).generation == 0  # nothing was written
        r = await call("POST", url, json={"version": 2})
        assert r.status_code == 202 and r.json() == {"tenant": "rolly", "generation": 1,
                                                     "to_version": 2}
        assert ((rec := await registry.get("rolly")).generation, rec.reset_to) == (1, 2)
        r = await call("POST", url)  # no body: to the base model
        assert r.status_code == 202 and r.json()["to_version"] == 0
        assert ((rec := await registry.get("rolly")).generation, rec.reset_to) == (2, 0)
        assert (await call("POST", f"{one.admin_url}/tenants/nobody/reset",
                           json={"version": 1})).status_code == 404
    finally:
        await trainer.stop()
        await call("DELETE", f"{one.admin_url}/tenants/rolly")


async def _async(value):
    return value
