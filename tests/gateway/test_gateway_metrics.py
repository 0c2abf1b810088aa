"""The gateway's Prometheus metrics, scraped over HTTP from both places that serve its
registry: the HTTP edge's `/metrics` and the process endpoint `hotloop.metrics.serve` starts
(what `hotloop.service` runs on `metrics_port`). A real gateway (gRPC and HTTP on port 0, a real
NATS) in front of scripted replicas; each test reads the counters before and after the work it
does, so it fails when a metric is not updated."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from hotloop import metrics
from tests.scrape import scrape

from .conftest import ADMIN_TOKEN, KEY, start_gateway
from .fake_rollout import WORDS, start_fake

pytestmark = pytest.mark.asyncio(loop_scope="module")
HI = [{"role": "user", "content": "hi"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(nats_module):
    fake, server, addr = await start_fake(version=3)
    gw = await start_gateway([addr], nats_module.url, admin_token=ADMIN_TOKEN)
    endpoint = metrics.serve(gw.core.registry)
    yield fake, gw, endpoint, addr
    endpoint.close()
    await gw.stop()
    await server.stop(0)


async def test_requests_tokens_errors_and_feedback_are_counted(rig):
    fake, gw, endpoint, addr = rig
    before = await scrape(endpoint.port)
    client = gw.openai()
    rs = [await client.chat.completions.create(model="tiny", messages=HI) for _ in range(3)]
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="tiny", messages=HI, n=99)
    with pytest.raises(openai.AuthenticationError):
        await gw.openai(key="sk-wrong-key-000000").chat.completions.create(model="tiny", messages=HI)
    fake.refuse = (grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")
    try:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="tiny", messages=HI)
    finally:
        fake.refuse = None
    async with httpx.AsyncClient() as http:
        fb = await http.post(f"{gw.base_url}/feedback", headers={"Authorization": f"Bearer {KEY}"},
                             json={"response_id": rs[0].id, "label": "up"})
        assert fb.status_code == 200, fb.text
        bad = await http.post(f"{gw.base_url}/feedback", headers={"Authorization": f"Bearer {KEY}"},
                              json={"response_id": rs[0].id, "score": 7})
        assert bad.status_code == 400
    after = await scrape(endpoint.port)

    def delta(sample: str, **labels) -> float:
        return after.value(sample, **labels) - before.value(sample, **labels)

    assert after.type_of("hotloop_gateway_requests") == "counter"
    assert delta("hotloop_gateway_requests_total") == 5  # 3 served, 1 refused here, 1 by the replica
    assert delta("hotloop_gateway_requests_succeeded_total") == 3
    assert delta("hotloop_gateway_request_errors_total", code="invalid_argument") == 2
    assert delta("hotloop_gateway_request_errors_total", code="unauthenticated") == 1
    assert delta("hotloop_gateway_request_errors_total", code="unavailable") == 0
    assert delta("hotloop_gateway_completion_tokens_total") == 3 * len(WORDS)
    assert delta("hotloop_gateway_feedback_total", outcome="accepted") == 1
    assert delta("hotloop_gateway_feedback_total", outcome="rejected") == 1
    assert delta("hotloop_gateway_traffic_forked_total") == 3
    assert delta("hotloop_gateway_replica_requests_served_total", address=addr) == 3
    # the time to first token: one observation per request a replica answered
    assert delta("hotloop_gateway_time_to_first_token_seconds_count") == 3
    assert delta("hotloop_gateway_time_to_first_token_seconds_sum") > 0
    assert after.type_of("hotloop_gateway_time_to_first_token_seconds") == "histogram"
    # the inter-token latency: one observation per token after each choice's first
    assert delta("hotloop_gateway_inter_token_seconds_count") == 3 * (len(WORDS) - 1)
    assert delta("hotloop_gateway_inter_token_seconds_sum") > 0
    assert after.type_of("hotloop_gateway_inter_token_seconds") == "histogram"


async def test_replica_table_readiness_and_in_flight_gauges(rig):
    fake, gw, endpoint, addr = rig
    got = await scrape(endpoint.port)
    assert got.value("hotloop_gateway_replica_healthy", address=addr) == 1
    assert got.value("hotloop_gateway_replica_may_serve", address=addr) == 1
    assert got.value("hotloop_gateway_replica_version", address=addr) == 3
    assert got.value("hotloop_gateway_replica_version_lag", address=addr) == 0
    assert got.value("hotloop_gateway_newest_version") == 3
    assert got.value("hotloop_gateway_ready") == 1
    assert got.type_of("hotloop_gateway_replica_healthy") == "gauge"

    fake.delay_s = 0.2  # a response still streaming while the endpoint is scraped
    try:
        stream = await gw.openai().chat.completions.create(model="tiny", messages=HI, stream=True)
        await anext(aiter(stream))
        during = await scrape(endpoint.port)
        async for _ in stream:
            pass
    finally:
        fake.delay_s = 0.0
    assert during.value("hotloop_gateway_requests_in_flight") == 1
    assert during.value("hotloop_gateway_replica_requests_in_flight", address=addr) == 1
    done = await scrape(endpoint.port)
    assert done.value("hotloop_gateway_requests_in_flight") == 0
    assert done.value("hotloop_gateway_replica_requests_in_flight", address=addr) == 0


async def test_no_replica_is_unavailable_and_not_ready(nats_module):
    fake, server, addr = await start_fake()
    await server.stop(0)  # nothing listens there
    gw = await start_gateway([addr], nats_module.url, admin_token=ADMIN_TOKEN)
    try:
        with pytest.raises(openai.APIStatusError):
            await gw.openai().chat.completions.create(model="tiny", messages=HI)
        got = await scrape(gw.http.port, token=ADMIN_TOKEN)  # the HTTP edge's: the same registry
        assert got.value("hotloop_gateway_request_errors_total", code="unavailable") == 1
        assert got.value("hotloop_gateway_replica_healthy", address=addr) == 0
        assert got.value("hotloop_gateway_ready") == 0
    finally:
        await gw.stop()


async def test_the_http_edge_serves_the_same_registry(rig):
    _, gw, endpoint, _ = rig
    await gw.openai().chat.completions.create(model="tiny", messages=HI)
    edge, process = await scrape(gw.http.port, token=ADMIN_TOKEN), await scrape(endpoint.port)
    for sample in ("hotloop_gateway_requests_total", "hotloop_gateway_completion_tokens_total"):
        assert edge.value(sample) == process.value(sample) > 0
    async with httpx.AsyncClient() as http:  # OpenMetrics when a scraper asks for it
        r = await http.get(f"http://127.0.0.1:{gw.http.port}/metrics",
                           headers={"Accept": "application/openmetrics-text; version=1.0.0",
                                    "Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")
