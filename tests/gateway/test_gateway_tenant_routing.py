"""The gateway's staleness rule per tenant, through a real gateway (HTTP, the official openai
client), a real NATS and two scripted replicas over real gRPC (fake_rollout.py), each holding
its own version of each tenant's lineage. A tenant's announced version comes from the bus the
way a tenant's trainer announces it (KV `latest.tenant.<name>`, `WeightsUpdated` on the
tenant's subject) and from what the replicas report."""

from __future__ import annotations

import asyncio
import time

import pytest

from hotloop.bus import Bus, latest_key, weights_subject
from hotloop.proto.v1 import bus_pb2, common_pb2
from tests.scrape import parse

from .conftest import ANON_KEY, KEY, OTHER_KEY, start_gateway
from .fake_rollout import start_fake

HI = [{"role": "user", "content": "hi"}]
TENANTS = {"acme": ["alice"], "globex": ["bob"]}  # the anonymous key is in the default tenant


async def announce(bus: Bus, tenant: str, version: int, kv: bool = True, subject: bool = True):
    """What a tenant's trainer does once a version is live (Publisher._announce)."""
    info = common_pb2.VersionInfo(version=version, sha256=f"{version:064x}", bytes=1,
                                  base_model="tiny")
    if kv:
        await bus.kv_put(latest_key(tenant), info)
    if subject:
        await bus.publish(weights_subject(tenant), bus_pb2.WeightsUpdated(info=info, tenant=tenant))
        await bus.flush()


async def until(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)


def served(fake, tenant: str) -> int:
    return sum(1 for r in fake.requests if r.tenant == tenant)


async def ask(gw, key: str, times: int = 4) -> set[int]:
    """`times` requests one after another; the versions that answered them."""
    versions = set()
    for _ in range(times):
        r = await gw.openai(key).chat.completions.create(model="tiny", messages=HI, max_tokens=2)
        versions.add(r.model_extra["policy_version"])
    return versions


async def test_a_tenants_users_go_to_the_replicas_that_have_its_announced_version(nats_server):
    bus = await Bus.connect(nats_server.url, "trainer")
    a, a_server, a_addr = await start_fake(version=3)
    b, b_server, b_addr = await start_fake(version=3)
    a.tenant_versions = {"acme": 1, "globex": 1}
    b.tenant_versions = {"acme": 1, "globex": 1}
    await bus.ensure_streams()
    await announce(bus, "acme", 2, subject=False)  # announced before the gateway started
    gw = await start_gateway([a_addr, b_addr], nats_server.url, tenants=TENANTS)
    try:
        # only the KV said v2: no replica has it, so the freshest ones (both at v1) serve
        # acme's users rather than refusing them, and the gateway counts it
        assert gw.core.router.tenant_newest == {"acme": 2, "globex": 1}
        assert await ask(gw, KEY) == {1} and served(a, "acme") and served(b, "acme")
        assert gw.core.router.behind_picks == 4

        a.tenant_versions["acme"] = 2  # a took the push; b missed it (catching up)
        await until(lambda: gw.core.router.states[0].tenants.get("acme") == 2, "a polled")
        before = served(b, "acme")
        assert await ask(gw, KEY) == {2} and served(b, "acme") == before
        # the other tenant's and the default tenant's users still go to both replicas
        before_a, before_b = served(a, "globex"), served(b, "globex")
        assert await ask(gw, OTHER_KEY) == {1}
        assert served(a, "globex") > before_a and served(b, "globex") > before_b
        before_a, before_b = served(a, ""), served(b, "")
        assert await ask(gw, ANON_KEY) == {3}
        assert served(a, "") > before_a and served(b, "") > before_b

        # v3 heard on acme's subject while running (no KV write): nobody has it, a (v2) is the
        # freshest and serves alone, never b (v1)
        await announce(bus, "acme", 3, kv=False)
        await until(lambda: gw.core.router.tenant_newest["acme"] == 3, "v3 heard")
        before, picks = served(b, "acme"), gw.core.router.behind_picks
        assert await ask(gw, KEY) == {2} and served(b, "acme") == before
        assert gw.core.router.behind_picks == picks + 4

        b.tenant_versions["acme"] = 3  # b caught up, a is behind now
        await until(lambda: gw.core.router.states[1].tenants.get("acme") == 3, "b polled")
        before = served(a, "acme")
        assert await ask(gw, KEY) == {3} and served(a, "acme") == before

        st = gw.core.status()
        assert st["tenant_newest_versions"] == {"acme": 3, "globex": 1}
        assert [r["tenant_versions"] for r in st["replicas"]] == [
            {"acme": 2, "globex": 1}, {"acme": 3, "globex": 1}]
        from prometheus_client import generate_latest

        got = parse(generate_latest(gw.core.registry).decode())
        assert got.value("hotloop_gateway_tenant_newest_version", tenant="acme") == 3
        assert got.value("hotloop_gateway_replica_tenant_version", address=a_addr,
                         tenant="acme") == 2
        assert got.value("hotloop_gateway_tenant_behind_picks_total") == 8
    finally:
        await gw.stop()
        await a_server.stop(0)
        await b_server.stop(0)
        await bus.close()


async def test_an_unhealthy_replica_with_the_version_is_not_chosen_and_none_healthy_is_a_503(
        nats_server):
    bus = await Bus.connect(nats_server.url, "trainer")
    a, a_server, a_addr = await start_fake(version=3)
    b, b_server, b_addr = await start_fake(version=3)
    a.tenant_versions = {"acme": 2}
    b.tenant_versions = {"acme": 1}
    await bus.ensure_streams()
    gw = await start_gateway([a_addr, b_addr], nats_server.url, tenants=TENANTS)
    try:
        await announce(bus, "acme", 2)
        assert await ask(gw, KEY, 2) == {2} and not served(b, "acme")
        await a_server.stop(0)  # the replica that has acme's v2 is gone: b, behind, serves
        await until(lambda: not gw.core.router.states[0].healthy, "a seen down", 30)
        assert await ask(gw, KEY, 2) == {1}
        await b_server.stop(0)
        await until(lambda: not gw.core.router.states[1].healthy, "b seen down", 30)
        import openai

        with pytest.raises(openai.APIStatusError) as e:
            await ask(gw, KEY, 1)
        assert e.value.status_code == 503 and "no healthy rollout replica" in e.value.message
    finally:
        await gw.stop()
        await a_server.stop(0)
        await b_server.stop(0)
        await bus.close()
