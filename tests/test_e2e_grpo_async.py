"""Asynchronous GRPO through real processes: `hotloop up`'s launcher starts NATS, reference,
reward and rollout (vLLM) on the tiny model; a job with `max_staleness = 1` samples each batch
while the previous one trains, over the streaming calls, publishes every version hot and
writes its report. Each trained batch is checked against the bound by the recipe itself; here
the metrics show the overlap happened (a batch one version old) and never went past it."""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.slow


def test_async_grpo_job_through_the_mesh(tiny_model, tmp_path, monkeypatch):
    from hotloop import config
    from hotloop.clients import RolloutClient
    from launch.mesh import Mesh
    from launch.jobs import load_job
    from services.trainer.runner import run_job

    cfg_path = tmp_path / "e2e.toml"
    cfg_path.write_text(f"""
run_dir = "{tmp_path / 'run'}"
[model]
name = "{tiny_model}"
max_model_len = 512
[telemetry]
exporter = "jsonl"
[rollout]
kv_cache_gib = 1
[grpo]
eval_limit = 2
out_dir = "{tmp_path / 'runs'}"
run_id = "e2e-async"
skip_uniform_groups = false  # random tiny model: every reward is 0; train anyway
max_staleness = 1
[trainer]
batch_prompts = 2
group_size = 4
max_new_tokens = 16
num_steps = 3
checkpoint_interval = 1
torch_threads = 1
[trainer.loss]
kl_beta = 0.04
""")
    mesh_cfg = config.load_mesh(config.raw_config(cfg_path, environ={}))
    mesh = Mesh(mesh_cfg, str(cfg_path), [], ["reference", "reward", "rollout"], quiet=True)
    with mesh:
        mesh_cfg, job, trainer_cfg = load_job(str(cfg_path), [], "grpo", mesh.info)
        assert job.max_staleness == 1
        spans = trainer_spans(mesh_cfg)
        summary, report = asyncio.run(run_job(mesh_cfg, job, trainer_cfg, progress=False))

        async def serving():
            rollout = RolloutClient(mesh.info.endpoints["rollout"][0])
            st = await rollout.status()
            await rollout.close()
            return st

        st = asyncio.run(serving())
    assert summary["steps"] == 3 and st.latest_version == 3
    records = [json.loads(line) for line in (tmp_path / "runs/e2e-async/metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "step" in r]
    assert [s["version"] for s in steps] == [1, 2, 3]
    # batch 0 comes from the base; the next ones were sampled while the step before trained
    # (a request admitted just before a swap may still run wholly on the new version: 0)
    ages = [s["train"]["staleness_max"] for s in steps]
    assert ages[0] == 0 and max(ages) == 1 and summary["async"]["staleness_max"] == 1
    assert all(s["train"]["is_weight_mean"] > 0 and s["train"]["trained_samples"] == 8 for s in steps)
    assert summary["async"]["max_staleness"] == 1 and summary["samples_per_s"] > 0
    data = json.loads((tmp_path / "runs/e2e-async/report.json").read_text())
    assert data["config"]["grpo"]["max_staleness"] == 1
    assert data["heldout"]["tasks"] == 2 and report.exists()
    names = {s.name for s in spans.get_finished_spans()}
    assert {"grpo.produce", "grpo.step", "generate", "wait", "train"} <= names


def trainer_spans(mesh_cfg):
    """The spans this process's trainer ends from now on, in memory beside the job's own
    exporter (the tracer provider is global; `telemetry.setup` installs it once per process
    and points it at each job's exporter)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from hotloop import telemetry

    telemetry.setup("trainer", mesh_cfg.telemetry, mesh_cfg.run_dir)  # as run_job does
    exporter = InMemorySpanExporter()
    trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
    return exporter
