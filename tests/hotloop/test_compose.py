"""The GPU deployment cannot run here; check what can be checked: it parses, every served
service exists and has a health check, and the configs it names exist and validate."""

from pathlib import Path

import yaml

from apps.cli import SERVICES
from apps.launcher import OPT_IN_SERVICES

ROOT = Path(__file__).resolve().parents[2]


def test_compose_services_are_real_and_health_checked():
    doc = yaml.safe_load((ROOT / "compose/docker-compose.yml").read_text())
    served = {}
    for name, svc in doc["services"].items():
        cmd = svc.get("command", [])
        if cmd[:1] == ["serve"]:
            assert cmd[1] in SERVICES + OPT_IN_SERVICES, f"{name} serves unknown service {cmd[1]}"
            assert (ROOT / "services" / cmd[1] / "__main__.py").exists()
            assert "healthcheck" in svc, f"{name} has no health check"
            served[cmd[1]] = svc
        if "--config" in cmd:
            path = cmd[cmd.index("--config") + 1]
            if path.startswith("${"):  # ${HOTLOOP_CONFIG:-default}
                path = path.split(":-", 1)[1].rstrip("}")
            assert (ROOT / path).exists()
    assert {"rollout", "reference", "reward", "gateway"} <= set(served)
    for gpu in ("rollout", "reference"):
        assert served[gpu]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_long_running_services_restart_and_jobs_end():
    """A crashed service comes back while the others keep running; a job (model pull,
    training run) is not rerun when it ends."""
    services = yaml.safe_load((ROOT / "compose/docker-compose.yml").read_text())["services"]
    for name, svc in services.items():
        job = svc.get("command", [""])[0] in ("train", "models")
        want = "no" if job else "unless-stopped"
        assert svc.get("restart", "no") == want, f"{name}: restart {svc.get('restart')!r}, want {want!r}"
    assert {"nats", "rollout", "gateway", "online-trainer"} <= {
        n for n, s in services.items() if s.get("restart") == "unless-stopped"}


def test_a_restarted_replica_knows_where_to_fetch_missed_versions():
    """The rollout's `[endpoints] trainer` is the online trainer's FetchAdapter address."""
    services = yaml.safe_load((ROOT / "compose/docker-compose.yml").read_text())["services"]
    host, port = services["rollout"]["environment"]["HOTLOOP__ENDPOINTS__TRAINER"].split(":")
    trainer = services[host]["command"]
    assert trainer[:2] == ["serve", "trainer"]
    assert f"trainer_server.port={port}" in trainer and "trainer_server.host=0.0.0.0" in trainer
    assert services[host]["healthcheck"]["test"][-1] == port


def test_every_served_service_exposes_metrics_on_a_port_of_its_own():
    """A scraper in the compose network finds each service's /metrics on a fixed port, set in
    the section the service reads (the one its gRPC port is set in) and valid there."""
    from hotloop import config
    from services.gateway.config import GatewayConfig
    from services.reference.__main__ import ReferenceServiceConfig
    from services.reward.config import RewardConfig
    from services.rollout.config import RolloutConfig
    from services.trainer.__main__ import TrainerServerConfig

    models = {"rollout": RolloutConfig, "reference": ReferenceServiceConfig, "reward": RewardConfig,
              "gateway": GatewayConfig, "trainer_server": TrainerServerConfig}
    services = yaml.safe_load((ROOT / "compose/docker-compose.yml").read_text())["services"]
    ports = {}
    for name, svc in services.items():
        cmd = svc.get("command", [])
        if cmd[:1] != ["serve"]:
            continue
        sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
        (section,) = {s.split(".")[0] for s in sets if s.split("=")[0].endswith(".port")}
        tree = config.raw_config(None, sets, environ={})
        ports[name] = config.load_section(tree, section, models[section]).metrics_port
    assert {"rollout", "reference", "reward", "gateway", "online-trainer"} <= set(ports)
    assert all(p > 0 for p in ports.values()) and len(set(ports.values())) == len(ports), ports


def test_dockerfile_copies_existing_paths():
    for line in (ROOT / "compose/Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"


def test_colocated_profile_runs_ppo_without_a_reference_service():
    """`--profile colocated` starts PPO with the reference inside the trainer: no service of
    that profile needs the reference, and the reference is not started without a profile."""
    doc = yaml.safe_load((ROOT / "compose/docker-compose.yml").read_text())
    services = doc["services"]
    ppo = services["ppo-trainer"]
    assert ppo["profiles"] == ["colocated"] and ppo["command"][:2] == ["train", "ppo"]
    assert "reference" not in ppo["depends_on"]
    assert "HOTLOOP__ENDPOINTS__REFERENCE" not in ppo["environment"]
    assert "colocated" not in services["reference"]["profiles"]
    for name, svc in services.items():
        if "colocated" in svc.get("profiles", ["colocated"]):  # profile-less services start too
            assert "reference" not in svc.get("depends_on", {}), name
    from hotloop import config
    from services.trainer.recipes.ppo import PpoJobConfig

    tree = config.raw_config(ROOT / ppo["command"][3], environ={})
    assert config.load_section(tree, "ppo", PpoJobConfig).reference == "colocated"


def test_the_gateway_is_health_checked_on_its_readiness():
    """Healthy means a rollout replica can serve (`/ready`), not only that the process answers
    (`/health`). The script's answers against a real gateway: tests/gateway/test_gateway_edges.py."""
    from types import SimpleNamespace

    from services.gateway.config import GatewayConfig
    from services.gateway.http import build_app

    gateway = yaml.safe_load((ROOT / "compose/docker-compose.yml").read_text())["services"]["gateway"]
    http_port = next(c.split("=", 1)[1] for c in gateway["command"]
                     if c.startswith("gateway.http_port="))
    assert gateway["healthcheck"]["test"] == [
        "CMD", "hotloop-healthcheck", "--http", http_port, "/ready"]
    app = build_app(SimpleNamespace(cfg=GatewayConfig()))
    assert "/ready" in {route.path for route in app.routes}


def test_the_image_holds_every_package_pyproject_installs():
    """The image's entry point, `hotloop`, is apps.cli; a package left out of the image fails
    only when its first command runs there."""
    import tomllib

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    copied = {line.split()[1] for line in (ROOT / "compose/Dockerfile").read_text().splitlines()
              if line.startswith("COPY ")}
    assert {pattern.rstrip("*") for pattern in find["include"]} <= copied
