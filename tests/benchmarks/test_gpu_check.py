"""`scripts/gpu-check.sh` (benchmarks/gpu_check.py) without a GPU: the stage runner with real
subprocesses (a stage that fails, one past its timeout, the budget running out), the JSON it
writes, the test counts from a real pytest run, the config it writes for the update loop, and
the script's refusals. A GPU run itself cannot happen here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import Stage, check, online_config, junit_counts

REPO = Path(__file__).resolve().parents[2]


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in state  # a zombie has stopped; only its parent's wait is missing


def test_stages_run_in_order_and_a_failure_or_timeout_does_not_stop_the_check(tmp_path):
    out = tmp_path / "gpu-check.json"
    pidfile = tmp_path / "child.pid"
    slow = ("import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    stages = [
        Stage("fails", _py("import sys; print('something broke'); sys.exit(3)"), 30),
        Stage("hangs", _py(slow), 2),
        Stage("works", _py(f"import json; json.dump({{'x': 1.5}}, open({str(tmp_path / 'w.json')!r}, 'w'))"),
              30, lambda w: json.loads((w / "w.json").read_text())),
        Stage("no_figures", _py("pass"), 30, lambda w: json.loads((w / "missing.json").read_text())),
    ]
    t0 = time.monotonic()
    result = check(stages, out, tmp_path, budget_s=120, header={"date": "today"}, min_stage_s=1)
    assert time.monotonic() - t0 < 60
    s = result["stages"]
    assert list(s) == ["fails", "hangs", "works", "no_figures"]
    assert s["fails"]["status"] == "failed" and s["fails"]["rc"] == 3
    assert "something broke" in s["fails"]["log_tail"]
    assert s["hangs"]["status"] == "timeout" and s["hangs"]["seconds"] < 40
    assert not _alive(int(pidfile.read_text())), "the timed-out stage's child was left running"
    assert s["works"]["status"] == "ok" and s["works"]["figures"] == {"x": 1.5}
    assert s["no_figures"]["status"] == "failed" and "FileNotFoundError" in s["no_figures"]["figures_error"]
    assert result["ok"] is False
    assert json.loads(out.read_text()) == json.loads(json.dumps(result, default=str))
    assert json.loads(out.read_text())["date"] == "today"


def test_the_budget_bounds_the_run_and_later_stages_are_skipped(tmp_path):
    out = tmp_path / "gpu-check.json"
    stages = [Stage("long", _py("import time; time.sleep(30)"), 30),
              Stage("after", _py("pass"), 30)]
    result = check(stages, out, tmp_path, budget_s=3, header={}, min_stage_s=1)
    assert result["stages"]["long"]["status"] == "timeout"
    assert result["stages"]["long"]["timeout_s"] <= 3
    assert result["stages"]["after"]["status"] == "skipped"
    assert result["seconds"] < 30
    assert json.loads(out.read_text())["stages"]["after"]["status"] == "skipped"


def test_counts_come_from_a_real_pytest_run(tmp_path):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "def test_a(): pass\n"
        "def test_b(): pass\n"
        "def test_c(): assert False\n"
        "@pytest.mark.skip(reason='no')\n"
        "def test_d(): pass\n")
    junit = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
                    f"--junitxml={junit}", str(tmp_path / "test_some.py")],
                   capture_output=True, cwd=tmp_path)
    assert junit_counts(junit) == {"tests": 4, "passed": 2, "failed": 1, "errors": 0, "skipped": 1}


def test_an_override_of_a_nested_table_keeps_its_other_keys():
    import tomllib

    merged = gpu_check._merge_toml('x = 1\n[a]\nk = "v"\n[a.b]\np = 1\nq = 2\n',
                                   '[a.b]\nq = 3\n[c]\nz = true\n')
    assert tomllib.loads(merged) == {"x": 1, "a": {"k": "v", "b": {"p": 1, "q": 3}}, "c": {"z": True}}


@pytest.mark.parametrize("dry_run", [True, False])
def test_the_update_loop_config_loads_with_the_model_under_test(tmp_path, dry_run):
    from launch import sections

    path = tmp_path / "online.toml"
    path.write_text(online_config("/models/qwen", dry_run))
    loaded = sections.load(str(path))
    assert loaded.mesh.model.name == "/models/qwen"
    shipped = sections.load(str(REPO / "configs" / "online.toml"))
    assert loaded["online"] == shipped["online"]  # the loop's own settings are the shipped ones
    assert loaded["trainer"].optimizer == shipped["trainer"].optimizer
    if dry_run:
        assert loaded["trainer"].cpus == shipped["trainer"].cpus
        assert loaded["trainer"].lora.top_layers == 2  # of the tiny model's 4
    else:  # a GPU host: no pinning to the 2 CPU cores the shipped file splits
        assert loaded["trainer"].cpus == "" and loaded["rollout"].cpu_omp_threads_bind == "auto"


@pytest.mark.parametrize("dry_run", [True, False])
def test_every_stage_of_the_cli_parses_with_the_cli_s_own_parser(tmp_path, dry_run):
    """A stage whose options the command does not take would fail only on the GPU host."""
    from apps.cli import build_parser

    names = []
    for stage in gpu_check.stages("/models/qwen", tmp_path, dry_run):
        names.append(stage.name)
        if stage.argv[1:3] == ["-m", "apps.cli"]:
            args = build_parser().parse_args(stage.argv[3:])  # exits 2 on an unknown option
            assert args is not None
    assert names == ["model", "tests", "online_step", "hot_update", "rollout", "update_loop", "tenants"]


def test_a_gpu_check_without_a_gpu_says_so(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert gpu_check.main(["--out", str(tmp_path / "c.json"), "--stages", "model"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "c.json"), "--stages", "nope"])
    assert e.value.code == 2


@pytest.mark.slow
def test_the_script_runs_its_gpu_tests_and_online_step_stages_on_the_cpu(tmp_path):
    """The shell entry point end to end, dry run: the GPU-marked tests are collected and, with
    no CUDA here, all skipped; the online update is timed on the CPU; the JSON has the
    machine, the counts and the update's figures."""
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run(["scripts/gpu-check.sh", "--dry-run", "--stages", "model,tests,online_step",
                           "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "HOTLOOP_PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["dry_run"] is True and r["machine"]["torch"]
    counts = r["stages"]["tests"]["figures"]
    assert counts["tests"] > 0 and counts["skipped"] == counts["tests"] and counts["failed"] == 0
    assert "[gpu-check] tests: ok" in proc.stdout
    step = r["stages"]["online_step"]
    assert step["status"] == "ok", step
    assert set(step["figures"]["cpu"]) == {"1", "2"} and step["figures"]["speedup"] == {}
    assert all(b["update_ms"] > 0 for b in step["figures"]["cpu"].values())
