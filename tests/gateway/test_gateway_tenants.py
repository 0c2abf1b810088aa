"""Tenants at the gateway, through a real gateway and a real NATS: a key's tenant goes with its
traffic, its feedback lands on that tenant's subject only, and no key of one tenant can rate
another's answers."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import pytest_asyncio

from hotloop import bus as hbus
from hotloop import metrics
from hotloop.proto.v1 import bus_pb2
from tests.scrape import scrape

from .conftest import ADMIN_TOKEN, ANON_KEY, KEY, KEYS, OTHER_KEY, start_gateway
from .fake_rollout import start_fake

pytestmark = pytest.mark.asyncio(loop_scope="module")
HI = [{"role": "user", "content": "hi"}]
TENANTS = {"acme": ["alice"], "globex": ["bob"]}  # the anonymous key is in the default tenant


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(nats_module):
    fake, server, addr = await start_fake(version=3)
    gw = await start_gateway([addr], nats_module.url, tenants=TENANTS, admin_token=ADMIN_TOKEN)
    yield fake, gw, addr
    await gw.stop()
    await server.stop(0)


async def feedback(gw, key: str, **body) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(f"{gw.base_url}/feedback", json=body,
                               headers={"Authorization": f"Bearer {key}"})


async def stored_traffic(gw, response_id: str, timeout_s: float = 20.0):
    """The response's TRAFFIC record, once the gateway's publish (after the answer) is stored."""
    deadline = time.monotonic() + timeout_s
    while (tr := await gw.bus.traffic(response_id, 0, patience_s=5)) is None:
        assert time.monotonic() < deadline, f"no traffic record for {response_id} within {timeout_s}s"
        await asyncio.sleep(0.05)
    return tr


async def on(gw, subject: str, durable: str) -> list[bus_pb2.FeedbackEvent]:
    consumer = await gw.bus.pull("FEEDBACK", subject, durable, bus_pb2.FeedbackEvent)
    return [m.payload for m in await consumer.fetch(100, 1)]


async def test_each_tenants_traffic_and_feedback_stay_its_own(rig):
    fake, gw, _ = rig
    answers = {}
    for name, key in (("acme", KEY), ("globex", OTHER_KEY), ("", ANON_KEY)):
        raw = await gw.openai(key).chat.completions.with_raw_response.create(
            model="tiny", messages=HI, max_tokens=3)
        r = raw.parse()
        answers[name] = r.id
        assert raw.headers["x-hotloop-tenant"] == name  # the lineage that served it, said to the user
        assert fake.requests[-1].tenant == name  # the replica serves it from that lineage
        tr = await stored_traffic(gw, r.id)
        assert tr.tenant == name
        # another tenant's key cannot rate it: the response is unknown to it
        for other in {KEY, OTHER_KEY, ANON_KEY} - {key}:
            assert (await feedback(gw, other, response_id=r.id, score=1)).status_code == 404
        assert (await feedback(gw, key, response_id=r.id, score=0.5)).status_code == 200

    # each tenant's trainer reads its own subject, and finds only its own tenant's feedback
    for name in answers:
        got = await on(gw, hbus.feedback_subject(name), f"test-tenant-{name or 'default'}")
        assert [(f.response_id, f.tenant) for f in got] == [(answers[name], name)], name
    assert hbus.feedback_subject("acme") == "hotloop.feedback.tenant.acme"


async def test_an_answer_from_another_tenants_lineage_never_reaches_the_user(rig):
    fake, gw, _ = rig
    fake.lineage = "globex"  # a replica gone wrong: it serves acme's user from globex's lineage
    try:
        with pytest.raises(openai.APIStatusError) as e:
            await gw.openai(KEY).chat.completions.create(model="tiny", messages=HI, max_tokens=3)
        assert e.value.status_code == 503 and "another tenant's lineage" in e.value.message
        assert "globex" not in e.value.message  # acme's user never learns another's name
        # nor from why the replica is down (every user's 503 and /ready say that)
        assert not gw.core.router.states[0].healthy
        assert "globex" not in gw.core.router.states[0].reason
    finally:
        fake.lineage = None
    assert gw.core.status()["counters"]["wrong_tenant"] >= 1
    scraped = await scrape(gw.http.port, token=ADMIN_TOKEN)  # where an operator's alert looks
    assert scraped.value("hotloop_gateway_wrong_tenant_total") >= 1
    # marked down at the refusal; serving again once a health poll finds it up
    for _ in range(300):
        if gw.core.servable_replicas():
            break
        await asyncio.sleep(0.1)
    r = await gw.openai(KEY).chat.completions.create(model="tiny", messages=HI, max_tokens=3)
    assert r.choices[0].message.content


async def test_a_restarted_gateway_publishes_on_the_tenant_that_served(rig, nats_module):
    """Feedback checked against TRAFFIC (no memory of the response) still goes to the tenant
    the traffic record names."""
    _, gw, addr = rig
    r = await gw.openai(KEY).chat.completions.create(model="tiny", messages=HI, max_tokens=3)
    await stored_traffic(gw, r.id)
    fresh = await start_gateway([addr], nats_module.url, tenants=TENANTS)
    try:
        assert (await feedback(fresh, OTHER_KEY, response_id=r.id, label="up")).status_code == 404
        assert (await feedback(fresh, KEY, response_id=r.id, label="up")).status_code == 200
    finally:
        await fresh.stop()
    got = await on(gw, hbus.feedback_subject("acme"), "test-tenant-restarted")
    assert [(f.response_id, f.tenant, f.user) for f in got][-1] == (r.id, "acme", "alice")


async def test_a_tenant_naming_a_key_id_no_key_has_is_refused(nats_module):
    from services.gateway.keys import KeyConfigError

    with pytest.raises(KeyConfigError, match="alicia"):
        await start_gateway(["127.0.0.1:1"], nats_module.url, keys=KEYS, tenants={"acme": ["alicia"]})


async def test_a_tenant_sees_only_itself_and_the_operator_sees_every_tenant(rig):
    """A user key's status names its own tenant and lineage only; `/metrics` on the users'
    port (whose series carry every tenant's name) is the admin token's; the operator's
    listener (`metrics_port`) and the admin token's status still show every tenant."""
    fake, gw, _ = rig
    fake.tenant_versions = {"acme": 2, "globex": 5}
    endpoint = metrics.serve(gw.core.registry)  # the process's operator-only listener
    try:
        for _ in range(300):  # the health poll reads each replica's tenant versions
            if gw.core.router.states[0].tenants == fake.tenant_versions:
                break
            await asyncio.sleep(0.05)
        assert gw.core.router.states[0].tenants == {"acme": 2, "globex": 5}
        async with httpx.AsyncClient() as http:
            async def get(path: str, token: str | None) -> httpx.Response:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                return await http.get(f"http://127.0.0.1:{gw.http.port}{path}", headers=headers)

            views = {}
            for key, own, others in ((KEY, "acme", ["globex"]), (OTHER_KEY, "globex", ["acme"]),
                                     (ANON_KEY, "", ["acme", "globex"])):
                r = await get("/v1/hotloop/status", key)
                assert r.status_code == 200
                views[own] = r.json()
                for other in others:
                    assert other not in r.text, (own, r.text)
                m = await get("/metrics", key)
                assert m.status_code == 403 and "metrics_port" in m.text
                for other in others:
                    assert other not in m.text
            assert views["acme"]["tenant"] == "acme" and views["acme"]["newest_version"] == 2
            assert [x["version"] for x in views["acme"]["replicas"]] == [2]
            assert views["globex"]["newest_version"] == 5
            assert [x["version"] for x in views["globex"]["replicas"]] == [5]
            assert views[""]["tenant"] == "" and [x["version"] for x in views[""]["replicas"]] == [3]
            assert "counters" not in views["acme"]  # gateway-wide: every tenant's traffic

            assert (await get("/metrics", None)).status_code == 401
            assert (await get("/metrics", "sk-not-a-key")).status_code == 401
            assert (await get("/v1/hotloop/status", None)).status_code == 401

            full = (await get("/v1/hotloop/status", ADMIN_TOKEN)).json()
            assert full["replicas"][0]["tenant_versions"] == {"acme": 2, "globex": 5}
            assert "counters" in full
        operator = await scrape(gw.http.port, token=ADMIN_TOKEN)
        listener = await scrape(endpoint.port)  # no token: the listener is the operator's
        for got in (operator, listener):
            assert got.value("hotloop_gateway_replica_tenant_version",
                             address=gw.core.router.states[0].replica.address, tenant="acme") == 2
            assert got.value("hotloop_gateway_replica_tenant_version",
                             address=gw.core.router.states[0].replica.address, tenant="globex") == 5
    finally:
        endpoint.close()
        fake.tenant_versions = {}
