"""`hotloop up`'s launcher with real processes: the reward service (no model needed), the
reference (the tiny model) and NATS; the restart policy on its own with an explicit clock."""

import asyncio
import json
import os
import signal
import time

import pytest

from hotloop import config
from hotloop.grpcutil import wait_healthy
from launch.mesh import Mesh, MeshInfo, RestartPolicy, UpConfig


def test_restart_policy_backs_off_and_gives_up_past_its_limit_within_the_window():
    p = RestartPolicy(max_restarts=3, window_s=100, backoff_s=1, backoff_max_s=3)
    assert [p.crashed(t) for t in (0, 1, 2)] == [1, 2, 3]  # doubling, capped
    assert p.crashed(3) is None  # the fourth crash within 100 s
    q = RestartPolicy(max_restarts=2, window_s=100, backoff_s=1, backoff_max_s=60)
    assert q.crashed(0) == 1 and q.crashed(50) == 2
    assert q.crashed(120) == 2  # the crash at 0 left the window: this is the 2nd in it
    assert q.crashed(200) == 2 and q.crashed(201) is None
    assert RestartPolicy(0, 100, 1, 60).crashed(0) is None  # max_restarts 0: no restart


def test_up_with_no_restarts_allowed_reports_a_dead_service_and_stops_everything(tmp_path, capsys):
    cfg = config.load_mesh(config.raw_config(None, [f"run_dir={tmp_path}"], environ={}))
    mesh = Mesh(cfg, None, [f"run_dir={tmp_path}"], ["reward"], up=UpConfig(max_restarts=0))
    info = mesh.start(timeout_s=120)
    assert MeshInfo.load(tmp_path).endpoints["reward"] == info.endpoints["reward"]
    assert oct((tmp_path / "admin-token").stat().st_mode & 0o777) == "0o600"
    nats_proc = mesh.nats.proc
    reward_pid = info.pids["reward"]
    os.kill(reward_pid, signal.SIGKILL)
    assert mesh.watch() == 1
    out = capsys.readouterr().out
    assert "reward died with exit code -9" in out and "more than up.max_restarts = 0" in out
    assert nats_proc.poll() is not None, "nats-server was left running"
    assert not (tmp_path / "mesh.json").exists()


