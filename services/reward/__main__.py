"""`python -m services.reward` / `hotloop serve reward`."""

from __future__ import annotations

from hotloop import metrics, service
from hotloop.config import MeshConfig

from .config import RewardConfig


async def build(mesh: MeshConfig, cfg: RewardConfig) -> service.Running:
    from .core import RewardCore
    from .server import serve

    # Detects the sandbox isolation (and starts Ray for the ray backend); a host that cannot
    # give the configured isolation stops the service here with IsolationUnavailable.
    core = RewardCore.from_config(cfg, metrics.registry())
    server, port, health = await serve(core, f"{cfg.host}:{cfg.port}")
    return service.Running(server, port, health, [core.close])


if __name__ == "__main__":
    service.run("reward", RewardConfig, build)
