"""The whole loop through real processes: `hotloop up`'s launcher starts NATS, reference,
reward and rollout (vLLM) on the tiny model; a GRPO job trains, publishes versions hot, and
writes its report; the rollout then serves the last version and NATS has it in the KV."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

pytestmark = pytest.mark.slow


def test_grpo_job_through_the_mesh(tiny_model, tmp_path, monkeypatch):
    from hotloop import config
    from hotloop.bus import Bus
    from hotloop.clients import RolloutClient
    from launch.mesh import Mesh
    from hotloop.proto.v1 import common_pb2
    from launch.jobs import load_job

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
eval_limit = 4
eval_sampled = 4
out_dir = "{tmp_path / 'runs'}"
run_id = "e2e"
skip_uniform_groups = false  # random tiny model: every reward is 0; train anyway
[trainer]
batch_prompts = 2
group_size = 4
max_new_tokens = 16
num_steps = 2
checkpoint_interval = 1
torch_threads = 1
[trainer.loss]
kl_beta = 0.04
""")
    mesh_cfg = config.load_mesh(config.raw_config(cfg_path, environ={}))
    mesh = Mesh(mesh_cfg, str(cfg_path), [], ["reference", "reward", "rollout"], quiet=True)
    with mesh:
        mesh_cfg, job, trainer_cfg = load_job(str(cfg_path), [], "grpo", mesh.info)
        from services.trainer.runner import run_job

        summary, report = asyncio.run(run_job(mesh_cfg, job, trainer_cfg, progress=False))

        async def check():
            rollout = RolloutClient(mesh.info.endpoints["rollout"][0])
            st = await rollout.status()
            out = await rollout.generate([[{"role": "user", "content": "hi"}]], max_tokens=2)
            await rollout.close()
            bus = await Bus.connect(mesh.info.nats_url, "check")
            latest = await bus.kv_get("latest", common_pb2.VersionInfo)
            await bus.close()
            return st, out, latest

        st, out, latest = asyncio.run(check())
    assert summary["steps"] == 2
    assert st.latest_version == 2 and out[0].policy_version == 2
    assert latest.version == 2 and latest.sha256 == [v for v in st.versions if v.version == 2][0].sha256
    data = json.loads((tmp_path / "runs/e2e/report.json").read_text())
    assert set(data["stage_seconds"]) == {"generate", "score", "reference", "train", "publish"}
    assert data["heldout"]["tasks"] == 4 and data["heldout"]["pass_at_1_base"] is not None
    paired = data["heldout"]["paired"]  # same tasks before and after: paired differences
    for g in (paired["greedy"], paired["sampled"]):
        assert g["diff"] == pytest.approx(g["final"] - g["base"]) and g["ci95"][0] <= g["diff"] <= g["ci95"][1]
    assert paired["sampled"]["samples_per_task"] == 4
    assert data["heldout"]["curve"][0]["sampled"]["samples_per_task"] == 4
    assert len(data["examples"]) == 3 and {"prompt", "base", "final"} <= set(data["examples"][0])
    md = (tmp_path / "runs/e2e/report.md").read_text()
    assert "held-out sampled pass@1" in md and "## What changed" in md and "demo aim" in md
    ran = data["config"]  # the effective configuration, with automatic choices resolved
    assert ran["trainer"]["num_steps"] == 2 and ran["grpo"]["run_id"] == "e2e"
    assert ran["trainer"]["dtype"] in ("bfloat16", "float32")
    assert ran["model"]["dtype"] == ran["rollout"]["dtype"] == ran["trainer"]["dtype"]
    assert ran["reference"]["dtype"] == ran["trainer"]["dtype"]
    assert ran["rollout"]["update_mode"] in ("merged", "lora") and ran["host"]["cpu"]
    assert "admin_token" not in json.dumps(ran)
    for png in ("learning.png", "stages.png"):
        assert (tmp_path / "runs/e2e" / png).stat().st_size > 1000
    assert (tmp_path / "runs/e2e/checkpoints").is_dir()
    traces = list((tmp_path / "run/traces").glob("*.jsonl"))
    from measure.traces import budget, read_spans

    b = budget(read_spans([str(p) for p in traces]))
    assert b["iterations"] == 2 and {"generate", "score", "train"} <= set(b["stages"])
    # the report's stage times and the traces tell the same story
    assert os.path.exists(report)
