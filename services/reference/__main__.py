"""`python -m services.reference` / `hotloop serve reference`.

Owns the `[reference]` section as the process reads it: the core's `ReferenceConfig` plus
where to listen. The base model is the mesh's (`[model] name`), the one every other service
uses; a `[reference] model` naming another model is refused at start, because a KL anchored to
a different model is wrong without any error showing it.
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
    from hotloop.errors import FatalError

    from .core import ReferenceCore
    from .server import serve

    if "model" in cfg.model_fields_set and cfg.model != mesh.model.name:
        raise FatalError(
            f"[reference] model = {cfg.model!r} but the mesh's base model is "
            f"{mesh.model.name!r}: the reference must be the trainer's base model"
        )
    cfg = cfg.model_copy(update={"model": mesh.model.name})
    core = ReferenceCore(cfg, model_dir=models.resolve(mesh.model.name),
                         registry=metrics.registry())
    server, port, health = await serve(core, f"{cfg.host}:{cfg.port}")
    return service.Running(server, port, health)


if __name__ == "__main__":
    service.run("reference", ReferenceServiceConfig, build)
