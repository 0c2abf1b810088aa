"""`python -m services.rollout` / `hotloop serve rollout`.

Start order: the bus, the engine, then catch-up to the mesh's latest announced version of
every lineage, the default one and each tenant's (catchup.py, bounded by `catchup_timeout_s`),
and only then the gRPC server, whose health says SERVING from its first answer: nobody is
served an older policy than the mesh announced unless the bound ran out, and then Status says
the replica is behind (per tenant too).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from hotloop import metrics, models, service
from hotloop.config import MeshConfig
from hotloop.tenants import TenantId

from .config import RolloutConfig


async def build(mesh: MeshConfig, cfg: RolloutConfig) -> service.Running:
    from hotloop.adapters import Version, version_to_proto
    from hotloop.errors import FatalError

    from .catchup import CatchUp, Lineages, TrainerFetch, bus_latest, bus_recorded, bus_tenants, listen
    from .core import RolloutCore
    from .server import serve

    model_dir = models.resolve(mesh.model.name)
    bus = None
    if mesh.nats.url:
        from hotloop import bus as hbus
        from hotloop.proto.v1 import bus_pb2

        bus = await hbus.Bus.connect(mesh.nats.url, "rollout", mesh.nats.connect_timeout_s,
                                     replicas=mesh.nats.replicas, ping_interval_s=mesh.nats.ping_interval_s)

    address: dict = {}  # known once the server is bound
    unannounced: list[tuple[Version, float]] = []  # loaded before that (catch-up at start-up)

    async def announce(v: Version, load_ms: float) -> None:
        if bus is None:
            return
        if "addr" not in address:
            unannounced.append((v, load_ms))
            return
        await bus.publish(
            hbus.ROLLOUT_LOADED,
            bus_pb2.AdapterLoaded(replica=address["addr"], info=version_to_proto(v), load_ms=load_ms),
        )

    storage = Path(cfg.storage_dir) if cfg.storage_dir else None
    core = RolloutCore(
        cfg, model_dir, base_model=mesh.model.name, dtype=mesh.model.dtype,
        max_model_len=mesh.model.max_model_len,
        storage_dir=storage or Path(mesh.run_dir) / f"rollout-{cfg.port or 'auto'}" / "adapters",
        on_loaded=announce, registry=metrics.registry(),
    )
    await core.start()

    catchup = follower = None
    fetch = TrainerFetch(mesh.security.admin_token)
    if bus is not None:
        def lineage(tenant: TenantId) -> CatchUp:
            # a tenant's own trainer first, if configured, then the mesh's
            own = mesh.tenants[tenant].trainer if tenant in mesh.tenants else ""
            return CatchUp(core, bus_latest(bus, tenant), fetch, [own, mesh.endpoints.trainer],
                           tenant=tenant, read_recorded=bus_recorded(bus, tenant),
                           poll_s=cfg.catchup_poll_s,
                           retry_max_s=cfg.catchup_retry_max_s)

        catchup = Lineages(lineage, bus_tenants(bus), poll_s=cfg.catchup_poll_s)
        metrics.StateCollector(catchup.metric_families, metrics.registry())
        await listen(catchup, bus)
        await catchup.start(cfg.catchup_timeout_s)

    server, port, health = await serve(core, f"{cfg.host}:{cfg.port}", mesh.security.admin_token,
                                       catchup=catchup)
    address["addr"] = f"{cfg.host}:{port}"
    for v, load_ms in unannounced:
        await announce(v, load_ms)

    def check() -> None:
        core.check_engine()
        if follower is not None and follower.done() and not follower.cancelled():
            raise FatalError(f"catch-up stopped: {follower.exception()!r}")

    # cleanups run last-first: stop catching up, close the bus, stop the engine
    running = service.Running(server, port, health, [core.stop], check=check)
    if bus is not None:
        running.cleanups.append(bus.close)
    if catchup is not None:
        follower = asyncio.create_task(catchup.follow(), name="catch-up")

        async def stop_following() -> None:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await fetch.close()

        running.cleanups.append(stop_following)
    return running


if __name__ == "__main__":
    service.run("rollout", RolloutConfig, build)
