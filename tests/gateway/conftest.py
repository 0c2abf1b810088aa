"""Starting a real gateway (gRPC and HTTP on port 0) against given replicas and a real NATS."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hotloop import grpcutil
from hotloop.bus import Bus
from hotloop.proto.v1 import gateway_pb2_grpc

KEY = "sk-test-alice-0123456789"
OTHER_KEY = "sk-test-bob-0123456789"
ANON_KEY = "sk-test-anonymous-key"
KEYS = [f"alice:{KEY}", f"bob:{OTHER_KEY}", ANON_KEY]
ADMIN_TOKEN = "sk-test-operator-0123456789"
"""The admin token of the gateways that tests start with `admin_token=ADMIN_TOKEN`: the
operator's views on the users' port (`/metrics`, every tenant's `/v1/hotloop/status`)."""


def operator_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class Gateway:
    core: object
    server: object
    http: object
    bus: Bus
    grpc_address: str
    admin: object = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http.port}/v1"

    def openai(self, key: str = KEY, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, **kw)

    def stub(self):
        ch = grpcutil.channel(self.grpc_address)
        return ch, gateway_pb2_grpc.GatewayStub(ch)

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.http.port}/admin"

    async def stop(self) -> None:
        await self.http.stop()
        await self.server.stop(0)
        await self.admin.close()
        await self.core.close()
        await self.bus.close()


async def start_gateway(replicas: list[str], nats_url: str, served_model: str = "tiny",
                        keys: list[str] = KEYS, tenants: dict[str, list[str]] | None = None,
                        admin_token: str = "", trainer: str = "", **cfg) -> Gateway:
    """`admin_token`, `trainer`: `[security] admin_token` and `[endpoints] trainer` (the
    admin API and the tenant registry, which every test gateway follows)."""
    from services.gateway.admin import TenantAdmin
    from services.gateway.config import GatewayConfig
    from services.gateway.core import GatewayCore
    from services.gateway.events import BusEvents
    from services.gateway.http import serve_http
    from services.gateway.keys import KeyRing, load_keys
    from services.gateway.routing import Router
    from services.gateway.server import serve
    from services.gateway.upstream import GrpcReplica

    from hotloop.config import TenantConfig
    from hotloop.tenants import Directory

    config = GatewayConfig(**{"health_interval_s": 0.2, "health_timeout_s": 0.5, **cfg})
    bus = await Bus.connect(nats_url, "gateway-test")
    router = Router([GrpcReplica(a) for a in replicas], config.routing,
                    config.health_interval_s, config.health_timeout_s, config.health_failures,
                    config.max_version_lag)
    directory = Directory({name: TenantConfig(keys=ids) for name, ids in (tenants or {}).items()})
    ring = KeyRing(load_keys(keys), admin=bool(admin_token))
    core = GatewayCore(config, ring, router, BusEvents(bus, config.traffic_queue),
                       served_model, tenants=directory)
    await core.start()
    admin = TenantAdmin(bus, core.keys, core.tenants, admin_token, trainer)
    await admin.start()
    server, port, _ = await serve(core, "127.0.0.1:0")
    http = await serve_http(core, "127.0.0.1", 0, admin)
    return Gateway(core, server, http, bus, f"127.0.0.1:{port}", admin)


@pytest.fixture(scope="module")
def nats_module(tmp_path_factory):
    """One NATS per module (the shared `nats_server` fixture is per test)."""
    from launch.natsserver import NatsServer

    with NatsServer(tmp_path_factory.mktemp("nats")) as server:
        yield server
