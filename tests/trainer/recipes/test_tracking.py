"""A recipe's records in the experiment trackers (`[report]`): a GRPO run (the real recipe and
LoRA policy on the tiny model, in-process fakes of the services, as test_grpo_async.py) and a
trainer of two tenants (real NATS, the lineage replica, as test_lanes.py) write to real
TensorBoard and MLflow stores, read back with their own readers and compared with what
metrics.jsonl says; `[report]` is a section of the config file like any other."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from hotloop.tracking import ReportConfig, default_mlflow_uri, flat_params
from services.trainer.tracking import open_job_tracker
from tests.trackers import mlflow_runs, tensorboard_scalars


def records(path: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        ((kind, rec),) = json.loads(line).items()
        out.setdefault(kind, []).append(rec)
    return out


async def test_a_grpo_run_reaches_tensorboard_and_mlflow_as_metrics_jsonl_says(make_cfg, tiny_model,
                                                                               tmp_path):
    from services.trainer.recipes.grpo_async import recipe
    from tests.trainer.recipes.test_grpo_async import B, G, job, make_mesh

    cfg = make_cfg(batch_prompts=B, group_size=G, max_new_tokens=8, num_steps=2,
                   checkpoint_interval=2, loss={"kl_beta": 0.04})
    j = job(tmp_path, max_staleness=0, run_id="r")
    run_dir = tmp_path / "r"
    params = {"grpo": j.model_dump(mode="json"), "trainer": cfg.model_dump(mode="json")}
    tracker = open_job_tracker(ReportConfig(to=["tensorboard", "mlflow"]), run_dir, "r", params)
    try:
        summary = await recipe(j)(j, cfg, tiny_model, make_mesh(), run_dir, progress=False,
                                  tracker=tracker)
    finally:
        tracker.close()
    assert tracker.failures == {}
    lines = records(run_dir / "metrics.jsonl")
    steps, evals = lines["step"], lines["eval"]
    assert [s["step"] for s in steps] == [1, 2] and [e["step"] for e in evals] == [0, 2]

    tb = tensorboard_scalars(run_dir / "tensorboard")
    (run,) = mlflow_runs(default_mlflow_uri(run_dir), "hotloop")
    assert run["params"] == flat_params(params) and run["status"] == "FINISHED"
    assert run["params"]["trainer.optimizer.lr"] == json.dumps(cfg.optimizer.lr)
    for got, exact in ((tb, False), (run["metrics"], True)):  # TensorBoard keeps float32
        def near(x: float) -> object:
            return x if exact else pytest.approx(x, rel=1e-6)

        for s in steps:
            at = s["step"]
            assert got["step/reward_mean"][at] == near(s["reward_mean"])
            for key in ("loss", "grad_norm", "kl"):  # the update's loss, grad norm and KL
                assert got[f"step/train/{key}"][at] == near(s["train"][key])
            for stage, seconds in s["stage_seconds"].items():
                assert got[f"step/stage_seconds/{stage}"][at] == near(seconds)
            assert got["step/statuses/ok"][at] == B * G
            wall = got["throughput/step_seconds"][at]
            assert 0 < wall and got["throughput/samples_per_s"][at] == pytest.approx(B * G / wall,
                                                                                     rel=1e-5)
        for e in evals:
            assert got["eval/pass_at_1"][e["step"]] == near(e["pass_at_1"])
        assert got["summary/samples_per_s"] == {2: near(summary["samples_per_s"])}
    # nothing without a number: the evaluation's per-task list, the skip reason's text
    assert not any(k.startswith("eval/per_task") or k.endswith("skip_reason") for k in tb)
    assert set(tb) == set(run["metrics"])


def test_the_report_section_is_read_with_the_rest_of_the_file(tmp_path):
    from launch import sections
    from apps.train import load_job, load_job_report
    from hotloop.config import ConfigError

    path = tmp_path / "c.toml"
    path.write_text('[report]\nto = ["tensorboard", "mlflow"]\n[report.mlflow]\nexperiment = "e"\n')
    *rest, report = load_job_report(str(path), ["report.run_name=n"], "grpo")
    assert report == ReportConfig(to=["tensorboard", "mlflow"], run_name="n",
                                  mlflow={"experiment": "e"})
    assert len(load_job(str(path), [], "grpo")) == 3 and rest[1] == load_job(str(path), [], "grpo")[1]
    path.write_text('[report]\nto = ["wandb", "comet"]\n[grpo]\nseed = "x"\n')
    with pytest.raises(ConfigError) as bad:  # reported with every other problem of the file
        sections.load(str(path))
    assert len(bad.value.problems) == 2
    assert any(p.startswith(f"{path}: [report] to.1:") and "'comet'" in p for p in bad.value.problems)


async def test_a_missing_tracker_package_stops_a_job_before_it_connects(tmp_path, monkeypatch):
    from hotloop.config import ConfigError, MeshConfig
    from services.trainer.config import OnlineConfig, TrainerConfig
    from services.trainer.recipes.grpo import GrpoJobConfig
    from services.trainer.runner import run_job, run_online_job

    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python marks a module not importable
    wandb = ReportConfig(to=["wandb"])
    batch, online = GrpoJobConfig(out_dir=str(tmp_path)), OnlineConfig(out_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="'wandb' needs wandb, not installed here"):
        await run_job(MeshConfig(), batch, TrainerConfig(), report=wandb)
    with pytest.raises(ConfigError, match="'wandb' needs wandb, not installed here"):
        await run_online_job(MeshConfig(), online, TrainerConfig(), report=wandb)
    # with what is installed, the same jobs go on to the mesh (none here) and stop there
    with pytest.raises(SystemExit, match="no endpoint"):
        await run_job(MeshConfig(), batch, TrainerConfig(), report=ReportConfig(to=["tensorboard"]))
    with pytest.raises(SystemExit, match="no \\[nats\\] url"):
        await run_online_job(MeshConfig(), online, TrainerConfig(), report=ReportConfig())


@pytest.mark.slow
async def test_each_tenants_lane_writes_its_updates_and_loop_latency_under_its_name(
        nats_server, tmp_path, make_cfg, tiny_model):
    from hotloop.clients import RolloutClient
    from services.trainer.config import OnlineConfig
    from services.trainer.learner.policy import LoraPolicy
    from services.trainer.tenants.lanes import Lanes, lane_dir
    from services.trainer.publish import Publisher
    from tests.trainer.tenants.test_lanes import DURABLE, TOKEN, Mesh, stop, until

    mesh = await Mesh(nats_server.url).start()
    job = OnlineConfig(batch_size=1, tenants=["", "acme"], batch_window_s=0, durable=DURABLE,
                       ack_wait_s=30, out_dir=str(tmp_path), run_id="run",
                       max_staleness_versions=1000)
    run_dir = tmp_path / "run"

    def publisher_for(tenant: str, store_dir: Path) -> Publisher:
        return Publisher([mesh.addr], TOKEN, store_dir, mesh.trainer_bus, "tiny", tenant=tenant)

    def lines(tenant: str, kind: str) -> list[dict]:
        path = lane_dir(run_dir, tenant) / "metrics.jsonl"
        return records(path).get(kind, []) if path.exists() else []

    def steps(tenant: str) -> list[dict]:
        return lines(tenant, "step")

    def published(tenant: str) -> list[dict]:
        return lines(tenant, "published")

    tracker = open_job_tracker(ReportConfig(to=["tensorboard", "mlflow"]), run_dir, "run",
                               {"online": job.model_dump(mode="json")})
    rollout = RolloutClient(mesh.addr)
    lanes = Lanes(job, make_cfg(), tiny_model, bus=mesh.trainer_bus, publisher_for=publisher_for,
                  run_dir=run_dir, rollout=[rollout], policy=LoraPolicy(make_cfg()),
                  tracker=tracker)
    task = asyncio.create_task(lanes.run())
    try:
        await until(lambda: set(lanes.lanes) == {"", "acme"} and all(
            lane.online.started.is_set() for lane in lanes.lanes.values()), "both lanes consume",
            task=task)
        for score in (1.0, -1.0):
            await mesh.feedback("", score)
        await mesh.feedback("acme", 1.0)
        await until(lambda: len(steps("")) == 2 and len(steps("acme")) == 1
                    and len(published("")) == 2 and len(published("acme")) == 1,
                    "every feedback trains and its version lands", task=task)
    finally:
        await stop(task)
        await rollout.close()
        await mesh.close()
        tracker.close()

    tb = tensorboard_scalars(run_dir / "tensorboard")
    (run,) = mlflow_runs(default_mlflow_uri(run_dir), "hotloop")
    for got in (tb, run["metrics"]):
        for tenant, prefix in (("", "_default"), ("acme", "acme")):
            for s in steps(tenant):
                assert got[f"{prefix}/step/score_mean"][s["step"]] == s["score_mean"]  # ±1: exact
                assert got[f"{prefix}/step/version"][s["step"]] == s["version"]
                assert got[f"{prefix}/step/counters/trained"][s["step"]] == s["counters"]["trained"]
                assert got[f"{prefix}/throughput/samples_per_s"][s["step"]] > 0
            for p in published(tenant):  # the feedback-to-served loop of each version
                loop = got[f"{prefix}/published/loop_seconds_max"][p["step"]]
                assert loop == pytest.approx(p["loop_seconds_max"], rel=1e-6) and loop > 0
                assert got[f"{prefix}/published/version"][p["step"]] == p["version"]
        assert not any(k.startswith(("step/", "published/")) for k in got)  # all under a tenant
    assert {s["version"] for s in steps("acme")} == {1}
