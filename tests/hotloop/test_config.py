from pathlib import Path

import pytest
from pydantic import ValidationError

from hotloop import config

ROOT = Path(__file__).resolve().parents[2]


def test_layering_file_env_cli(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nname = "from-file"\nmax_model_len = 512\n[rollout]\nport = 1\n')
    env = {"HOTLOOP__MODEL__NAME": "from-env", "HOTLOOP__ROLLOUT__PORT": "2"}
    tree = config.raw_config(f, ["rollout.port=3"], environ=env)
    mesh = config.load_mesh(tree)
    assert mesh.model.name == "from-env"  # env beats file
    assert mesh.model.max_model_len == 512  # file beats default
    assert tree["rollout"]["port"] == 3  # CLI beats env


def test_unknown_keys_and_bad_values_are_errors(tmp_path):
    with pytest.raises(ValidationError):
        config.load_mesh(config.raw_config(None, ["model.nmae=x"], environ={}))
    with pytest.raises(ValidationError):
        config.load_mesh(config.raw_config(None, ["model.max_model_len=1"], environ={}))
    with pytest.raises(ValueError, match="key=value"):
        config.raw_config(None, ["model.name"], environ={})
    with pytest.raises(FileNotFoundError):
        config.raw_config(tmp_path / "missing.toml")


def test_json_values_parse():
    tree = config.raw_config(None, ['endpoints.rollout=["a:1","b:2"]', "model.dtype=float32"], environ={})
    assert config.load_mesh(tree).endpoints.rollout == ["a:1", "b:2"]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_config_file_parses(path):
    """Each section of each shipped config validates against its service's model."""
    from services.reference.config import ReferenceConfig
    from services.reward.config import RewardConfig
    from services.rollout.config import RolloutConfig
    from services.trainer.config import TrainerConfig
    from services.gateway.config import GatewayConfig
    from services.trainer.__main__ import TrainerServerConfig
    from services.trainer.config import OnlineConfig
    from services.trainer.grpo_async import AsyncGrpoJobConfig
    from services.trainer.ppo import PpoJobConfig

    from apps.launcher import UpConfig

    sections = {"rollout": RolloutConfig, "reward": RewardConfig, "reference": ReferenceConfig,
                "trainer": TrainerConfig, "grpo": AsyncGrpoJobConfig, "gateway": GatewayConfig,
                "ppo": PpoJobConfig,
                "online": OnlineConfig, "trainer_server": TrainerServerConfig, "up": UpConfig}
    tree = config.raw_config(path, environ={})
    config.load_mesh(tree)
    for name in tree:
        if name in sections:
            config.load_section(tree, name, sections[name])
        else:
            assert name in config.MeshConfig.model_fields, f"unknown section [{name}] in {path.name}"
