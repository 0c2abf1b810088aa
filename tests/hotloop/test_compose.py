"""The GPU deployment cannot run here (no docker, no GPU); check what can be checked statically:
it parses, every served service exists and has a health check, the configs it names exist and
validate, Prometheus scrapes every service's metrics port, and Grafana's dashboard reads only
metrics the services define."""

import json
import re
from pathlib import Path

import yaml

from apps.cli import SERVICES
from launch.mesh import OPT_IN_SERVICES

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
    assert {"nats-1", "nats-2", "nats-3", "rollout", "gateway", "online-trainer"} <= {
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
    ports = _metrics_ports()
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


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_nats_is_a_jetstream_cluster_of_three_that_every_service_reaches():
    """Three JetStream servers, each with a store of its own, routed to each other; every
    hotloop service lists all three (the client fails over among them) and keeps 3 replicas
    of each stream, which the project's own loader accepts."""
    from urllib.parse import urlsplit

    from hotloop import config

    doc = yaml.safe_load((ROOT / "compose/docker-compose.yml").read_text())
    services = doc["services"]
    nats = {n: s for n, s in services.items() if s.get("image", "").startswith("nats:")}
    assert len(nats) == 3, sorted(nats)
    routes, stores, names, clusters = set(), set(), set(), set()
    for name, svc in nats.items():
        cmd = svc["command"]
        assert "-js" in cmd and cmd[0] == "nats-server", name
        port = urlsplit(_flag(cmd, "--cluster")).port
        routes.add(frozenset(_flag(cmd, "--routes").split(",")))
        clusters.add(_flag(cmd, "--cluster_name"))
        names.add(_flag(cmd, "--server_name"))
        (volume,) = [v for v in svc["volumes"] if v.endswith(":" + _flag(cmd, "-sd"))]
        stores.add(volume.split(":")[0])
        assert volume.split(":")[0] in doc["volumes"], f"{name}: store {volume} is not a named volume"
        monitor = _flag(cmd, "-m")
        assert svc["healthcheck"]["test"][-1] == f"http://127.0.0.1:{monitor}/healthz", name
        assert svc["restart"] == "unless-stopped"
    assert routes == {frozenset(f"nats://{n}:{port}" for n in nats)}, routes  # a full mesh, all alike
    assert len(clusters) == 1 and len(names) == len(stores) == 3

    hotloop = {n: s for n, s in services.items() if s.get("image") == "hotloop:latest"}
    for name, svc in hotloop.items():
        env = svc["environment"]
        tree = config.raw_config(None, environ={k: str(v) for k, v in env.items()
                                                if k.startswith("HOTLOOP__NATS__")})
        mesh = config.load_mesh(tree)
        servers = {urlsplit(u).hostname: urlsplit(u).port for u in mesh.nats.url.split(",")}
        assert servers == dict.fromkeys(nats, 4222), (name, servers)  # the servers' default port
        assert mesh.nats.replicas == 3, name

    def after(name: str) -> set[str]:  # what must be healthy (or done) before `name` starts
        deps = services[name].get("depends_on", {})
        return set(deps).union(*(after(d) for d in deps))

    for name in ("rollout", "gateway", "online-trainer", "trainer", "ppo-trainer"):  # the bus's users
        assert set(nats) <= after(name), name
    for name, svc in services.items():  # started is not enough: JetStream needs its meta leader
        for dep, how in svc.get("depends_on", {}).items():
            assert dep not in nats or how["condition"] == "service_healthy", (name, dep)


def test_the_gateway_finds_every_replica_of_a_scaled_rollout():
    """`--scale rollout=N`: N containers behind one name. The gateway's replica entry is that
    name as dns:/// on the port the rollout listens on, which its discovery parses; a replica
    publishes no host port (N would collide) and has no fixed container name."""
    from services.gateway.discovery import parse_name

    services = yaml.safe_load((ROOT / "compose/docker-compose.yml").read_text())["services"]
    rollout, gateway = services["rollout"], services["gateway"]
    (entry,) = json.loads(gateway["environment"]["HOTLOOP__ENDPOINTS__ROLLOUT"])
    assert parse_name(entry) is not None, f"{entry}: a plain address is one replica, whatever it resolves to"
    host, port = parse_name(entry)
    assert services[host] is rollout
    assert f"rollout.port={port}" in rollout["command"] and "rollout.host=0.0.0.0" in rollout["command"]
    assert "ports" not in rollout and "container_name" not in rollout
    assert rollout["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 1  # one GPU each


# ---- Prometheus and Grafana (static: no docker here; the files as compose mounts them) ----------


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose/docker-compose.yml").read_text())


def _mounts(svc: dict) -> dict[str, Path]:
    """A service's bind mounts: container path -> the file or folder in the repository."""
    out = {}
    for v in svc.get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith("."):
            out[dst] = (ROOT / "compose" / src).resolve()
    return out


def _metrics_ports() -> dict[str, int]:
    """Compose service -> the metrics port its `serve` command sets in its own section."""
    from hotloop import config
    from services.gateway.config import GatewayConfig
    from services.reference.__main__ import ReferenceServiceConfig
    from services.reward.config import RewardConfig
    from services.rollout.config import RolloutConfig
    from services.trainer.__main__ import TrainerServerConfig

    models = {"rollout": RolloutConfig, "reference": ReferenceServiceConfig, "reward": RewardConfig,
              "gateway": GatewayConfig, "trainer_server": TrainerServerConfig}
    ports = {}
    for name, svc in _compose()["services"].items():
        cmd = svc.get("command", [])
        if cmd[:1] != ["serve"]:
            continue
        sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
        (section,) = {s.split(".")[0] for s in sets if s.split("=")[0].endswith(".port")}
        tree = config.raw_config(None, sets, environ={})
        ports[name] = config.load_section(tree, section, models[section]).metrics_port
    return ports


def test_prometheus_scrapes_every_services_metrics_port_and_nothing_else():
    """Each `serve` service's metrics port, by its compose name (every replica of a scaled
    service: DNS service discovery), and never a users' port (the gateway's 8000)."""
    prometheus = _compose()["services"]["prometheus"]
    (config_file,) = [v for k, v in _mounts(prometheus).items() if k.endswith("prometheus.yml")]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    scrape = yaml.safe_load(config_file.read_text())["scrape_configs"]
    targets: dict[str, int] = {}
    for job in scrape:
        for sd in job.get("dns_sd_configs", []):
            assert sd["type"] == "A", job
            targets.update(dict.fromkeys(sd["names"], sd["port"]))
        for static in job.get("static_configs", []):
            targets.update({t.split(":")[0]: int(t.split(":")[1]) for t in static["targets"]})
    ports = _metrics_ports()
    assert {"rollout", "reference", "reward", "gateway", "online-trainer"} <= set(ports)
    assert targets == ports
    assert len({job["job_name"] for job in scrape}) == len(scrape)


def test_grafana_is_provisioned_with_prometheus_and_the_hotloop_dashboard():
    services = _compose()["services"]
    grafana = services["grafana"]
    mounts = _mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    (provider,) = yaml.safe_load((provisioning / "dashboards/hotloop.yml").read_text())["providers"]
    dashboards = mounts[provider["options"]["path"]]
    assert dashboards == ROOT / "compose/grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / Path(home).relative_to(provider["options"]["path"])).is_file()
    for path in dashboards.glob("*.json"):
        panels = [p for p in json.loads(path.read_text())["panels"] if p["type"] != "row"]
        assert panels, path
        for panel in panels:
            assert panel["datasource"]["uid"] == source["uid"] and panel["targets"], panel["title"]
    for name in ("prometheus", "grafana"):
        assert services[name]["restart"] == "unless-stopped"
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), name


def _defined_metrics() -> set[str]:
    """Every metric name a service or the library defines: a `hotloop_...` string passed to a
    call (prometheus_client's Counter/Histogram/Gauge, the state collectors' counter/gauge),
    without a counter's `_total`, which prometheus_client adds or keeps."""
    import ast

    names = set()
    for root in ("services", "hotloop"):
        for path in (ROOT / root).rglob("*.py"):
            if "proto" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    for arg in node.args[:2]:
                        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                                and re.fullmatch(r"hotloop_[a-z0-9_]+", arg.value):
                            names.add(arg.value.removesuffix("_total"))
    return names


def _dashboard_metrics() -> dict[str, set[str]]:
    """Dashboard file -> the metric names its queries read (the PromQL parsed loosely: every
    `hotloop_...` word, without a histogram's `_bucket`/`_sum`/`_count` or a counter's `_total`)."""
    out = {}
    for path in (ROOT / "compose/grafana/dashboards").glob("*.json"):
        exprs = [t["expr"] for p in json.loads(path.read_text())["panels"] for t in p.get("targets", [])]
        out[path.name] = {re.sub(r"_(bucket|sum|count)$", "", n).removesuffix("_total")
                          for e in exprs for n in re.findall(r"hotloop_\w+", e)}
    return out


def test_every_metric_a_dashboard_reads_is_one_a_service_defines():
    defined = _defined_metrics()
    assert {"hotloop_trainer_loop_seconds", "hotloop_gateway_feedback", "hotloop_rollout_pushes"} <= defined
    used = _dashboard_metrics()
    assert used, "no dashboard"
    for name, metrics in used.items():
        assert metrics - defined == set(), name
    # what the dashboard is for: the update loop, versions per replica and per tenant, feedback
    # accepted, trained and dropped by reason, users' time to first token and between tokens
    assert {"hotloop_trainer_loop_seconds", "hotloop_gateway_replica_version", "hotloop_rollout_version",
            "hotloop_gateway_tenant_newest_version", "hotloop_gateway_replica_tenant_version",
            "hotloop_gateway_feedback", "hotloop_trainer_feedback_trained",
            "hotloop_trainer_feedback_dropped", "hotloop_trainer_feedback_dead_lettered",
            "hotloop_gateway_time_to_first_token_seconds",
            "hotloop_gateway_inter_token_seconds"} <= used["hotloop.json"]
