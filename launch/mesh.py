"""A whole mesh on one machine, as local processes on loopback, kept running (`hotloop up`,
the demos, the benchmarks).

Owns: starting NATS (one JetStream server, or a cluster of `[up] nats_servers`, stores under
the run directory), generating the admin
token and the gateway's user API key file, starting each service as `python -m services.<name>`
(rollout, reference and reward as `[up] replicas` processes each: `rollout`, `rollout-1`, ...)
with its log file, waiting until each is healthy, writing `<run_dir>/mesh.json` (how clients
find the mesh, including the gateway's HTTP URL; every replica of a replicated service listed
under its name, in replica order), supervising, and stopping everything in order on Ctrl-C.

Supervision (`Mesh.poll`, looped by `watch`): a service that exits without being stopped is
restarted after a doubling backoff while the others keep running; NATS likewise (each server
of a cluster on its own), on the same port and store. Each comes back on the port it had (chosen by the OS at the first start, then
passed as `--set <section>.port`), so the endpoints and mesh.json stay valid and the gateway
and the trainer find a restarted replica where they knew it; mesh.json is rewritten with the
new pid. A restarted service reads the endpoints as they are then (a replica restarted after
the trainer came up knows where to fetch the versions it missed). One crash more than
`[up] max_restarts` within `restart_window_s` stops the mesh, saying which process, how it
ended and its last log lines: a service that cannot stay up is a fault to fix, not to hide.
Also: where a running mesh's users go (`find_target`: its gateway and a user key, from mesh.json).
Does not own: any service's logic; services get their endpoints through the environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from hotloop import config as hconfig
from hotloop.config import MeshConfig, Section
from services.rollout.config import RolloutConfig

from launch.natsserver import NatsCluster, NatsServer
from launch.processes import die_with_parent, tail_log
from measure.users import Target

# Start order: the trainer job and the gateway need the others' endpoints.
ALL_SERVICES = ["reference", "reward", "rollout", "gateway"]
# Started only when named (`--services ...,trainer`), last: the online trainer learns from the
# gateway's feedback and pushes to the rollout replicas.
OPT_IN_SERVICES = ["trainer"]
MESH_FILE = "mesh.json"
# Where each service takes its listening port (`--set`), so a restart can reuse it.
PORT_KEYS = {"rollout": "rollout.port", "reward": "reward.port", "reference": "reference.port",
             "gateway": "gateway.port", "trainer": "trainer_server.port"}
# Services that run as several processes (`[up] replicas`); mesh.json lists each as a list.
REPLICATED = ("rollout", "reference", "reward")


class UpReplicas(Section):
    """`[up] replicas`: how many processes of each replicated service `hotloop up` starts,
    each on its own port with its own restarts (`rollout`, `rollout-1`, ...: their logs, port
    files and pids go by these names). A job spreads its work over them (hotloop/replicas.py)."""

    rollout: int = Field(1, ge=1, le=16)
    """Rollout replicas, each its own engine, with its adapters under `<run_dir>/<name>`. The
    gateway routes users among them; the trainer pushes every version to each."""
    reference: int = Field(1, ge=1, le=16)
    """Reference replicas, each with its own copy of the base model."""
    reward: int = Field(1, ge=1, le=16)
    """Reward replicas, each with its own sandboxes."""


class UpConfig(Section):
    """The `[up]` section: what `hotloop up` starts and how it keeps it running."""

    replicas: UpReplicas = UpReplicas()
    """Processes of each replicated service, e.g. `replicas = {rollout = 2, reward = 2}`
    (`hotloop up --replicas rollout=2,reward=2` sets the same)."""
    rollout_replicas: int | None = Field(None, ge=1, le=16)
    """The same as `replicas.rollout`, from before every service could have replicas; kept so
    that older configs start as they did. Giving both with different counts is an error."""
    max_restarts: int = Field(5, ge=0, le=1000)
    """Restarts of one service (or of NATS) allowed within `restart_window_s`; its next crash
    in the window stops the whole mesh, saying which process and why. 0: the first crash of
    anything stops the mesh."""
    restart_window_s: float = Field(600.0, gt=0)
    """The window `max_restarts` counts in: a service that crashes now and then is restarted
    for as long as the mesh runs; one that keeps crashing is not hidden."""
    restart_backoff_s: float = Field(1.0, ge=0)
    """Wait before restarting a crashed process; it doubles with each crash in the window."""
    restart_backoff_max_s: float = Field(60.0, ge=0)
    """Cap on that wait."""
    nats_servers: int = Field(1, ge=1, le=5)
    """NATS servers to start on loopback: 1, or a JetStream cluster of 3 (or 5) routed to each
    other, each with its own store and port. With `[nats] replicas` as large, the mesh loses
    nothing while one server (two of five) is down. An even count is refused: its extra
    server is one more that a majority needs, not one more that may fail."""

    @model_validator(mode="after")
    def _one_rollout_count(self) -> "UpConfig":
        old = self.rollout_replicas
        if old is not None:
            if "rollout" in self.replicas.model_fields_set and self.replicas.rollout != old:
                raise ValueError(f"rollout_replicas = {old} and replicas.rollout = {self.replicas.rollout} "
                                 f"disagree; keep replicas.rollout only")
            self.replicas = self.replicas.model_copy(update={"rollout": old})
        return self
    start_timeout_s: float = Field(300.0, gt=0)
    """Longest a service may take to listen, at the first start (past it `hotloop up` fails)
    and after a restart (past it the restart counts as a crash). A vLLM engine takes ~20-60 s
    on a small CPU host; a rollout replica also catches up first (`catchup_timeout_s`)."""

    @field_validator("nats_servers")
    @classmethod
    def _odd(cls, n: int) -> int:
        if n % 2 == 0:
            raise ValueError(f"{n} servers survive no more failures than {n - 1}; use 1, 3 or 5")
        return n


@dataclass
class RestartPolicy:
    """Bounded exponential backoff, and a limit on crashes within a window (clock passed in)."""

    max_restarts: int
    window_s: float
    backoff_s: float
    backoff_max_s: float
    crashes: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, up: UpConfig) -> "RestartPolicy":
        return cls(up.max_restarts, up.restart_window_s, up.restart_backoff_s,
                   up.restart_backoff_max_s)

    def crashed(self, now: float) -> float | None:
        """Record a crash at `now`: the wait before restarting, or None when it is one crash
        more than `max_restarts` within the window."""
        self.crashes = [t for t in self.crashes if t > now - self.window_s] + [now]
        if len(self.crashes) > self.max_restarts:
            return None
        return min(self.backoff_max_s, self.backoff_s * 2 ** (len(self.crashes) - 1))


@dataclass
class Proc:
    name: str  # "rollout", "rollout-1", "gateway", ...: its log, port file and pid key
    popen: subprocess.Popen | None  # None until first spawned
    log_path: Path
    port: int = 0
    service: str = ""  # its package under services/; "" means `name`
    sets: list[str] = field(default_factory=list)  # its own overrides: its storage, its ports
    restarts: RestartPolicy | None = None
    state: str = "running"  # | "waiting" (to be restarted at `due`) | "starting" (restarted)
    due: float = 0.0  # waiting: when to restart; starting: when to give up on it

    @property
    def kind(self) -> str:
        return self.service or self.name


@dataclass
class MeshInfo:
    """What a client needs to reach a running mesh (written to mesh.json)."""

    run_dir: str
    nats_url: str
    endpoints: dict[str, str | list[str]]
    """Each service's address; a list for the replicated ones (`REPLICATED`)."""
    admin_token_file: str
    config_path: str | None = None
    pids: dict[str, int] = field(default_factory=dict)
    user_keys_file: str = ""
    """The gateway's API keys (`[security] user_tokens_file`), one `id:key` per line."""
    gateway_url: str = ""
    """The gateway's OpenAI-compatible base URL (`http://host:port/v1`), when it runs."""
    metrics: dict[str, str] = field(default_factory=dict)
    """Each process's Prometheus endpoint (`http://host:port/metrics`), by process name."""

    def admin_token(self) -> str:
        return Path(self.admin_token_file).read_text().strip()

    def user_key(self) -> str:
        """The first API key of the key file (what a local client such as a demo uses)."""
        for line in Path(self.user_keys_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                return line.split(":", 1)[1] if ":" in line else line
        raise ValueError(f"{self.user_keys_file} holds no key")

    @classmethod
    def load(cls, run_dir: str | Path) -> "MeshInfo":
        path = Path(run_dir) / MESH_FILE
        if not path.exists():
            raise FileNotFoundError(f"no running mesh at {run_dir} (start one with `hotloop up`)")
        return cls(**json.loads(path.read_text()))

    def apply(self, mesh: MeshConfig) -> MeshConfig:
        """`mesh` pointed at this running mesh: its NATS, admin token, run directory, user key
        file and endpoints (what a job in this process needs; typed, no environment)."""
        security = {"admin_token": self.admin_token()}
        if self.user_keys_file:
            security["user_tokens_file"] = self.user_keys_file
        # validated, so that a mesh.json of any age gives the types the config has
        endpoints = hconfig.Endpoints.model_validate({**mesh.endpoints.model_dump(), **self.endpoints})
        return mesh.model_copy(update={
            "nats": mesh.nats.model_copy(update={"url": self.nats_url}),
            "security": mesh.security.model_copy(update=security),
            "endpoints": endpoints,
            "run_dir": self.run_dir,
        })

    def env(self) -> dict[str, str]:
        """Environment overrides that point a service process this launcher starts at the
        mesh (a process's own config sources; jobs in this process use `apply`)."""
        e = {
            "HOTLOOP__NATS__URL": self.nats_url,
            "HOTLOOP__SECURITY__ADMIN_TOKEN": self.admin_token(),
            "HOTLOOP__RUN_DIR": self.run_dir,
        }
        if self.user_keys_file:
            e["HOTLOOP__SECURITY__USER_TOKENS_FILE"] = self.user_keys_file
        for name, addr in self.endpoints.items():
            e[f"HOTLOOP__ENDPOINTS__{name.upper()}"] = json.dumps(addr) if isinstance(addr, list) else addr
        return e


def available(name: str) -> bool:
    """Whether `services/<name>` exists as a runnable service in this checkout."""
    import importlib.util

    return importlib.util.find_spec(f"services.{name}.__main__") is not None


class Mesh:
    def __init__(self, mesh_cfg: MeshConfig, config_path: str | None, overrides: list[str],
                 services: list[str], quiet: bool = False, up: UpConfig | None = None,
                 rollout: RolloutConfig | None = None):
        """`up`, `rollout`: those sections; None reads them from `config_path` and `overrides`."""
        unknown = set(services) - set(ALL_SERVICES) - set(OPT_IN_SERVICES)
        if unknown:
            raise ValueError(f"unknown services {sorted(unknown)}; known: {ALL_SERVICES + OPT_IN_SERVICES}")
        unbuilt = [s for s in services if not available(s)]
        if unbuilt:
            raise ValueError(f"services {unbuilt} are not implemented yet (their protos exist); "
                             f"available: {[s for s in ALL_SERVICES if available(s)]}")
        if up is None or rollout is None:
            _, loaded = hconfig.load_sections(hconfig.raw_config(config_path, overrides),
                                              {"up": UpConfig, "rollout": RolloutConfig}, only_known=False)
            up, rollout = up or loaded["up"], rollout or loaded["rollout"]
        self.up = up
        self._check_ports(config_path, overrides, rollout)
        if mesh_cfg.nats.replicas > self.up.nats_servers:
            raise ValueError(f"nats.replicas = {mesh_cfg.nats.replicas} needs as many NATS servers; "
                             f"set up.nats_servers = {mesh_cfg.nats.replicas} (now {self.up.nats_servers})")
        self._rollout_storage = rollout.storage_dir
        self.cfg = mesh_cfg
        self.config_path = config_path
        self.overrides = overrides
        self.services = [s for s in ALL_SERVICES + OPT_IN_SERVICES if s in services]
        self.run_dir = Path(mesh_cfg.run_dir).resolve()
        self.procs: list[Proc] = []
        self.nats: NatsServer | NatsCluster | None = None
        self._nats_restarts = RestartPolicy.of(self.up)  # one policy for all of a cluster's servers
        self._nats_due: dict[Path, float] = {}  # store dir -> when that server is to be restarted
        self.info: MeshInfo | None = None
        self.quiet = quiet
        self._stopping = False

    def _check_ports(self, config_path: str | None, overrides: list[str], rollout: RolloutConfig) -> None:
        """Replicas of one service need a port each (and a metrics port each): a fixed one in
        the service's section would be every replica's."""
        several = [s for s in REPLICATED if getattr(self.up.replicas, s) > 1]
        sections = {"rollout": rollout}
        if set(several) - {"rollout"}:
            from services.reference.__main__ import ReferenceServiceConfig
            from services.reward.config import RewardConfig

            _, loaded = hconfig.load_sections(hconfig.raw_config(config_path, overrides),
                                              {"reward": RewardConfig, "reference": ReferenceServiceConfig},
                                              only_known=False)
            sections |= loaded
        for service in several:
            for key in ("port", "metrics_port"):
                value = getattr(sections[service], key)
                if value > 0:
                    raise ValueError(f"{service}.{key} = {value} gives every replica one port; with "
                                     f"up.replicas.{service} = {getattr(self.up.replicas, service)} "
                                     f"leave it 0")

    def say(self, msg: str) -> None:
        if not self.quiet:
            print(f"[hotloop up] {msg}", flush=True)

    def start(self, timeout_s: float | None = None) -> MeshInfo:
        """Start everything; raises (after stopping what started) if anything fails to come up
        within `timeout_s` (None: `[up] start_timeout_s`)."""
        timeout_s = self.up.start_timeout_s if timeout_s is None else timeout_s
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "ports").mkdir(parents=True, exist_ok=True)
        token_file = self.run_dir / "admin-token"
        if not token_file.exists():
            token_file.write_text(secrets.token_hex(24))
        token_file.chmod(0o600)
        if self.up.nats_servers > 1:
            self.nats = NatsCluster(self.run_dir / "nats", self.up.nats_servers,
                                    self.run_dir / "logs").start(preexec_fn=die_with_parent)
            self.say(f"NATS JetStream cluster of {self.up.nats_servers} on {self.nats.url}")
        else:
            self.nats = NatsServer(self.run_dir / "nats", self.run_dir / "logs" / "nats.log").start(
                preexec_fn=die_with_parent)
            self.say(f"nats-server (JetStream) on {self.nats.url}")
        self.info = MeshInfo(str(self.run_dir), self.nats.url, {}, str(token_file), self.config_path,
                             user_keys_file=self._user_keys_file())
        try:
            # reference, reward and rollout do not need each other: start them together
            first = [s for s in self.services if s not in ("gateway", "trainer")]
            self._start_batch(first, timeout_s)
            if "gateway" in self.services:
                self._start_batch(["gateway"], timeout_s)
            if "trainer" in self.services:
                self._start_batch(["trainer"], timeout_s)
        except BaseException:
            self.stop()
            raise
        self._write_info()
        return self.info

    def _user_keys_file(self) -> str:
        """The configured key file, else one generated in the run directory (mode 0600, kept
        across restarts like the admin token) so the gateway never starts without keys."""
        if self.cfg.security.user_tokens_file or "gateway" not in self.services:
            return self.cfg.security.user_tokens_file
        path = self.run_dir / "user-keys"
        if not path.exists():
            path.touch(mode=0o600)
            path.write_text(f"local:sk-hotloop-{secrets.token_hex(24)}\n")
        path.chmod(0o600)
        return str(path)

    def _write_info(self) -> None:
        """mesh.json, replaced atomically: a client reading it meanwhile sees all of one."""
        self.info.pids = {p.name: p.popen.pid for p in self.procs}
        path = self.run_dir / MESH_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.info.__dict__, indent=2))
        tmp.rename(path)

    def _port_file(self, proc: Proc) -> Path:
        return self.run_dir / "ports" / f"{proc.name}.json"

    def _http_port_file(self) -> Path:
        return self.run_dir / "ports" / "gateway-http.json"

    def _new_procs(self, service: str) -> list[Proc]:
        count = getattr(self.up.replicas, service) if service in REPLICATED else 1
        procs = []
        for i in range(count):
            name = service if i == 0 else f"{service}-{i}"
            sets = []
            if service == "rollout" and count > 1:
                # each replica empties its adapter directory at start: one directory each
                storage = Path(self._rollout_storage or self.run_dir) / name / "adapters"
                sets.append(f"rollout.storage_dir={storage}")
            procs.append(Proc(name, None, self.run_dir / "logs" / f"{name}.log", service=service,
                              sets=sets, restarts=RestartPolicy.of(self.up)))
        return procs

    def _spawn(self, proc: Proc) -> None:
        """Start `proc`'s process, with the endpoints as they are now."""
        port_file = self._port_file(proc)
        port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", f"services.{proc.kind}", "--port-file", str(port_file)]
        if self.config_path:
            cmd += ["--config", self.config_path]
        for o in self.overrides:
            cmd += ["--set", o]
        if proc.kind == "gateway":  # its HTTP port, for mesh.json
            self._http_port_file().unlink(missing_ok=True)
            cmd += ["--set", f"gateway.http_port_file={self._http_port_file()}"]
        for o in proc.sets:
            cmd += ["--set", o]
        env = {**os.environ, **self.info.env(), "PYTHONUNBUFFERED": "1"}
        with open(proc.log_path, "ab") as log:
            proc.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True, preexec_fn=die_with_parent)

    def _listening_port(self, proc: Proc) -> int | None:
        """The port `proc` wrote once serving, or None while it has not."""
        path = self._port_file(proc)
        return json.loads(path.read_text())["port"] if path.exists() else None

    def _start_batch(self, names: list[str], timeout_s: float) -> None:
        started = []
        for name in names:
            for proc in self._new_procs(name):
                self._spawn(proc)
                self.procs.append(proc)
                started.append(proc)
                self.say(f"starting {proc.name} (log: {proc.log_path})")
        deadline = time.monotonic() + timeout_s
        for proc in started:
            while (port := self._listening_port(proc)) is None:
                if proc.popen.poll() is not None:
                    raise RuntimeError(
                        f"{proc.name} exited with code {proc.popen.returncode} during start-up; "
                        f"last lines of {proc.log_path}:\n{tail_log(proc.log_path)}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{proc.name} did not start within {timeout_s:.0f}s; see {proc.log_path}")
                time.sleep(0.2)
            proc.port = port
            from hotloop.grpcutil import wait_healthy

            asyncio.run(wait_healthy(f"127.0.0.1:{proc.port}", max(5.0, deadline - time.monotonic())))
            addr = f"127.0.0.1:{proc.port}"
            # a restart listens where this one does, its metrics too (a scraper keeps its target)
            proc.sets.append(f"{PORT_KEYS[proc.kind]}={proc.port}")
            metrics_port = json.loads(self._port_file(proc).read_text()).get("metrics_port")
            if metrics_port:
                section = PORT_KEYS[proc.kind].split(".")[0]
                proc.sets.append(f"{section}.metrics_port={metrics_port}")
                self.info.metrics[proc.name] = f"http://127.0.0.1:{metrics_port}/metrics"
            if proc.kind in REPLICATED:
                self.info.endpoints.setdefault(proc.kind, []).append(addr)  # in replica order
            else:
                self.info.endpoints[proc.kind] = addr
            if proc.kind == "gateway":
                # written before the gRPC port file, so it is there by now
                http = json.loads(self._http_port_file().read_text())["port"]
                proc.sets.append(f"gateway.http_port={http}")
                self.info.gateway_url = f"http://127.0.0.1:{http}/v1"
                self.say(f"gateway HTTP (OpenAI-compatible) on {self.info.gateway_url}")
            self.say(f"{proc.name} healthy on {addr}")

    # ---- supervision -------------------------------------------------------------------
    def poll(self, now: float | None = None) -> str | None:
        """One round of supervision: note crashes, restart what is due, see restarted
        processes listen. Returns why the mesh must stop, else None. Not thread-safe with
        `stop`: call `stop` only once whoever polls has stopped."""
        if self._stopping or self.info is None:
            return None
        now = time.monotonic() if now is None else now
        if (why := self._poll_nats(now)) is not None:
            return why
        for proc in self.procs:
            if (why := self._poll_proc(proc, now)) is not None:
                return why
        return None

    def _poll_proc(self, proc: Proc, now: float) -> str | None:
        if proc.state == "waiting":
            if now >= proc.due:
                self._spawn(proc)
                proc.state, proc.due = "starting", now + self.up.start_timeout_s
                self.say(f"restarting {proc.name} on port {proc.port} (log: {proc.log_path})")
            return None
        code = proc.popen.poll()
        if code is None:
            if proc.state == "starting":
                port = self._listening_port(proc)
                if port is not None:
                    proc.state = "running"
                    if port != proc.port:  # a service config that ignores the port it is given
                        self._moved(proc, port)
                    self._write_info()
                    self.say(f"{proc.name} is back on 127.0.0.1:{port} (pid {proc.popen.pid})")
                elif now > proc.due:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                    proc.popen.wait()
                    return self._crashed(proc, now, f"did not listen within "
                                                    f"{self.up.start_timeout_s:.0f}s of its restart")
            return None
        how = "exited during its restart" if proc.state == "starting" else "died"
        return self._crashed(proc, now, f"{how} with exit code {code}")

    def _moved(self, proc: Proc, port: int) -> None:
        old, new = f"127.0.0.1:{proc.port}", f"127.0.0.1:{port}"
        if proc.kind in REPLICATED:
            eps = self.info.endpoints[proc.kind]
            eps[eps.index(old)] = new
        else:
            self.info.endpoints[proc.kind] = new
        proc.port = port
        self.say(f"{proc.name} moved from {old} to {new}: processes started before this one "
                 f"still look for it at {old}")

    def _crash(self, restarts: RestartPolicy, now: float, what: str,
               log_path: Path) -> tuple[float | None, str]:
        """Record a crash of a service or of NATS: (the wait before restarting it, its log's
        last lines), or (None, why the mesh must stop) past `[up] max_restarts`."""
        wait = restarts.crashed(now)
        tail = f"Last lines of {log_path}:\n{tail_log(log_path, 12)}"
        if wait is None:
            return None, (f"{what}: {len(restarts.crashes)} crashes within "
                          f"{self.up.restart_window_s:g}s, more than up.max_restarts = "
                          f"{self.up.max_restarts}; stopping the mesh. {tail}")
        return wait, tail

    def _crashed(self, proc: Proc, now: float, what: str) -> str | None:
        wait, tail = self._crash(proc.restarts, now, f"{proc.name} {what}", proc.log_path)
        if wait is None:
            return tail
        proc.state, proc.due = "waiting", now + wait
        self.say(f"{proc.name} {what}; restarting it in {wait:.1f}s (crash "
                 f"{len(proc.restarts.crashes)} of {self.up.max_restarts} allowed within "
                 f"{self.up.restart_window_s:g}s); the others keep running. {tail}")
        return None

    def _poll_nats(self, now: float) -> str | None:
        if self.nats is None:
            return None
        servers = self.nats.members if isinstance(self.nats, NatsCluster) else [self.nats]
        for server in servers:
            if (why := self._poll_nats_server(server, now)) is not None:
                return why
        return None

    def _poll_nats_server(self, server: NatsServer, now: float) -> str | None:
        name = f"nats-server {server.name}" if server.name else "nats-server"
        due = self._nats_due.get(server.store_dir)
        if due is None:
            if server.proc.poll() is None:
                return None
            what = f"{name} died with exit code {server.proc.returncode}"
        elif now < due:
            return None
        else:
            try:  # on the same port and store: clients reconnect; streams and KV survive
                server.restart(preexec_fn=die_with_parent)
            except (RuntimeError, TimeoutError) as e:
                what = f"{name} did not restart ({e})"
            else:
                del self._nats_due[server.store_dir]
                self.say(f"{name} is back on {server.url}")
                return None
        wait, tail = self._crash(self._nats_restarts, now, what, server.log_path)
        if wait is None:
            return tail
        self._nats_due[server.store_dir] = now + wait
        self.say(f"{what}; restarting it in {wait:.1f}s on the same port and store. {tail}")
        return None

    def supervise(self, stop: threading.Event | None = None, interval_s: float = 0.5) -> int:
        """`poll` until `stop` is set (0) or the mesh must stop (1, after saying why). Does not
        stop the mesh itself."""
        stop = stop or threading.Event()
        while not stop.is_set():
            why = self.poll()
            if why is not None:
                self.say(why)
                return 1
            stop.wait(interval_s)
        return 0

    def watch(self) -> int:
        """Supervise until Ctrl-C/SIGTERM (exit 0) or until the mesh cannot be kept up (exit
        1); then stop everything."""
        stop = threading.Event()

        def _handler(signum, frame):
            stop.set()

        old = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = self.supervise(stop)
            if code == 0:
                self.say("stopping")
            return code
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.stop()

    def stop(self, grace_s: float = 30.0) -> None:
        self._stopping = True
        for p in reversed(self.procs):
            if p.popen is not None and p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in reversed(self.procs):
            if p.popen is None:
                continue
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{p.name} did not stop within {grace_s:.0f}s; killing it")
                os.killpg(p.popen.pid, signal.SIGKILL)
                p.popen.wait()
        self.procs.clear()
        if self.nats:
            self.nats.stop()
            self.nats = None
        (self.run_dir / MESH_FILE).unlink(missing_ok=True)

    def __enter__(self) -> "Mesh":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def find_target(run_dir: str | Path) -> Target:
    """The gateway URL and the first user key of a mesh started by `hotloop up`."""
    info = MeshInfo.load(run_dir)
    if not info.gateway_url:
        raise LookupError(f"the mesh at {run_dir} runs no gateway (start it with the gateway service)")
    return Target(info.gateway_url.rstrip("/").removesuffix("/v1"), info.user_key())
