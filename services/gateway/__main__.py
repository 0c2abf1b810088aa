"""`python -m services.gateway` / `hotloop serve gateway`."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from hotloop import metrics, service
from hotloop.config import MeshConfig

from .config import GatewayConfig

log = logging.getLogger("gateway")


async def build(mesh: MeshConfig, cfg: GatewayConfig) -> service.Running:
    from hotloop.bus import Bus
    from hotloop.errors import Unavailable
    from hotloop.tenants import Directory

    from .admin import TenantAdmin
    from .core import GatewayCore
    from .discovery import Discovery
    from .events import BusEvents
    from .http import serve_http
    from .keys import KeyConfigError, KeyRing, load_keys
    from .routing import Router
    from .server import serve
    from .upstream import GrpcReplica

    # Refuse to start rather than serve users without keys, replicas or a bus: each would
    # fail every request later with a less clear error.
    try:
        keys = KeyRing(load_keys(mesh.security.user_tokens, mesh.security.user_tokens_file),
                       admin=bool(mesh.security.admin_token))
    except KeyConfigError as e:
        raise SystemExit(f"gateway: {e}") from None
    if not mesh.endpoints.rollout:
        raise SystemExit("gateway: no rollout replicas configured ([endpoints] rollout)")
    if not mesh.nats.url:
        raise SystemExit("gateway: no bus configured ([nats] url): traffic and feedback go there")
    try:
        discovery = Discovery(mesh.endpoints.rollout, GrpcReplica, cfg.discovery_interval_s)
    except ValueError as e:
        raise SystemExit(f"gateway: [endpoints] rollout: {e}") from None

    bus = await Bus.connect(mesh.nats.url, "gateway", mesh.nats.connect_timeout_s,
                            replicas=mesh.nats.replicas, ping_interval_s=mesh.nats.ping_interval_s)
    router = Router(await discovery.refresh(), cfg.routing,
                    cfg.health_interval_s, cfg.health_timeout_s, cfg.health_failures,
                    cfg.max_version_lag)
    try:
        core = GatewayCore(cfg, keys, router, BusEvents(bus, cfg.traffic_queue),
                           cfg.served_model or mesh.model.name, registry=metrics.registry(),
                           tenants=Directory(mesh.tenants))
    except KeyConfigError as e:
        raise SystemExit(f"gateway: {e}") from None
    await core.start()
    # registry tenants' keys are known before the first request (a restarted gateway
    # accepts them at once), then followed as other replicas change them
    admin = TenantAdmin(bus, keys, core.tenants, mesh.security.admin_token, mesh.endpoints.trainer)
    try:
        await admin.start()
    except Unavailable as e:
        raise SystemExit(f"gateway: {e}") from None
    discovery.start(router.update)
    server, port, health = await serve(core, f"{cfg.host}:{cfg.port}")
    http = await serve_http(core, cfg.host, cfg.http_port, admin)
    log.info("OpenAI-compatible HTTP on http://%s:%d/v1 (%d keys, replicas %s)",
             cfg.host, http.port, len(keys), mesh.endpoints.rollout)
    if cfg.http_port_file:
        path = Path(cfg.http_port_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": http.port, "pid": os.getpid()}))
        tmp.rename(path)  # the launcher never reads a half-written file
    # cleanups run last-first: HTTP stops taking requests, then the core drains traffic
    return service.Running(server, port, health,
                           [bus.close, core.close, admin.close, discovery.close, http.stop])


if __name__ == "__main__":
    service.run("gateway", GatewayConfig, build)
