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
