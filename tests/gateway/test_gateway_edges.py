"""The gateway's edges over raw sockets and the health protocols: how much of a request body
it reads (declared, chunked, lying, trickled), and readiness (`/ready`, the Gateway service's
gRPC health, compose's health check script) against a scripted replica that goes away and
comes back. Real gateway (HTTP and gRPC on port 0), real NATS."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hotloop import grpcutil

from .conftest import KEY, start_gateway
from .fake_rollout import start_fake

pytestmark = pytest.mark.asyncio(loop_scope="module")
ROOT = Path(__file__).resolve().parents[2]
LIMIT = 1024  # max_request_bytes of the `small` gateway: the smallest the config allows
GATEWAY = "hotloop.v1.Gateway"
HI = [{"role": "user", "content": "hi"}]
CHAT = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 4}).encode()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateways(nats_module):
    """(default gateway: 1 MiB bodies; small: 1 KiB bodies within 0.5 s), one replica."""
    _, server, addr = await start_fake()
    default = await start_gateway([addr], nats_module.url)
    small = await start_gateway([addr], nats_module.url, max_request_bytes=LIMIT,
                                request_body_timeout_s=0.5)
    yield default, small
    await default.stop()
    await small.stop()
    await server.stop(0)


def head(gw, path: str = "/v1/chat/completions", **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{gw.http.port}",
             f"Authorization: Bearer {KEY}", "Content-Type: application/json",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def exchange(gw, request_head: bytes, parts, pause_s: float = 0.0):
    """Send a head, then `parts` (pausing between them) until the gateway answers or stops
    reading; returns (status, JSON body, parts sent when the answer came, whether the
    gateway then ended the connection). A raw socket reads as the kernel delivers: an
    answer that arrived before a reset is still read."""
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", gw.http.port))
    sock.setblocking(False)
    sent = 0

    async def send():
        nonlocal sent
        with contextlib.suppress(OSError):  # the gateway closed: it stopped reading
            await loop.sock_sendall(sock, request_head)
            for p in parts:
                await loop.sock_sendall(sock, p)
                sent += 1
                if pause_s:
                    await asyncio.sleep(pause_s)

    sender = asyncio.create_task(send())
    data, sent_at_answer, ended = b"", None, False
    try:
        async with asyncio.timeout(60):
            while True:
                try:
                    got = await loop.sock_recv(sock, 65536)
                except ConnectionResetError:
                    got = b""
                if sent_at_answer is None and got:
                    sent_at_answer = sent
                data += got
                if not got:
                    ended = True
                    break
                head_end = data.find(b"\r\n\r\n")
                if head_end >= 0:
                    head_lines = data[:head_end].decode().split("\r\n")
                    headers = dict(h.lower().split(": ", 1) for h in head_lines[1:])
                    if len(data) - head_end - 4 >= int(headers["content-length"]):
                        if headers.get("connection") != "close":
                            break  # kept alive: the answer is all there is to read
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        sock.close()
    body = json.loads(data[head_end + 4:head_end + 4 + int(headers["content-length"])])
    return int(head_lines[0].split()[1]), body, sent_at_answer, ended


def assert_openai_error(body: dict, needle: str) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and needle in err["message"]


# ---- the body bound ------------------------------------------------------------------------


async def test_a_chunked_body_without_content_length_is_refused_at_the_limit(gateways):
    gw, _ = gateways
    piece = b"x" * 65536
    parts = [chunk(piece)] * 24 + [b"0\r\n\r\n"]  # 1.5 MiB declared nowhere
    status, body, _, ended = await exchange(gw, head(gw, Transfer_Encoding="chunked"), parts)
    assert status == 413 and ended
    assert_openai_error(body, f"exceeds {1 << 20} bytes")


async def test_an_endless_chunked_body_is_cut_off(gateways):
    """The gateway stops reading (answers 413 and closes) while the client still sends."""
    gw, _ = gateways
    endless = (chunk(b"x" * 65536) for _ in range(10**6))  # 64 GiB
    status, body, _, ended = await exchange(gw, head(gw, Transfer_Encoding="chunked"), endless)
    assert status == 413 and ended
    assert_openai_error(body, "exceeds")


async def test_a_chunked_body_within_the_limit_is_served(gateways):
    gw, _ = gateways
    parts = [chunk(CHAT[:10]), chunk(CHAT[10:]), b"0\r\n\r\n"]
    status, body, _, ended = await exchange(gw, head(gw, Transfer_Encoding="chunked"), parts)
    assert status == 200 and body["choices"][0]["message"]["content"] and not ended


async def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent(gateways):
    gw, _ = gateways
    status, body, _, ended = await exchange(
        gw, head(gw, Content_Length=str((1 << 20) + 1), Expect="100-continue"), [])
    assert status == 413 and ended  # answered, not "100 Continue", with nothing sent
    assert_openai_error(body, "exceeds")


async def test_a_content_length_smaller_than_the_body_bounds_what_is_read(gateways):
    """The app sees the 10 declared bytes (not JSON: 400); what follows them is read as the
    next request (not HTTP: the server's own 400, and the connection ends), never as body."""
    gw, _ = gateways
    loop = asyncio.get_running_loop()
    with socket.create_connection(("127.0.0.1", gw.http.port)) as sock:
        sock.setblocking(False)
        await loop.sock_sendall(sock, head(gw, Content_Length="10") + CHAT[:10])
        first = await read_until(sock, b"}}")
        assert first.startswith(b"HTTP/1.1 400") and b"not valid JSON" in first
        with contextlib.suppress(OSError):
            await loop.sock_sendall(sock, CHAT[10:] + b"x" * (2 << 20))
        rest = await read_until(sock, None)
    assert rest.startswith(b"HTTP/1.1 400") and b"Invalid HTTP request" in rest


async def read_until(sock, marker: bytes | None) -> bytes:
    """Read until `marker` was received, or (None) until the connection ends."""
    loop, data = asyncio.get_running_loop(), b""
    async with asyncio.timeout(30):
        while marker is None or marker not in data:
            try:
                got = await loop.sock_recv(sock, 65536)
            except ConnectionResetError:
                got = b""
            if not got:
                return data
            data += got
    return data


async def test_a_trickled_body_is_refused_once_it_passes_the_limit(gateways):
    _, small = gateways
    parts = [chunk(b"x" * 64)] * 10_000  # 640 KB at 64 bytes a step: far past 1 KiB
    status, body, sent, ended = await exchange(small, head(small, Transfer_Encoding="chunked"),
                                               parts, pause_s=0.002)
    assert status == 413 and ended
    assert_openai_error(body, f"exceeds {LIMIT} bytes")
    assert LIMIT // 64 <= sent < len(parts)


async def test_a_body_that_never_finishes_is_refused_after_the_body_timeout(gateways):
    _, small = gateways
    forever = (chunk(b"{") for _ in range(10**6))  # 1 byte every 0.1 s: under the limit for 100 s
    status, body, _, ended = await exchange(small, head(small, Transfer_Encoding="chunked"),
                                            forever, pause_s=0.1)
    assert status == 408 and ended
    assert_openai_error(body, "did not arrive within 0.5s")
    assert body["error"]["code"] == "request_timeout"


async def test_bodies_within_the_limit_still_work_for_the_openai_client(gateways):
    _, small = gateways
    r = await small.openai().chat.completions.create(model="tiny", messages=HI)
    assert r.choices[0].message.content
    stream = await small.openai().chat.completions.create(
        model="tiny", messages=HI, stream=True)
    assert [c async for c in stream]


# ---- readiness -----------------------------------------------------------------------------


def healthcheck(*args: str) -> int:
    """compose/healthcheck.py's exit code (it runs as `hotloop-healthcheck` in the image)."""
    return subprocess.run([sys.executable, str(ROOT / "compose/healthcheck.py"), *args],
                          timeout=30).returncode


async def until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "the gateway never changed its mind"
        await asyncio.sleep(0.05)


async def test_ready_follows_whether_a_replica_can_serve_and_health_stays_ok(nats_module):
    _, server, addr = await start_fake(version=4)
    gw = await start_gateway([addr], nats_module.url)  # health polled every 0.2 s
    base = f"http://127.0.0.1:{gw.http.port}"
    ch = grpcutil.channel(gw.grpc_address)
    health = health_pb2_grpc.HealthStub(ch)

    async def grpc_status(service: str):
        return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

    def grpc_says(want):
        async def check() -> bool:
            return await grpc_status(GATEWAY) == want
        return check

    try:
        async with httpx.AsyncClient(base_url=base) as http:  # no key: probes have none
            r = await http.get("/ready")
            assert r.status_code == 200 and r.json() == {
                "status": "ready", "reason": "1 of 1 rollout replicas can serve"}
            assert await grpc_status(GATEWAY) == health_pb2.HealthCheckResponse.SERVING
            assert await asyncio.to_thread(healthcheck, "--http", str(gw.http.port), "/ready") == 0

            await server.stop(0)

            async def not_ready():
                return (await http.get("/ready")).status_code == 503

            await until(not_ready)
            body = (await http.get("/ready")).json()
            assert body["status"] == "not_ready"
            assert "no healthy rollout replica" in body["reason"] and addr in body["reason"]
            assert (await http.get("/health")).json() == {"status": "ok"}  # alive all along
            await until(grpc_says(health_pb2.HealthCheckResponse.NOT_SERVING))
            assert await grpc_status("") == health_pb2.HealthCheckResponse.SERVING
            assert await asyncio.to_thread(healthcheck, "--http", str(gw.http.port), "/ready") == 1
            assert await asyncio.to_thread(healthcheck, gw.grpc_address.split(":")[1]) == 0

            _, server, _ = await start_fake(addr, version=5)  # back on its address

            async def ready():
                return (await http.get("/ready")).status_code == 200

            await until(ready)
            await until(grpc_says(health_pb2.HealthCheckResponse.SERVING))
            r = await gw.openai().chat.completions.create(model="tiny", messages=HI)
            assert r.model_extra["policy_version"] == 5
    finally:
        await ch.close()
        await gw.stop()
        await server.stop(0)


async def test_a_gateway_started_without_a_reachable_replica_is_not_ready(nats_module):
    _, server, addr = await start_fake()
    await server.stop(0)  # nothing listens there any more
    gw = await start_gateway([addr], nats_module.url)
    try:
        async with httpx.AsyncClient() as http:
            r = await http.get(f"http://127.0.0.1:{gw.http.port}/ready")
        assert r.status_code == 503 and "health check failed" in r.json()["reason"]
        assert await asyncio.to_thread(healthcheck, "--http", str(gw.http.port), "/ready") == 1
    finally:
        await gw.stop()


# ---- the body bound as a class: exactly how much it reads -----------------------------------


class Client:
    """An ASGI server's side of one request: an endless body in 1000-byte messages (or
    `body`, then a disconnect), counting what the middleware pulls."""

    def __init__(self, body: list[bytes] | None = None):
        self.body, self.pulled, self.sent = body, 0, []

    async def receive(self):
        if self.body is None:
            self.pulled += 1000
            return {"type": "http.request", "body": b"x" * 1000, "more_body": True}
        if not self.body:
            return {"type": "http.disconnect"}
        part = self.body.pop(0)
        self.pulled += len(part)
        return {"type": "http.request", "body": part, "more_body": bool(self.body)}

    async def send(self, message):
        self.sent.append(message)

    def status(self) -> int:
        return self.sent[0]["status"]


def scope(**headers: str) -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions",
            "headers": [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]}


