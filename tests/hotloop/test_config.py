from pathlib import Path

import pytest

from hotloop import config
from hotloop.config import ConfigError, ModelConfig, TelemetryConfig

ROOT = Path(__file__).resolve().parents[2]


def test_layering_file_env_cli(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nname = "from-file"\nmax_model_len = 512\n[rollout]\nport = 1\n')
    env = {"HOTLOOP__MODEL__NAME": "from-env", "HOTLOOP__ROLLOUT__PORT": "2"}
    tree = config.raw_config(f, ["rollout.port=3"], environ=env)
    mesh = config.load_mesh(tree)
    assert mesh.model.name == "from-env"  # env beats file
    assert mesh.model.max_model_len == 512  # file beats default
    assert tree["rollout"]["port"] == "3"  # CLI beats env (text, for the field to parse)
    assert tree.sources["rollout.port"] == "--set rollout.port=3"
    assert tree.sources["model.name"] == "environment HOTLOOP__MODEL__NAME"
    assert tree.sources["model.max_model_len"] == str(f)


def test_unknown_keys_and_bad_values_are_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"--set model.nmae=x: \[model\] nmae: unknown key; did you mean 'name'\?"):
        config.load_mesh(config.raw_config(None, ["model.nmae=x"], environ={}))
    with pytest.raises(ConfigError, match=r"\[model\] max_model_len: .*greater than or equal to 64 \(got '1'\)"):
        config.load_mesh(config.raw_config(None, ["model.max_model_len=1"], environ={}))
    with pytest.raises(ConfigError, match="key=value"):
        config.raw_config(None, ["model.name"], environ={})
    with pytest.raises(ConfigError, match="missing.toml: the config file does not exist"):
        config.raw_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nname = 1\n")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        config.raw_config(bad)


def test_every_problem_at_once_each_with_its_source_section_and_key(tmp_path):
    """One run of `hotloop up` or `train` with a bad file and a bad --set reports all of it,
    each line naming where the value came from."""
    f = tmp_path / "c.toml"
    f.write_text('[model]\ndtpe = "float32"\n[telemetry]\nexporter = "zipkin"\n[telemtry]\nx = 1\n')
    tree = config.raw_config(f, ["model.max_model_len=abc"], environ={"HOTLOOP__NATS__CONNECT_TIMEOUT_S": "-1"})
    with pytest.raises(ConfigError) as e:
        config.load_sections(tree, {"extra": TelemetryConfig})
    problems = sorted(e.value.problems)
    assert len(problems) == 5, problems
    assert f"{f}: [model] dtpe: unknown key; did you mean 'dtype'?" in problems
    assert any(p.startswith(f"{f}: [telemetry] exporter: Input should be") for p in problems)
    assert f"{f}: unknown section 'telemtry'; did you mean [telemetry]?" in problems
    assert any(p.startswith("--set model.max_model_len=abc: [model] max_model_len:") for p in problems)
    assert any(p.startswith("environment HOTLOOP__NATS__CONNECT_TIMEOUT_S: [nats] connect_timeout_s:")
               for p in problems)
    assert str(e.value).startswith("5 configuration errors:\n  - ")


def test_a_typo_finds_the_key_in_another_section():
    tree = config.raw_config(None, ["extra.max_model_length=9"], environ={})
    with pytest.raises(ConfigError, match=r"did you mean \[model\] max_model_len\?"):
        config.load_sections(tree, {"extra": TelemetryConfig})


def test_a_service_checks_only_its_own_section():
    """Other processes' sections are theirs to check; a service's loader ignores them."""
    tree = config.raw_config(None, ["someone_else.x=1", "extra.jsonl_path=p"], environ={})
    mesh, loaded = config.load_sections(tree, {"extra": TelemetryConfig}, only_known=False)
    assert loaded["extra"].jsonl_path == "p" and isinstance(mesh.model, ModelConfig)


