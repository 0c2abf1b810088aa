"""`python -m services.rollout` / `hotloop serve rollout`."""

from __future__ import annotations

from pathlib import Path

from hotloop import models, service
from hotloop.config import MeshConfig

from .config import RolloutConfig


async def build(mesh: MeshConfig, cfg: RolloutConfig) -> service.Running:
    from hotloop.adapters import Version

    from .core import RolloutCore
    from hotloop.adapters import version_to_proto

    from .server import serve

    model_dir = models.resolve(mesh.model.name)
    bus = None
    on_loaded = None
    if mesh.nats.url:
        from hotloop import bus as hbus
        from hotloop.proto.v1 import bus_pb2

        bus = await hbus.Bus.connect(mesh.nats.url, "rollout", mesh.nats.connect_timeout_s)

    core_holder: dict = {}

    async def announce(v: Version, load_ms: float) -> None:
        if bus is not None:
            await bus.publish(
                hbus.ROLLOUT_LOADED,
                bus_pb2.AdapterLoaded(replica=core_holder["addr"], info=version_to_proto(v), load_ms=load_ms),
            )

    storage = Path(cfg.storage_dir) if cfg.storage_dir else None
    core = RolloutCore(
        cfg, model_dir, base_model=mesh.model.name, dtype=mesh.model.dtype,
        max_model_len=mesh.model.max_model_len,
        storage_dir=storage or Path(mesh.run_dir) / f"rollout-{cfg.port or 'auto'}" / "adapters",
        on_loaded=announce,
    )
    await core.start()
    server, port, health = await serve(core, f"{cfg.host}:{cfg.port}", mesh.security.admin_token)
    core_holder["addr"] = f"{cfg.host}:{port}"
    running = service.Running(server, port, health, [core.stop], check=core.check_engine)
    if bus is not None:
        running.cleanups.append(bus.close)
    return running


if __name__ == "__main__":
    service.run("rollout", RolloutConfig, build)
