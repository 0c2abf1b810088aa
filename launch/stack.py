"""The online stack: a mesh with the gateway and the online trainer, started together and
stopped together on every exit (`hotloop demo-online`, `hotloop demo-tenants`, `hotloop bench
update-loop` run on it).

Owns: which services the stack starts (the reference only with kl_beta > 0 and `[online]
reference = "service"`; the trainer as the mesh's role where it is built, else as `hotloop
train online` processes beside the mesh, one per lineage when asked), where their files go
(`<out>/mesh`, `<out>/trainer`), and stopping it all, reporting a process that had failed on
its own. Does not own: the mesh's processes (`launch.mesh`), the users (`measure.users`), what
the demos measure on it.
"""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from launch.processes import die_with_parent, hotloop_command, stop_process, tail_log
from measure.users import Target

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "online.toml"
TRAINER_RUN = "trainer"  # the trainer's metrics and checkpoints: runs/<id>/trainer/
TRAINER_STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL for a `hotloop train online` subprocess


@dataclass
class Stack:
    """A running mesh plus the `hotloop train online` processes started beside it (none where
    the mesh runs the trainer role)."""

    mesh: object  # launch.mesh.Mesh
    trainers: dict[str, subprocess.Popen]  # name -> process; its log: mesh/logs/<name>.log
    out: Path  # runs/<id>
    target: Target

    @property
    def info(self):
        return self.mesh.info

    @property
    def metrics_path(self) -> Path:
        return self.out / TRAINER_RUN / "metrics.jsonl"

    def _procs(self) -> list[tuple[str, subprocess.Popen, Path]]:
        procs = [(p.name, p.popen, p.log_path) for p in self.mesh.procs]
        return procs + [(name, popen, self.out / "mesh" / "logs" / f"{name}.log")
                        for name, popen in self.trainers.items()]

    def dead(self) -> str | None:
        """Which process of the stack died, with its log's last lines; None while all run."""
        for name, popen, log_path in self._procs():
            if popen.poll() is not None:
                return (f"{name} died with exit code {popen.returncode}; last lines of {log_path}:\n"
                        f"{tail_log(log_path, 8)}")
        return None

    def stop(self) -> str | None:
        """Stop everything; returns why a process had failed on its own (it can report a
        fatal error and still be shutting down when the demo ends), else None."""
        procs = self._procs()
        for popen in self.trainers.values():  # all at once: each checkpoints meanwhile
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
        for popen in self.trainers.values():
            stop_process(popen, TRAINER_STOP_GRACE_S)
        self.mesh.stop()
        # A process that failed exits 1 (`hotloop.service`); a negative code is a signal, and
        # a SIGKILL here is the launcher's own, after its grace period (it says so itself).
        # `hotloop train online` stopped by its SIGTERM exits 130 (the CLI's "interrupted").
        for name, popen, log_path in procs:
            code = popen.returncode
            if code is not None and code > 0 and not (name in self.trainers and code == 130):
                return f"{name} exited with code {code}; last lines of {log_path}:\n{tail_log(log_path, 8)}"
        return None


def start_stack(config_path: str, overrides: list[str], out: Path, quiet: bool = False,
                trainers: dict[str, list[str]] | None = None) -> Stack:
    """Start NATS, the rollout, the gateway, the reference (only with kl_beta > 0 and
    `[online] reference = "service"`) and the online trainer, with the mesh's files under
    `out/mesh` and the trainer's under `out/trainer` (`online.run_id`). `trainers`: name ->
    overrides of its own, one `hotloop train online` process each beside the mesh (its run
    id, its tenant); None: one trainer, the mesh's trainer role where it is built, else such
    a process. Raises if any of them does not come up (and stops what did)."""
    from launch import sections
    from launch.mesh import Mesh, available, find_target

    out = out.resolve()
    overrides = [*overrides, f"run_dir={out / 'mesh'}", f"online.out_dir={out}",
                 f"online.run_id={TRAINER_RUN}"]
    for own in (trainers or {}).values():  # every trainer's sections checked before anything starts
        sections.load(config_path, [*overrides, *own])
    loaded = sections.load(config_path, overrides)
    # the KL's reference: a service of the mesh, unless the trainer computes it itself
    service_ref = loaded["trainer"].loss.kl_beta > 0 and loaded["online"].reference == "service"
    role = trainers is None and available("trainer")
    if trainers is None and not role:
        trainers = {"trainer": []}
    services = ["rollout", "gateway"] + (["reference"] if service_ref else []) + (["trainer"] if role else [])
    mesh = Mesh(loaded.mesh, config_path, overrides, services, quiet=quiet, up=loaded["up"],
                rollout=loaded["rollout"])
    mesh.start()
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, own in (trainers or {}).items():
            cmd = [*hotloop_command(), "train", "online", "--config", config_path,
                   "--run-dir", str(out / "mesh")] + [a for o in [*overrides, *own] for a in ("--set", o)]
            with open(out / "mesh" / "logs" / f"{name}.log", "ab") as f:
                procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                               start_new_session=True, preexec_fn=die_with_parent)
        return Stack(mesh, procs, out, find_target(out / "mesh"))
    except BaseException:
        for popen in procs.values():
            popen.kill()
        mesh.stop()
        raise