def test_values_keep_their_text_for_their_own_type():
    tree = config.raw_config(None, ["nats.url=3", "model.max_model_len=512", "telemetry.otlp_endpoint=null"],
                             environ={})
    assert (tree["nats"]["url"], tree["model"]["max_model_len"]) == ("3", "512")
    with pytest.raises(ConfigError, match=r"\[telemetry\] otlp_endpoint: Input should be a valid string \(got None\)"):
        config.load_mesh(tree)
    mesh = config.load_mesh(config.raw_config(None, ["nats.url=3", "model.max_model_len=512"], environ={}))
    assert (mesh.nats.url, mesh.model.max_model_len) == ("3", 512)


def test_json_values_parse():
    tree = config.raw_config(None, ['endpoints.rollout=["a:1","b:2"]', "model.dtype=float32"], environ={})
    assert config.load_mesh(tree).endpoints.rollout == ["a:1", "b:2"]


def test_a_quoted_value_is_its_text_as_in_toml():
    """`--set rollout.cpu_omp_threads_bind="1"` (quoted as in the TOML file) is the text 1,
    not the three characters with quotes; a broken quote stays text for the field to judge."""
    tree = config.raw_config(None, ['rollout.cpu_omp_threads_bind="1"', 'nats.url="nats://h:1"',
                                    'run_dir="unclosed'], environ={})
    assert tree["rollout"]["cpu_omp_threads_bind"] == "1"
    assert tree["nats"]["url"] == "nats://h:1"
    assert tree["run_dir"] == '"unclosed'


def test_every_replicated_endpoint_takes_a_list_or_one_address():
    """Configs and environment overrides written for one replica (`HOTLOOP__ENDPOINTS__REWARD=
    reward:50053`, as compose sets it) still work; a list gives several replicas."""
    env = {"HOTLOOP__ENDPOINTS__REWARD": "reward:50053", "HOTLOOP__ENDPOINTS__REFERENCE": '["r:1", "r:2"]',
           "HOTLOOP__ENDPOINTS__ROLLOUT": "dns:///rollout:50051"}
    ep = config.load_mesh(config.raw_config(None, [], environ=env)).endpoints
    assert (ep.reward, ep.reference, ep.rollout) == (["reward:50053"], ["r:1", "r:2"], ["dns:///rollout:50051"])
    assert config.load_mesh(config.raw_config(None, ["endpoints.reward="], environ={})).endpoints.reward == []
    with pytest.raises(ConfigError) as e:
        config.load_mesh(config.raw_config(None, ['endpoints.reward=["a:1","b:2","a:1"]',
                                                  'endpoints.reference=["r:1", ""]'], environ={}))
    assert "[endpoints] reward: Value error, a:1 listed more than once" in str(e.value)
    assert "[endpoints] reference.1: String should have at least 1 character" in str(e.value)


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
    from services.trainer.recipes.grpo_async import AsyncGrpoJobConfig
    from services.trainer.recipes.ppo import PpoJobConfig

    from launch.mesh import UpConfig

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


def test_nats_names_a_cluster_and_its_replica_count():
    """`[nats] url` lists a cluster's servers comma-separated (spaces trimmed); an empty entry
    is an error, not a server; `replicas` is 1 unless set, and JetStream's bounds hold."""
    mesh = config.load_mesh(config.raw_config(
        None, ["nats.url=nats://a:4222, nats://b:4222", "nats.replicas=3"], environ={}))
    assert mesh.nats.url == "nats://a:4222,nats://b:4222" and mesh.nats.replicas == 3
    assert config.load_mesh(config.raw_config(None, environ={})).nats.replicas == 1
    with pytest.raises(ConfigError, match=r"\[nats\] url: .*empty server"):
        config.load_mesh(config.raw_config(None, ["nats.url=nats://a:4222,,nats://b:4222"], environ={}))
    with pytest.raises(ConfigError, match=r"\[nats\] replicas: .*less than or equal to 5"):
        config.load_mesh(config.raw_config(None, ["nats.replicas=7"], environ={}))


def test_an_admin_token_read_from_a_file_loses_its_newline():
    """A Secret written with `openssl rand -hex 24 > file` ends in a newline, which gRPC
    metadata refuses; both ends of a push read the same stripped token."""
    mesh = config.load_mesh(config.raw_config(
        None, environ={"HOTLOOP__SECURITY__ADMIN_TOKEN": "0123abcd\n"}))
    assert mesh.security.admin_token == "0123abcd"
