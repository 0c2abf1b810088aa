"""PPO through real processes, colocated: `hotloop up --profile colocated`'s services (NATS,
rollout with vLLM, reward, gateway; no reference service) on the tiny model. A PPO job trains
with the critic, the in-process reference and a composite reward, publishes each step hot,
and writes its report, while a user streams through the gateway: every user request is
served, on an old or a new version, none dropped."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytestmark = pytest.mark.slow


def test_ppo_job_beside_users_through_the_colocated_mesh(tiny_model, tmp_path, monkeypatch):
    import openai

    from hotloop import config
    from apps.cli import PROFILES
    from launch.mesh import Mesh
    from launch.jobs import load_job

    cfg_path = tmp_path / "ppo.toml"
    cfg_path.write_text(f"""
run_dir = "{tmp_path / 'run'}"
[model]
name = "{tiny_model}"
max_model_len = 512
[telemetry]
exporter = "jsonl"
[rollout]
kv_cache_gib = 1
scheduling_policy = "priority"
[reward]
scorers = ["code_tests", "concise", "mix"]
[reward.length_rules.concise]
max_words = 8
[reward.composites.mix]
parts = {{ code_tests = 1.0, concise = 0.5 }}
[ppo]
eval_limit = 4
scorer = "mix"
users_first = "pause"
out_dir = "{tmp_path / 'runs'}"
run_id = "e2e"
[trainer]
batch_prompts = 2
group_size = 2
max_new_tokens = 12
num_steps = 2
checkpoint_interval = 1
torch_threads = 1
[trainer.critic]
mode = "lora"
[trainer.ppo]
epochs = 2
minibatches = 2
kl_target = 0.1
""")
    mesh_cfg = config.load_mesh(config.raw_config(cfg_path, environ={}))
    assert "reference" not in PROFILES["colocated"]
    mesh = Mesh(mesh_cfg, str(cfg_path), [], PROFILES["colocated"], quiet=True)
    served: list[int] = []
    failures: list[str] = []
    done = threading.Event()

    def user(url: str, key: str, model: str) -> None:
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        while not done.is_set():
            try:
                stream = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                    stream=True)
                versions = {c.model_extra.get("policy_version") for c in stream}
                served.append(max(v for v in versions if v is not None))
            except Exception as e:  # every failure is a dropped user request
                failures.append(repr(e))

    with mesh:
        t = threading.Thread(target=user, args=(mesh.info.gateway_url, mesh.info.user_key(),
                                                 str(tiny_model)))
        t.start()
        try:
            mesh_cfg, job, trainer_cfg = load_job(str(cfg_path), [], "ppo", mesh.info)
            assert trainer_cfg.algorithm == "ppo"
            from services.trainer.runner import run_job

            summary, report = asyncio.run(
                run_job(mesh_cfg, job, trainer_cfg, progress=False, recipe="ppo"))
            # A second, fresh run on the same mesh: the replica serves v2 of the first run, so
            # the new run first serves its own (untrained) policy above it, then trains on.
            second = job.model_copy(update={"run_id": "again", "eval_limit": 0})
            again, _ = asyncio.run(run_job(mesh_cfg, second, trainer_cfg.model_copy(
                update={"num_steps": 1}), progress=False, recipe="ppo"))
        finally:
            done.set()
            t.join(60)
    assert again["steps"] == 1
    stored = sorted(p.name for p in (tmp_path / "runs/again/store/versions").glob("v*.tar"))
    assert stored == ["v3.tar", "v4.tar"]
    assert not failures, failures[:3]
    assert len(served) >= 3 and set(served) <= {0, 1, 2, 3, 4} and served[-1] >= 1
    assert summary["steps"] == 2
    data = json.loads((tmp_path / "runs/e2e/report.json").read_text())
    assert set(data["stage_seconds"]) == {"generate", "score", "reference", "values", "train", "publish"}
    assert len(data["value_loss_curve"]) == 2 and len(data["explained_variance_curve"]) == 2
    g = data["heldout"]["paired"]["greedy_reward"]
    assert data["heldout"]["tasks"] == 4 and g["ci95"][0] <= g["diff"] <= g["ci95"][1]
    sampled = data["heldout"]["paired"]["sampled_reward"]
    assert sampled["samples_per_task"] == 4 and sampled["ci95"][0] <= sampled["diff"] <= sampled["ci95"][1]
    assert data["config"]["ppo"]["reference"] == "colocated" and "reference" not in data["config"]
    assert data["config"]["trainer"]["critic"]["mode"] == "lora"
    lines = [json.loads(x) for x in (tmp_path / "runs/e2e/metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines if "step" in x]
    assert [s["step"] for s in steps] == [1, 2] and all(s["updates"] == 4 for s in steps)
    assert (tmp_path / "runs/e2e/ppo.png").stat().st_size > 1000
    ckpt = sorted((tmp_path / "runs/e2e/checkpoints").glob("step-*"))[-1]
    assert (ckpt / "critic" / "critic.json").exists()
    assert "Skipped" not in report.read_text() or data["skipped_steps"]
