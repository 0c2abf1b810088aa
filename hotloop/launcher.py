"""`hotloop up`: a whole mesh on one machine, as local processes on loopback.

Owns: starting a NATS server (JetStream, store under the run directory), generating the admin
token and the gateway's user API key file, starting each service as `python -m services.<name>`
with its log file, waiting until each is healthy, writing `<run_dir>/mesh.json` (how clients
find the mesh, including the gateway's HTTP URL), and stopping
everything in order on Ctrl-C or when one process dies (saying which and why).
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
import time
from dataclasses import dataclass, field
from pathlib import Path

from hotloop.config import MeshConfig
from hotloop.natsserver import NatsServer

# Start order: the trainer job and the gateway need the others' endpoints.
ALL_SERVICES = ["reference", "reward", "rollout", "gateway"]
# Started only when named (`--services ...,trainer`), last: the online trainer learns from the
# gateway's feedback and pushes to the rollout replicas.
OPT_IN_SERVICES = ["trainer"]
MESH_FILE = "mesh.json"


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    port: int = 0


@dataclass
class MeshInfo:
    """What a client needs to reach a running mesh (written to mesh.json)."""

    run_dir: str
    nats_url: str
    endpoints: dict[str, str | list[str]]
    admin_token_file: str
    config_path: str | None = None
    pids: dict[str, int] = field(default_factory=dict)
    user_keys_file: str = ""
    """The gateway's API keys (`[security] user_tokens_file`), one `id:key` per line."""
    gateway_url: str = ""
    """The gateway's OpenAI-compatible base URL (`http://host:port/v1`), when it runs."""

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

    def env(self) -> dict[str, str]:
        """Environment overrides that point a process at this mesh."""
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


def die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, even by SIGKILL, so a
    killed `hotloop up` or demo never leaves services (and their vLLM engines) running.
    Services run in their own session so that Ctrl-C reaches only the launcher, which stops
    them in order."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not glibc Linux: the launcher's own stop() remains the only guard
        pass


def tail_log(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Mesh:
    def __init__(self, mesh_cfg: MeshConfig, config_path: str | None, overrides: list[str],
                 services: list[str], quiet: bool = False):
        unknown = set(services) - set(ALL_SERVICES) - set(OPT_IN_SERVICES)
        if unknown:
            raise ValueError(f"unknown services {sorted(unknown)}; known: {ALL_SERVICES + OPT_IN_SERVICES}")
        unbuilt = [s for s in services if not available(s)]
        if unbuilt:
            raise ValueError(f"services {unbuilt} are not implemented yet (their protos exist); "
                             f"available: {[s for s in ALL_SERVICES if available(s)]}")
        self.cfg = mesh_cfg
        self.config_path = config_path
        self.overrides = overrides
        self.services = [s for s in ALL_SERVICES + OPT_IN_SERVICES if s in services]
        self.run_dir = Path(mesh_cfg.run_dir).resolve()
        self.procs: list[Proc] = []
        self.nats: NatsServer | None = None
        self.info: MeshInfo | None = None
        self.quiet = quiet

    def say(self, msg: str) -> None:
        if not self.quiet:
            print(f"[hotloop up] {msg}", flush=True)

    def start(self, timeout_s: float = 300.0) -> MeshInfo:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "ports").mkdir(parents=True, exist_ok=True)
        token_file = self.run_dir / "admin-token"
        if not token_file.exists():
            token_file.write_text(secrets.token_hex(24))
        token_file.chmod(0o600)
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
        self.info.pids = {p.name: p.popen.pid for p in self.procs}
        (self.run_dir / MESH_FILE).write_text(json.dumps(self.info.__dict__, indent=2))
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

    def _start_batch(self, names: list[str], timeout_s: float) -> None:
        started = []
        for name in names:
            port_file = self.run_dir / "ports" / f"{name}.json"
            port_file.unlink(missing_ok=True)
            log_path = self.run_dir / "logs" / f"{name}.log"
            cmd = [sys.executable, "-m", f"services.{name}", "--port-file", str(port_file)]
            if self.config_path:
                cmd += ["--config", self.config_path]
            for o in self.overrides:
                cmd += ["--set", o]
            if name == "gateway":  # its HTTP port, for mesh.json
                http_port_file = self.run_dir / "ports" / "gateway-http.json"
                http_port_file.unlink(missing_ok=True)
                cmd += ["--set", f"gateway.http_port_file={http_port_file}"]
            env = {**os.environ, **self.info.env(), "PYTHONUNBUFFERED": "1"}
            with open(log_path, "ab") as log:
                popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, preexec_fn=die_with_parent)
            proc = Proc(name, popen, log_path)
            self.procs.append(proc)
            started.append((proc, port_file))
            self.say(f"starting {name} (log: {log_path})")
        deadline = time.monotonic() + timeout_s
        for proc, port_file in started:
            while not port_file.exists():
                if proc.popen.poll() is not None:
                    raise RuntimeError(
                        f"{proc.name} exited with code {proc.popen.returncode} during start-up; "
                        f"last lines of {proc.log_path}:\n{tail_log(proc.log_path)}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{proc.name} did not start within {timeout_s:.0f}s; see {proc.log_path}")
                time.sleep(0.2)
            proc.port = json.loads(port_file.read_text())["port"]
            from hotloop.grpcutil import wait_healthy

            asyncio.run(wait_healthy(f"127.0.0.1:{proc.port}", max(5.0, deadline - time.monotonic())))
            addr = f"127.0.0.1:{proc.port}"
            self.info.endpoints[proc.name] = [addr] if proc.name == "rollout" else addr
            if proc.name == "gateway":
                # written before the gRPC port file, so it is there by now
                http = json.loads((self.run_dir / "ports" / "gateway-http.json").read_text())["port"]
                self.info.gateway_url = f"http://127.0.0.1:{http}/v1"
                self.say(f"gateway HTTP (OpenAI-compatible) on {self.info.gateway_url}")
            self.say(f"{proc.name} healthy on {addr}")

    def watch(self) -> int:
        """Block until Ctrl-C/SIGTERM (exit 0) or until a process dies (exit 1)."""
        stop = {"flag": False}

        def _handler(signum, frame):
            stop["flag"] = True

        old = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not stop["flag"]:
                for p in self.procs:
                    if p.popen.poll() is not None:
                        self.say(f"{p.name} died with exit code {p.popen.returncode}; stopping the "
                                 f"mesh. Last lines of {p.log_path}:\n{tail_log(p.log_path)}")
                        return 1
                if self.nats and self.nats.proc.poll() is not None:
                    self.say("nats-server died; stopping the mesh")
                    return 1
                time.sleep(0.5)
            self.say("stopping")
            return 0
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.stop()

    def stop(self, grace_s: float = 30.0) -> None:
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in reversed(self.procs):
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
