"""Every section of a hotloop config file, and loading a whole file at once.

Owns the one table from a section's name to its typed model (each service's, each recipe's
as the trainer's registry lists them, `[up]`'s) and `load`, which reads a file with its environment and `--set` overrides and
validates every section in one pass: a command reports all of a file's problems together
(`hotloop.config.ConfigError`, exit status 2 at the CLI), before it starts anything. Does not
own: the models (each lives beside its code) or the loader's rules (`hotloop.config`).
Services started as processes read only the shared sections and their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from hotloop import config
from hotloop.config import MeshConfig


def sections() -> dict[str, type[BaseModel]]:
    """Section name -> model, for every section a config file may hold."""
    from services.gateway.config import GatewayConfig
    from services.reference.__main__ import ReferenceServiceConfig
    from services.reward.config import RewardConfig
    from services.rollout.config import RolloutConfig
    from services.trainer.__main__ import TrainerServerConfig
    from services.trainer.config import TrainerConfig
    from services.trainer.recipes.registry import recipes

    from hotloop.tracking import ReportConfig

    from launch.mesh import UpConfig

    return {
        "rollout": RolloutConfig, "reward": RewardConfig, "reference": ReferenceServiceConfig,
        "gateway": GatewayConfig, "trainer": TrainerConfig, "trainer_server": TrainerServerConfig,
        # each recipe's own section, as it registered it (`[grpo]`, `[ppo]`, `[online]`, ...)
        **{name: entry.config for name, entry in recipes().items()},
        "up": UpConfig,
        "report": ReportConfig,
    }


@dataclass
class Loaded:
    """A config file as typed objects: the shared sections and every known section."""

    mesh: MeshConfig
    sections: dict[str, BaseModel]
    path: str | None

    def __getitem__(self, name: str) -> Any:
        return self.sections[name]


def load(path: str | None, overrides: list[str] | None = None,
         patch: dict[str, dict[str, Any]] | None = None) -> Loaded:
    """The file, the environment and `overrides`, every section validated together.
    `patch` sets values above all sources (e.g. `train ppo` sets `trainer.algorithm`)."""
    tree = config.raw_config(path, overrides)
    for section, values in (patch or {}).items():
        tree.setdefault(section, {}).update(values)
        for key in values:
            tree.sources[f"{section}.{key}"] = "the command"
    mesh, loaded = config.load_sections(tree, sections())
    return Loaded(mesh, loaded, path)
