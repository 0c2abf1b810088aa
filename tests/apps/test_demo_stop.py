"""`hotloop demo` stops when asked: SIGTERM mid-run ends the process within seconds, leaves a
checkpoint and a resume line, and takes the mesh (services, NATS, vLLM engines) down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_sigterm_stops_the_demo_with_a_checkpoint_and_a_resume_line(tiny_model, tmp_path):
    import psutil

    cfg = tmp_path / "demo.toml"
    cfg.write_text(f"""
run_dir = "{tmp_path / 'run'}"
[model]
name = "{tiny_model}"
max_model_len = 512
[rollout]
kv_cache_gib = 1
[grpo]
eval_limit = 2
out_dir = "{tmp_path / 'runs'}"
skip_uniform_groups = false
[trainer]
batch_prompts = 2
group_size = 4
max_new_tokens = 16
num_steps = 1000
checkpoint_interval = 1000
torch_threads = 1
""")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "demo", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        runs = tmp_path / "runs"
        deadline = time.monotonic() + 240
        # wait until two steps are done, so the signal lands in the middle of training
        while time.monotonic() < deadline:
            metrics = list(runs.glob("*/metrics.jsonl"))
            if metrics and metrics[0].read_text().count('"step"') >= 2:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        else:
            pytest.fail("the demo did not get through two steps in time")
        family = _descendants(proc.pid)
        assert any("services.rollout" in " ".join(p.cmdline()) for p in family)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"stopped in {took:.1f}s")
    assert proc.returncode == 130, out
    assert took < 20, f"took {took:.1f}s to stop"
    assert "Resume with" in out and "--set grpo.run_id=" in out, out
    run_id = out.split("--set grpo.run_id=")[1].split()[0]
    ckpts = list((runs / run_id / "checkpoints").glob("step-*"))
    assert ckpts, "no checkpoint written on interrupt"
    time.sleep(2)
    alive = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.cmdline() for p in alive]