async def never_called(scope, receive, send):
    raise AssertionError("the app was given a body over the limit")


@pytest.mark.parametrize("headers", [{"Transfer_Encoding": "chunked"}, {"Content_Length": "10000"},
                                     {"Content_Length": "999999999"}])
async def test_an_endless_body_is_read_at_most_five_times_the_limit_and_held_at_most_once(headers):
    """Chunked; a Content-Length that understates the stream (the server's parser would
    end the body there; here the middleware's own bound is what is under test); one over the
    limit, without `Expect`. 10 000 held, up to 4 x 10 000 more dropped while lingering."""
    from services.gateway.http import LINGER_LIMITS, _BoundedBody

    client = Client()
    await _BoundedBody(never_called, max_bytes=10_000, timeout_s=30)(
        scope(**headers), client.receive, client.send)
    assert client.status() == 413
    assert client.pulled <= (1 + LINGER_LIMITS) * 10_000 + 2 * 1000


async def test_an_expecting_client_is_refused_before_it_sends_anything():
    from services.gateway.http import _BoundedBody

    client = Client()
    await _BoundedBody(never_called, max_bytes=10_000, timeout_s=30)(
        scope(Content_Length="10001", Expect="100-continue"), client.receive, client.send)
    assert client.status() == 413 and client.pulled == 0


async def test_a_body_within_the_limit_reaches_the_app_whole_and_then_the_disconnect():
    from services.gateway.http import _BoundedBody

    seen = []

    async def app(scope, receive, send):
        seen.append(await receive())
        seen.append(await receive())  # what a streaming response listens for

    client = Client([b"a" * 4000, b"b" * 4000, b"c" * 2000])
    await _BoundedBody(app, max_bytes=10_000, timeout_s=30)(scope(), client.receive, client.send)
    assert seen == [{"type": "http.request", "body": b"a" * 4000 + b"b" * 4000 + b"c" * 2000,
                     "more_body": False}, {"type": "http.disconnect"}]


async def test_the_openai_client_gets_413_for_an_oversized_prompt(gateways):
    """Its body (2 MiB, with Content-Length) is refused unread, and the client reads a 413 in
    OpenAI's shape, not a connection error, every time."""
    import openai

    gw, _ = gateways
    for _ in range(5):
        with pytest.raises(openai.APIStatusError) as e:
            await gw.openai().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x" * (2 << 20)}])
        assert e.value.status_code == 413 and "exceeds" in e.value.message
