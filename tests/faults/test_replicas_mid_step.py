"""A reward replica SIGKILLed in the middle of a GRPO step: the job finishes, nothing is lost,
nothing is scored twice.

The mesh as `hotloop up --replicas rollout=2,reference=2,reward=2` runs it (`launch.mesh.Mesh`,
real processes on the tiny model) with the gateway. A GRPO job of 2 steps spreads generation,
scoring and reference passes over the replicas while a user streams answers through the
gateway. The reward scorer (gated_scorer.py) holds its first call until released, saying which
process is in it; that process is killed there, mid-call, and its chunk is re-run whole on the
other replica. Nothing restarts the killed one (the mesh is not supervised here), so what the
survivors' own metrics count can be added up against what the job trained.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

from launch.mesh import Mesh
from tests.scrape import parse

pytestmark = pytest.mark.slow
B, G, STEPS = 4, 2, 2  # the kill is in step 1's scoring; step 2 runs on the survivor


def write_config(tmp_path, tiny_model):
    (tmp_path / "no-heldout.jsonl").write_text("")
    path = tmp_path / "mesh.toml"
    path.write_text(f"""
run_dir = "{tmp_path / 'mesh'}"
[model]
name = "{tiny_model}"
dtype = "float32"
max_model_len = 512
[rollout]
kv_cache_gib = 1
[reward]
scorers = ["python:tests.faults.gated_scorer:score"]
default_scorer = "python:tests.faults.gated_scorer:score"
[gateway]
served_model = "tiny"
max_tokens = 16
default_max_tokens = 8
health_interval_s = 0.3
[grpo]
eval_tasks = "{tmp_path / 'no-heldout.jsonl'}"
eval_split = "all"
out_dir = "{tmp_path / 'runs'}"
run_id = "replicas"
skip_uniform_groups = false  # every sample trains: each step's count is exactly its batch
[trainer]
batch_prompts = {B}
group_size = {G}
max_new_tokens = 16
num_steps = {STEPS}
torch_threads = 1
[trainer.lora]
r = 4
alpha = 8.0
[trainer.loss]
kl_beta = 0.04
[up]
replicas = {{rollout = 2, reference = 2, reward = 2}}
""")
    return path


async def counted(url: str, sample: str, **labels) -> float:
    """The sum of a counter's samples (over the labels not given) at a metrics URL."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(url, timeout=10)).text
    return sum(s.value for fam in parse(text).families.values() for s in fam.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_reward_replica_killed_mid_step(tmp_path, tiny_model, monkeypatch):
    from launch.jobs import load_job
    from services.trainer.runner import run_job

    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "hold").touch()  # the first scoring call of each reward replica waits here
    monkeypatch.setenv("HOTLOOP_TEST_GATE", str(gate))  # the services inherit it
    cfg_path = write_config(tmp_path, tiny_model)
    mesh_cfg, job, trainer_cfg = load_job(str(cfg_path), [], "grpo")
    mesh = Mesh(mesh_cfg, str(cfg_path), [], ["reference", "reward", "rollout", "gateway"], quiet=True)
    info = mesh.start(timeout_s=600)
    try:
        assert [p.name for p in mesh.procs] == ["reference", "reference-1", "reward", "reward-1", "rollout",
                                                "rollout-1", "gateway"]
        mesh_cfg = info.apply(mesh_cfg)
        assert len(mesh_cfg.endpoints.reward) == len(mesh_cfg.endpoints.reference) == 2
        names = {pid: name for name, pid in info.pids.items()}

        async def kill_a_reward_replica_in_its_call() -> str:
            deadline = time.monotonic() + 300
            while not (markers := sorted(gate.glob("scoring-*"))):
                assert time.monotonic() < deadline, "no reward replica was ever asked to score"
                await asyncio.sleep(0.05)
            pid = int(markers[0].name.split("-")[1])
            os.kill(pid, signal.SIGKILL)
            (gate / "hold").unlink()  # the other replica, if held too, goes on
            return names[pid]

        async def user(done: asyncio.Event) -> list[str]:
            client = openai.AsyncOpenAI(base_url=info.gateway_url, api_key=info.user_key(), max_retries=0)
            answers = []
            while not done.is_set() or not answers:
                stream = await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                    stream=True)
                answers.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
            return answers

        async def main():
            done = asyncio.Event()
            users = asyncio.create_task(user(done))
            killer = asyncio.create_task(kill_a_reward_replica_in_its_call())
            try:
                summary, _ = await run_job(mesh_cfg, job, trainer_cfg, progress=False)
            finally:
                done.set()
            return summary, await killer, await users

        summary, killed, answers = asyncio.run(main())
        survivor = "reward-1" if killed == "reward" else "reward"
        reward_eps = dict(zip(["reward", "reward-1"], mesh_cfg.endpoints.reward))

        # the job finished, and every step trained exactly its batch
        assert summary["steps"] == STEPS
        steps = [json.loads(line)["step"] for line in
                 (tmp_path / "runs" / "replicas" / "metrics.jsonl").read_text().splitlines()
                 if "step" in json.loads(line)]
        assert [s["train"]["trained_samples"] for s in steps] == [B * G] * STEPS
        assert all(len(answers) >= 1 and a for a in answers)  # the user was answered throughout

        # the killed replica lost its call; its chunk was re-run whole on the survivor, which
        # scored every sample of the job exactly once (its own metrics say so)
        stats = summary["replicas"]["reward"]
        dead, alive = stats[reward_eps[killed]], stats[reward_eps[survivor]]
        assert dead["failed_calls"] >= 1 and dead["resent"] >= 1 and dead["answered"] == 0
        assert alive["answered"] == B * G * STEPS and alive["dropped"] == 0
        scored = asyncio.run(counted(info.metrics[survivor], "hotloop_reward_samples_total"))
        assert scored == B * G * STEPS

        # the reference passes were spread over both reference replicas, each sample once
        refs = [asyncio.run(counted(info.metrics[n], "hotloop_reference_requests_total", result="scored"))
                for n in ("reference", "reference-1")]
        assert sum(refs) == B * G * STEPS and min(refs) > 0
        assert all(s["answered"] > 0 for s in summary["replicas"]["rollout"].values())
        assert sum(s["answered"] for s in summary["replicas"]["rollout"].values()) == B * G * STEPS
    finally:
        mesh.stop()
