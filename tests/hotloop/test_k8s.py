"""The Kubernetes deployment (deploy/k8s) cannot run here; check what can be checked, as
test_compose.py does for compose: every manifest parses and is applied, every workload runs a
real `hotloop serve <service>` with the config the ConfigMap holds (which the project's own
loader accepts), probes ask real ports and paths, Secrets and ConfigMaps referenced exist,
GPU services ask for a GPU, selectors find their pods, and the NATS cluster, the endpoints
and the headless rollout Service agree with each other."""

from __future__ import annotations

import functools
import shlex
from pathlib import Path

import yaml

from apps.cli import SERVICES
from launch.mesh import OPT_IN_SERVICES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/k8s"
GPU = {"rollout", "reference", "trainer"}
SECTION = {"rollout": "rollout", "reference": "reference", "reward": "reward", "gateway": "gateway",
           "trainer": "trainer_server"}  # the section a served service listens by


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@functools.cache
def manifests() -> list[dict]:
    return [doc for f in kustomization()["resources"]
            for doc in yaml.safe_load_all((K8S / f).read_text()) if doc]


def objects(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in manifests() if o["kind"] == kind}


def workloads() -> dict[str, dict]:
    return {**objects("Deployment"), **objects("StatefulSet")}


def served(workload: dict) -> tuple[str, dict] | None:
    """(service, container) of the `hotloop serve <service>` container in a workload."""
    for c in workload["spec"]["template"]["spec"]["containers"]:
        if c["image"] == "hotloop" and c.get("args", [])[:1] == ["serve"]:
            return c["args"][1], c
    return None


def config_file() -> Path:
    (generator,) = [g for g in kustomization()["configMapGenerator"] if g["name"] == "hotloop-config"]
    (name,) = generator["files"]
    return K8S / name


def loaded():
    """The ConfigMap's TOML through the project's loader: every section checked at once."""
    from launch.sections import sections
    from hotloop import config

    return config.load_sections(config.raw_config(config_file(), environ={}), sections())


def test_every_manifest_parses_and_is_applied():
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, f"applied {sorted(listed)}, on disk {sorted(on_disk)}"
    for o in manifests():
        assert {"apiVersion", "kind", "metadata"} <= set(o), o
    assert kustomization()["namespace"] in objects("Namespace")


def test_every_workload_serves_a_real_service_with_the_config_map():
    mesh, sections = loaded()
    names = {}
    for name, w in workloads().items():
        if name == "nats":
            continue
        found = served(w)
        assert found is not None, f"{name} runs no `hotloop serve <service>`"
        service, container = found
        assert service in SERVICES + OPT_IN_SERVICES, f"{name} serves unknown service {service}"
        assert (ROOT / "services" / service / "__main__.py").exists()
        names[service] = name
        path = Path(container["args"][container["args"].index("--config") + 1])
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        assert path.name == config_file().name, name
        assert volumes[mounts[str(path.parent)]]["configMap"]["name"] == "hotloop-config", name
        # the listen address comes from the file: every interface, the port the Service names
        listen = sections[SECTION[service]]
        assert listen.host == "0.0.0.0" and listen.port > 0, name
        for init in w["spec"]["template"]["spec"].get("initContainers", []):
            assert init["args"] == ["models", "pull", mesh.model.name], name
    assert set(names) == {"rollout", "reference", "reward", "gateway", "trainer"}