def poll_until(mesh: Mesh, cond, what: str, timeout_s: float = 120.0) -> None:
    """Supervise (as `watch` does) until `cond()`; the mesh must not give up meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        why = mesh.poll()
        assert why is None, why
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.1)


def proc(mesh: Mesh, name: str):
    (p,) = [p for p in mesh.procs if p.name == name]
    return p


@pytest.mark.slow
def test_a_killed_service_is_restarted_on_its_port_while_the_others_keep_running(tmp_path, tiny_model):
    sets = [f"run_dir={tmp_path}", f"model.name={tiny_model}"]
    cfg = config.load_mesh(config.raw_config(None, sets, environ={}))
    up = UpConfig(max_restarts=1, restart_backoff_s=0.1, restart_window_s=3600)
    mesh = Mesh(cfg, None, sets, ["reference", "reward"], quiet=True, up=up)
    info = mesh.start(timeout_s=180)
    try:
        pids, endpoints, nats_pid = dict(info.pids), dict(info.endpoints), mesh.nats.proc.pid
        metrics = dict(info.metrics)
        assert set(metrics) == {"reward", "reference"}
        reward = proc(mesh, "reward")

        os.kill(pids["reward"], signal.SIGKILL)
        poll_until(mesh, lambda: reward.state == "running" and reward.popen.pid != pids["reward"],
                   "the reward service restarted")
        after = MeshInfo.load(tmp_path)
        assert after.pids["reward"] == reward.popen.pid != pids["reward"]
        assert after.pids["reference"] == pids["reference"] and mesh.nats.proc.pid == nats_pid
        assert after.endpoints == endpoints  # the same port again
        # and the same metrics endpoint, now served by the new process: a scraper keeps its target
        assert after.metrics == metrics
        served = json.loads((tmp_path / "ports" / "reward.json").read_text())
        assert (served["pid"], metrics["reward"]) == (
            reward.popen.pid, f"http://127.0.0.1:{served['metrics_port']}/metrics")
        asyncio.run(wait_healthy(endpoints["reward"][0], 30))

        os.kill(nats_pid, signal.SIGKILL)  # NATS too, on its port and store
        poll_until(mesh, lambda: mesh.nats.proc.pid != nats_pid and mesh.nats.proc.poll() is None,
                   "nats-server restarted")
        assert mesh.nats.url == info.nats_url
        assert {p.name: p.popen.pid for p in mesh.procs} == MeshInfo.load(tmp_path).pids
        assert proc(mesh, "reference").popen.pid == pids["reference"]

        os.kill(reward.popen.pid, signal.SIGKILL)  # its second crash in the window: one too many
        deadline = time.monotonic() + 30
        while (why := mesh.poll()) is None:
            assert time.monotonic() < deadline, "the mesh never gave up on the reward service"
            time.sleep(0.1)
        assert why.startswith("reward died with exit code -9: 2 crashes within 3600s, more than "
                              "up.max_restarts = 1; stopping the mesh.")
        assert f"Last lines of {reward.log_path}" in why
    finally:
        mesh.stop()
    assert not (tmp_path / "mesh.json").exists()


@pytest.mark.parametrize("service, key", [("rollout", "port"), ("reward", "port"),
                                          ("reference", "metrics_port")])
def test_replicas_need_a_port_each(tmp_path, service, key):
    sets = [f"run_dir={tmp_path}", f"{service}.{key}=50051"]
    cfg = config.load_mesh(config.raw_config(None, sets, environ={}))
    up = UpConfig.model_validate({"replicas": {service: 2}})
    with pytest.raises(ValueError, match=f"{service}.{key} = 50051 gives every replica one port; "
                                         f"with up.replicas.{service} = 2 leave it 0"):
        Mesh(cfg, None, sets, [service], up=up)
    Mesh(cfg, None, sets, [service], up=UpConfig())  # one process may have its port


def test_the_old_rollout_replicas_key_still_counts_and_may_not_contradict_the_new_one():
    assert UpConfig(rollout_replicas=3).replicas.rollout == 3
    assert UpConfig.model_validate({"rollout_replicas": 2, "replicas": {"rollout": 2}}).replicas.rollout == 2
    tree = config.raw_config(None, ["up.rollout_replicas=2", "up.replicas.rollout=3"], environ={})
    with pytest.raises(config.ConfigError, match=r"\[up\]: Value error, rollout_replicas = 2 and "
                                                 r"replicas.rollout = 3 disagree"):
        config.load_section(tree, "up", UpConfig)


def test_replicas_on_the_command_line_are_up_replicas_overrides():
    from apps.cli import replica_overrides

    assert replica_overrides("rollout=2,reference=2, reward=3") == [
        "up.replicas.rollout=2", "up.replicas.reference=2", "up.replicas.reward=3"]
    assert replica_overrides(None) == []
    with pytest.raises(ValueError, match="'reward' is not SERVICE=N"):
        replica_overrides("rollout=2,reward")
    with pytest.raises(ValueError, match="'gateway' does not run as replicas; those that do: rollout, "
                                         "reference, reward"):
        replica_overrides("gateway=2")
    tree = config.raw_config(None, replica_overrides("reward=0"), environ={})
    with pytest.raises(config.ConfigError, match="replicas.reward: Input should be greater than or equal to 1"):
        config.load_section(tree, "up", UpConfig)


@pytest.mark.slow
def test_replicas_start_on_ports_of_their_own_and_restart_alone(tmp_path):
    sets = [f"run_dir={tmp_path}"]
    cfg = config.load_mesh(config.raw_config(None, sets, environ={}))
    up = UpConfig.model_validate({"replicas": {"reward": 2}, "restart_backoff_s": 0.1})
    mesh = Mesh(cfg, None, sets, ["reward"], quiet=True, up=up)
    info = mesh.start(timeout_s=120)
    try:
        saved, pids = MeshInfo.load(tmp_path), dict(info.pids)
        assert len(saved.endpoints["reward"]) == 2 and len(set(saved.endpoints["reward"])) == 2
        assert set(saved.pids) == {"reward", "reward-1"} and set(saved.metrics) == {"reward", "reward-1"}
        assert len(set(saved.metrics.values())) == 2
        for address in saved.endpoints["reward"]:
            asyncio.run(wait_healthy(address, 30))
        # a job sees both, as its typed config
        assert saved.apply(cfg).endpoints.reward == saved.endpoints["reward"]
        env = saved.env()["HOTLOOP__ENDPOINTS__REWARD"]
        assert json.loads(env) == saved.endpoints["reward"]

        second = proc(mesh, "reward-1")
        os.kill(pids["reward-1"], signal.SIGKILL)
        poll_until(mesh, lambda: second.state == "running" and second.popen.pid != pids["reward-1"],
                   "the second replica restarted")
        after = MeshInfo.load(tmp_path)
        assert after.endpoints == saved.endpoints and after.pids["reward"] == pids["reward"]
        assert after.pids["reward-1"] == second.popen.pid
        asyncio.run(wait_healthy(saved.endpoints["reward"][1], 30))
    finally:
        mesh.stop()


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
        "from launch.mesh import Mesh\n"
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


def test_nats_servers_and_replicas_must_fit(tmp_path):
    """A stream cannot have more copies than there are servers; an even cluster is refused."""
    three = [f"run_dir={tmp_path}", "nats.replicas=3"]
    cfg = config.load_mesh(config.raw_config(None, three, environ={}))
    with pytest.raises(ValueError, match="set up.nats_servers = 3"):
        Mesh(cfg, None, three, [], quiet=True)
    with pytest.raises(config.ConfigError, match=r"\[up\] nats_servers: .*use 1, 3 or 5"):
        Mesh(cfg, None, [*three, "up.nats_servers=2"], [], quiet=True)


@pytest.mark.slow
def test_up_starts_a_nats_cluster_and_restarts_a_killed_server_on_its_port(tmp_path):
    """`[up] nats_servers = 3`: the mesh's URL lists the three; streams get 3 replicas; a
    server killed is restarted on its port and store while the other two keep serving."""
    from hotloop.bus import Bus

    overrides = [f"run_dir={tmp_path}", "nats.replicas=3", "up.nats_servers=3"]
    cfg = config.load_mesh(config.raw_config(None, overrides, environ={}))
    mesh = Mesh(cfg, None, overrides, [], quiet=True)
    try:
        info = mesh.start(timeout_s=60)
        members = list(mesh.nats.members)
        assert info.nats_url == mesh.nats.url and len(info.nats_url.split(",")) == 3

        async def streams() -> int:
            bus = await Bus.connect(info.nats_url, "test", replicas=cfg.nats.replicas)
            try:
                await bus.ensure_streams()
                return (await bus.js.stream_info("FEEDBACK")).config.num_replicas
            finally:
                await bus.close()

        assert asyncio.run(streams()) == 3
        victim = mesh.nats.members[1]
        pid, port = victim.proc.pid, victim.port
        os.kill(pid, signal.SIGKILL)
        poll_until(mesh, lambda: victim.proc.pid != pid and victim.proc.poll() is None,
                   "the killed server restarted", timeout_s=60)
        assert victim.port == port and mesh.nats.url == info.nats_url
        mesh.nats.wait_healthy(30)  # it rejoined the cluster
        assert asyncio.run(streams()) == 3
    finally:
        mesh.stop()
    assert all(m.proc.poll() is not None for m in members), "a nats-server was left running"
