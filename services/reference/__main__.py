"""`python -m services.reference` / `hotloop serve reference`.

Owns the `[reference]` section as the process reads it: the core's `ReferenceConfig` plus
where to listen. The base model and its dtype are the mesh's (`[model] name`, `[model]
dtype`), declared once for every service: the config loader refuses them in `[reference]`,
because a KL anchored to another model or precision is wrong without any error showing it.
"""

from __future__ import annotations

from pydantic import Field

from hotloop import metrics, service
from hotloop.config import MeshConfig, ServiceSection

from .config import ReferenceConfig


class ReferenceServiceConfig(ReferenceConfig, ServiceSection):
    """The `[reference]` section: the core's settings plus the listen address."""

    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(0, ge=0, le=65535)
    """Port to listen on; 0 picks a free one (written to the port file)."""


async def build(mesh: MeshConfig, cfg: ReferenceServiceConfig) -> service.Running:
    # torch and transformers load here, after the config has parsed (a bad flag fails fast)
    from hotloop import models

    from .core import ReferenceCore
    from .server import serve

    core = ReferenceCore(cfg, model_dir=models.resolve(mesh.model.name),
                         registry=metrics.registry())
    server, port, health = await serve(core, f"{cfg.host}:{cfg.port}")
    return service.Running(server, port, health)


if __name__ == "__main__":
    service.run("reference", ReferenceServiceConfig, build)