def test_readiness_probes_ask_real_ports_and_paths():
    """gRPC health for the gRPC services (the probe's service name is one the server
    registers), the gateway's `/ready` (a replica can serve) on its HTTP port, NATS's /healthz
    on its monitoring port."""
    import importlib
    from types import SimpleNamespace

    from services.gateway.config import GatewayConfig
    from services.gateway.http import build_app

    _, sections = loaded()
    routes = {r.path for r in build_app(SimpleNamespace(cfg=GatewayConfig())).routes}
    for name, w in workloads().items():
        for c in w["spec"]["template"]["spec"]["containers"]:
            ports = {p["containerPort"] for p in c["ports"]}
            probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c}
            assert "readinessProbe" in probes, f"{name} has no readiness probe"
            for kind, probe in probes.items():
                if "httpGet" in probe:
                    port, path = probe["httpGet"]["port"], probe["httpGet"]["path"]
                    assert port in ports, (name, kind, port)
                    if name == "nats":
                        assert port == int(c["args"][c["args"].index("-m") + 1]), (name, kind)
                        assert path.split("?")[0] == "/healthz", (name, kind)
                    else:
                        assert served(w)[0] == "gateway" and port == sections["gateway"].http_port
                        assert path in routes, (name, kind, path)
                else:
                    service = served(w)[0]  # its server registers health as its proto's service
                    proto = importlib.import_module(f"hotloop.proto.v1.{service}_pb2")
                    full = proto.DESCRIPTOR.services_by_name[service.capitalize()].full_name
                    assert probe["grpc"]["port"] == sections[SECTION[service]].port, (name, kind)
                    assert probe["grpc"].get("service", "") in ("", full), (name, kind)
    gateway = workloads()["gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"  # not /health: it can serve


def test_secrets_referenced_exist_and_reach_the_settings_that_read_them():
    """Every Secret reference names the generated Secret and one of its keys; the user keys are
    a file where `[security] user_tokens_file` looks; the admin token reaches both ends of a
    push (the trainer signs, the rollout checks) as the variable the loader reads."""
    from hotloop.config import ENV_PREFIX

    mesh, _ = loaded()
    generated = {g["name"]: {f.split("=")[0] for f in g["files"]} for g in kustomization()["secretGenerator"]}
    assert (K8S / "secrets/.gitignore").read_text().splitlines()[-2:] == ["*", "!.gitignore"]
    token_holders = set()
    for name, w in workloads().items():
        spec = w["spec"]["template"]["spec"]
        for c in spec["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in generated.get(ref["name"], set()), (name, ref)
                    if env["name"] == f"{ENV_PREFIX}SECURITY__ADMIN_TOKEN":
                        token_holders.add(name)
            for m in c.get("volumeMounts", []):
                volume = next((v for v in spec.get("volumes", []) if v["name"] == m["name"]), {})
                if "secret" in volume:  # (not found: a StatefulSet's claim)
                    items = volume["secret"]["items"]
                    assert {i["key"] for i in items} <= generated[volume["secret"]["secretName"]]
                    files = {f'{m["mountPath"]}/{i["path"]}' for i in items}
                    assert mesh.security.user_tokens_file in files, (name, files)
    assert token_holders == {"rollout", "trainer"}
    assert not mesh.security.admin_token and not mesh.security.user_tokens  # no secret in the map


def test_the_gpu_services_ask_for_one_gpu_each():
    for name, w in workloads().items():
        for c in w["spec"]["template"]["spec"]["containers"]:
            gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            assert gpus == (1 if name in GPU else None), f"{name}: nvidia.com/gpu {gpus}"


def test_selectors_find_their_pods_and_service_ports_exist():
    pods = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in workloads().items()}

    def selects(selector: dict) -> list[str]:
        return [n for n, labels in pods.items() if selector.items() <= labels.items()]

    for name, w in workloads().items():
        assert selects(w["spec"]["selector"]["matchLabels"]) == [name], name
    for name, svc in objects("Service").items():
        (target,) = selects(svc["spec"]["selector"])
        container_ports = {p["containerPort"] for c in workloads()[target]["spec"]["template"]["spec"]["containers"]
                           for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p.get("targetPort", p["port"]) in container_ports, (name, p)
    for name, pdb in objects("PodDisruptionBudget").items():
        assert selects(pdb["spec"]["selector"]["matchLabels"]) == [name]


def test_the_config_names_the_services_and_the_nats_cluster_that_exist():
    """`[endpoints]` entries are Services on the ports their services listen on, the rollout's
    a dns:/// name of a headless Service (one address per replica, as the gateway wants);
    `[nats] url` lists every pod of the NATS StatefulSet, whose servers route to each other and
    start together, and `replicas` is its size."""
    from services.gateway.discovery import parse_name

    mesh, sections = loaded()
    services = objects("Service")
    (rollout,) = mesh.endpoints.rollout
    host, port = parse_name(rollout)
    assert services[host]["spec"].get("clusterIP") == "None" and port == sections["rollout"].port
    for section in ("reference", "reward", "trainer", "gateway"):
        target = getattr(mesh.endpoints, section)
        (target,) = [target] if isinstance(target, str) else target  # one Service each
        host, port = target.split(":")
        assert any(p["port"] == int(port) for p in services[host]["spec"]["ports"]), section
        assert int(port) == sections[SECTION[section]].port, section

    nats = workloads()["nats"]
    size, headless = nats["spec"]["replicas"], services[nats["spec"]["serviceName"]]
    assert size == mesh.nats.replicas == 3
    # routes resolve before any server is ready, and no server waits for another to be ready
    assert headless["spec"].get("clusterIP") == "None" and headless["spec"].get("publishNotReadyAddresses")
    assert nats["spec"].get("podManagementPolicy") == "Parallel"
    pods = [f"{nats['metadata']['name']}-{i}.{headless['metadata']['name']}" for i in range(size)]
    assert mesh.nats.url.split(",") == [f"nats://{p}:4222" for p in pods]
    (c,) = nats["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    cluster_port = int(args[args.index("--cluster") + 1].rsplit(":", 1)[1])
    assert args[args.index("--routes") + 1].split(",") == [f"nats://{p}:{cluster_port}" for p in pods]
    assert "-js" in args and args[args.index("-sd") + 1] in {m["mountPath"] for m in c["volumeMounts"]}
    name_var = args[args.index("--server_name") + 1]
    (env,) = [e for e in c["env"] if f"$({e['name']})" == name_var]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_the_trainer_is_one_pod_at_a_time_with_its_runs_on_a_volume():
    """Two online trainers would both train and publish; a new pod resumes from the
    checkpoints the old one left on the claim."""
    _, sections = loaded()
    trainer = workloads()["trainer"]
    assert trainer["spec"]["replicas"] == 1 and trainer["spec"].get("strategy", {}).get("type") == "Recreate"
    spec = trainer["spec"]["template"]["spec"]
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"]
                if m["mountPath"] == sections["online"].out_dir]
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["persistentVolumeClaim"]["claimName"] in objects("PersistentVolumeClaim")


def test_every_service_runs_as_the_cli_parses_it():
    """The containers' arguments are command lines `hotloop` (the image's entry point) accepts."""
    from apps.cli import build_parser

    assert 'ENTRYPOINT ["hotloop"]' in (ROOT / "compose/Dockerfile").read_text().splitlines()
    assert [i["name"] for i in kustomization()["images"]] == ["hotloop"]  # what the registry path replaces
    for name, w in workloads().items():
        if name != "nats":
            service, container = served(w)
            args = build_parser().parse_args(container["args"])
            assert args.service == service, shlex.join(container["args"])
