"""`hotloop up`'s launcher with real processes: the reward service (no model needed) and NATS."""

import os
import signal

import pytest

from hotloop import config
from hotloop.launcher import Mesh, MeshInfo


def test_up_reports_a_dead_service_and_stops_everything(tmp_path, capsys):
    cfg = config.load_mesh(config.raw_config(None, [f"run_dir={tmp_path}"], environ={}))
    mesh = Mesh(cfg, None, [f"run_dir={tmp_path}"], ["reward"])
    info = mesh.start(timeout_s=120)
    assert MeshInfo.load(tmp_path).endpoints["reward"] == info.endpoints["reward"]
    assert oct((tmp_path / "admin-token").stat().st_mode & 0o777) == "0o600"
    nats_proc = mesh.nats.proc
    reward_pid = info.pids["reward"]
    os.kill(reward_pid, signal.SIGKILL)
    assert mesh.watch() == 1
    out = capsys.readouterr().out
    assert "reward died with exit code -9" in out
    assert nats_proc.poll() is not None, "nats-server was left running"
    assert not (tmp_path / "mesh.json").exists()


def test_unknown_service_is_refused(tmp_path):
    cfg = config.load_mesh(config.raw_config(None, [], environ={}))
    with pytest.raises(ValueError, match="unknown services"):
        Mesh(cfg, None, [], ["nope"])
    with pytest.raises(ValueError, match="unknown services"):
        Mesh(cfg, None, [], ["reward", "gateway", "trainer-x"])


def test_services_die_with_a_killed_launcher(tmp_path):
    """SIGKILL of the process running the launcher must not orphan the services."""
    import subprocess
    import sys
    import time

    code = (
        "from hotloop import config\n"
        "from hotloop.launcher import Mesh\n"
        f"cfg = config.load_mesh(config.raw_config(None, ['run_dir={tmp_path}'], environ={{}}))\n"
        f"m = Mesh(cfg, None, ['run_dir={tmp_path}'], ['reward'], quiet=True)\n"
        "info = m.start(timeout_s=120)\n"
        "print(info.pids['reward'], flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    reward_pid = int(parent.stdout.readline())
    os.kill(reward_pid, 0)  # alive
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(reward_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(reward_pid, signal.SIGKILL)
    pytest.fail("the reward service outlived its killed launcher")
