"""A mistake in a config file or a `--set` is said plainly: every problem at once, with its
source, section and key, exit status 2, no traceback; before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def hotloop(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apps.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def test_a_typo_in_a_set_is_one_clear_line_and_exit_2(tmp_path):
    r = hotloop("train", "grpo", "--config", "configs/demo.toml", "--set", "grpo.lerning_rate=1",
                "--run-dir", str(tmp_path))
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr
    assert "--set grpo.lerning_rate=1: [grpo] lerning_rate: unknown key" in r.stderr


def test_up_reports_every_problem_of_the_file_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        f"run_dir = \"{tmp_path / 'run'}\"\n"
        "[model]\ndtype = \"float16\"\n"        # not a dtype hotloop supports
        "[trainer]\ndtype = \"float32\"\n"      # declared once, in [model]
        "[rolout]\nport = 1\n"                  # a section's typo
        "[reward]\nconcurency = 3\n"            # a key's typo
    )
    r = hotloop("up", "--config", str(bad), "--set", "gateway.port=notaport")
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr
    err = r.stderr
    assert "5 configuration errors" in err, err
    assert f"{bad}: [model] dtype: Input should be 'auto', 'bfloat16' or 'float32'" in err
    assert f"{bad}: [trainer] dtype: declared once, as model.dtype" in err
    assert f"{bad}: unknown section 'rolout'; did you mean [rollout]?" in err
    assert f"{bad}: [reward] concurency: unknown key; did you mean 'concurrency'?" in err
    assert "--set gateway.port=notaport: [gateway] port:" in err
    assert not (tmp_path / "run").exists()  # nothing started: no run directory, no NATS


def test_a_missing_file_and_a_malformed_set_are_named(tmp_path):
    r = hotloop("up", "--config", str(tmp_path / "nope.toml"), "--set", "model.name")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{tmp_path / 'nope.toml'}: the config file does not exist" in r.stderr
    assert "--set model.name: an override is key=value" in r.stderr


def test_a_service_process_says_its_problems_and_exits_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "services.reward", "--set", "reward.concurency=3",
                        "--set", "reward.port=-5"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr
    assert "2 configuration errors" in r.stderr
    assert "[reward] concurency: unknown key; did you mean 'concurrency'?" in r.stderr
