"""hotloop.tracking: the `[report]` section, records as scalars, and the real TensorBoard,
MLflow and W&B (offline) writers, each read back with its own reader (tests/trackers.py); a
missing package is a start-up error, a write that fails mid-run is logged once and training
goes on."""

from __future__ import annotations

import logging
import sqlite3
import sys

import pytest

from hotloop import config
from hotloop.config import ConfigError
from hotloop.tracking import ReportConfig, Scoped, default_mlflow_uri, flat_params, open_tracker, scalars
from tests.trackers import mlflow_runs, tensorboard_scalars, tensorboard_text, wandb_offline_run

PARAMS = {"model": {"name": "tiny", "dtype": "float32"},
          "trainer": {"lr": 5e-05, "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]}},
          "online": {"tenant": ""}}


def test_a_record_becomes_its_numbers_under_group_slash_name():
    record = {"step": 3, "version": 2, "reward_mean": 0.5, "skipped": False, "skip_reason": "",
              "seqs": [4, 5], "stage_seconds": {"generate": 1.25, "train": 2.0},
              "counters": {"dropped": {"shed": 1}, "trained": 7}, "sampled": None}
    assert scalars(record, "step") == {
        "step/version": 2.0, "step/reward_mean": 0.5, "step/skipped": 0.0,
        "step/stage_seconds/generate": 1.25, "step/stage_seconds/train": 2.0,
        "step/counters/dropped/shed": 1.0, "step/counters/trained": 7.0}
    assert flat_params(PARAMS) == {
        "model.name": "tiny", "model.dtype": "float32", "trainer.lr": "5e-05",
        "trainer.lora.r": "8", "trainer.lora.target_modules": '["q_proj", "v_proj"]',
        "online.tenant": ""}


def test_the_report_section_names_known_trackers_once_each():
    def load(*sets: str) -> ReportConfig:
        return config.load_section(config.raw_config(None, list(sets), environ={}), "report",
                                   ReportConfig)

    assert load().to == [] and load().wandb.mode == "offline"
    assert load("report.to=mlflow").to == ["mlflow"]  # one name is the list of it
    assert load('report.to=["tensorboard", "wandb"]', "report.mlflow.experiment=e").to == [
        "tensorboard", "wandb"]
    with pytest.raises(ConfigError) as bad:
        load('report.to=["tensorboard", "tensorbored"]', "report.wandb.mode=cloud")
    assert "[report] to.1" in str(bad.value) and "'tensorbored'" in str(bad.value)
    assert "[report] wandb.mode" in str(bad.value) and len(bad.value.problems) == 2
    with pytest.raises(ConfigError, match="each tracker at most once"):
        load('report.to=["mlflow", "mlflow"]')


def test_every_tracker_holds_the_params_and_the_scalars_written(tmp_path):
    run_dir = tmp_path / "run"
    tracker = open_tracker(ReportConfig(to=["tensorboard", "mlflow", "wandb"]), run_dir, "run-1")
    assert tracker.names == ["tensorboard", "mlflow", "wandb"]
    tracker.log_params(PARAMS)
    written = {0: {"step/loss": 2.5, "step/train/grad_norm": 0.75},
               1: {"step/loss": 1.5, "step/train/grad_norm": 0.5},
               3: {"step/loss": 0.25, "eval/pass_at_1": 0.375}}
    for step, values in written.items():
        tracker.log_metrics(step, values)
    lane = Scoped(tracker, "acme")
    lane.log_metrics(1, {"step/loss": 9.0})
    tracker.close()
    tracker.close()  # idempotent
    tracker.log_metrics(4, {"step/loss": 1.0})  # after close: dropped, not raised
    expect: dict[str, dict[int, float]] = {"acme/step/loss": {1: 9.0}}
    for step, values in written.items():
        for key, value in values.items():
            expect.setdefault(key, {})[step] = value

    assert tensorboard_scalars(run_dir / "tensorboard") == expect  # every value exact in float32
    text = tensorboard_text(run_dir / "tensorboard", "config")
    assert '"lr": 5e-05' in text and '"target_modules": [' in text

    (run,) = mlflow_runs(default_mlflow_uri(run_dir), "hotloop")
    assert run["name"] == "run-1" and run["status"] == "FINISHED"
    assert run["params"] == flat_params(PARAMS)
    assert run["metrics"] == expect
    assert not (tmp_path / "mlruns").exists()  # nothing of the store outside the run directory

    wb = wandb_offline_run(run_dir)
    assert wb["name"] == "run-1" and wb["project"] == "hotloop"
    assert wb["config"]["trainer"] == PARAMS["trainer"]
    got: dict[str, dict[int, float]] = {}
    for row in wb["history"]:
        for key, value in row.items():
            if not key.startswith("_") and key != "step":
                got.setdefault(key, {})[row["step"]] = value
    assert got == expect


def test_no_trackers_is_a_tracker_that_writes_nothing(tmp_path):
    tracker = open_tracker(ReportConfig(), tmp_path / "run", "x")
    tracker.log_params(PARAMS)
    tracker.log_metrics(0, {"a": 1.0})
    tracker.close()
    assert tracker.names == [] and not (tmp_path / "run").exists()


def test_a_tracker_whose_package_is_missing_stops_the_run_before_anything_opens(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python marks a module not importable
    monkeypatch.setitem(sys.modules, "alembic", None)
    with pytest.raises(ConfigError) as missing:
        open_tracker(ReportConfig(to=["tensorboard", "mlflow", "wandb"]), tmp_path / "run", "x")
    problems = missing.value.problems
    assert len(problems) == 2
    assert problems[0].startswith("[report] to: 'mlflow' needs alembic, not installed here")
    assert problems[1].startswith("[report] to: 'wandb' needs wandb, not installed here")
    assert all("pip install 'hotloop[tracking]'" in p for p in problems)
    assert not (tmp_path / "run").exists()  # TensorBoard, installed, was not opened either


def test_a_write_that_fails_mid_run_is_logged_once_and_the_others_go_on(tmp_path, caplog):
    run_dir = tmp_path / "run"
    tracker = open_tracker(ReportConfig(to=["mlflow", "tensorboard"]), run_dir, "r")
    tracker.log_metrics(0, {"loss": 1.0})
    # the store loses its metric history under the run (what a broken database looks like)
    tracker._wait(lambda: None, 60)  # the write before it has landed
    with sqlite3.connect(run_dir / "mlflow.db") as db:
        db.execute("DROP TABLE metrics")
    with caplog.at_level(logging.ERROR, logger="hotloop.tracking"):
        tracker.log_metrics(1, {"loss": 0.5})  # never raises here: the write runs on its thread
        tracker.log_metrics(2, {"loss": 0.25})
        tracker.close()
    assert tracker.failures == {"mlflow": 2}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "hotloop.tracking"]
    assert len(errors) == 1 and "tracker mlflow: a write failed" in errors[0].getMessage()
    assert tensorboard_scalars(run_dir / "tensorboard") == {"loss": {0: 1.0, 1: 0.5, 2: 0.25}}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(default_mlflow_uri(run_dir))
    (run,) = client.search_runs([client.get_experiment_by_name("hotloop").experiment_id])
    assert run.info.status == "FINISHED"  # closed all the same
