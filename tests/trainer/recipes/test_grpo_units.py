import math
from types import SimpleNamespace

import pytest
import torch

from services.trainer.recipes.grpo import TaskStream, informative, pass_at_k


def test_informative_keeps_only_groups_with_varied_rewards():
    rewards = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.5], [1.0, 1.0, 1.0], [0.2, 0.2, 0.3]])
    assert informative(rewards) == [3, 4, 5, 9, 10, 11]
    assert informative(torch.zeros(2, 4)) == []


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 10, 5) == 1.0
    assert math.isclose(pass_at_k(10, 3, 1), 0.3)
    # 1 - C(7,2)/C(10,2) = 1 - 21/45
    assert math.isclose(pass_at_k(10, 3, 2), 1 - 21 / 45)


def test_task_stream_resumes_exactly():
    tasks = list(range(7))
    a = TaskStream(tasks, seed=3)
    first = a.take(5)
    pos = a.position()
    rest = a.take(9)
    b = TaskStream(tasks, seed=3, **pos)
    assert b.take(9) == rest
    assert sorted(first + rest[:2]) == tasks  # an epoch covers every task once


def _eval(step: int, greedy: list[float], sampled: list[float], tag: str):
    from services.trainer.recipes.grpo import EvalRecord

    n = len(greedy)
    texts = [f"{tag} greedy {i}\n```python\ndef f(): pass\n```" for i in range(n)]
    s = EvalRecord(step=step, version=step, tasks=n, samples_per_task=4, pass_at_1=sum(sampled) / n,
                   ci95=0.05, per_task=sampled,
                   texts=[f"{tag} sample {i}\n```python\ndef f(): pass\n```" for i in range(n)])
    return EvalRecord(step=step, version=step, tasks=n, samples_per_task=1, pass_at_1=sum(greedy) / n,
                      ci95=0.05, per_task=greedy, sampled=s, texts=texts)


def test_report_carries_paired_greedy_and_sampled_and_says_what_changed(tmp_path):
    import json

    from hotloop.tasks import load_tasks
    from services.trainer import report
    from services.trainer.recipes.grpo import GrpoJobConfig, StepRecord, summarize

    tasks = load_tasks("builtin", "test")
    n = len(tasks)
    assert n >= 128
    greedy = [float(i % 3 != 0) for i in range(n)]
    sampled = [(i % 5) / 4 for i in range(n)]
    sampled_after = [min(1.0, s + 0.25) for s in sampled]  # every task gains a sample of four
    sampled_after[7] = 0.0  # one task falls: the report shows it too
    first, last = _eval(0, greedy, sampled, "base"), _eval(6, greedy, sampled_after, "final")
    job = GrpoJobConfig(eval_sampled=4)
    cfg = SimpleNamespace(batch_prompts=8, group_size=8)
    steps = [StepRecord(step=1, version=1, reward_mean=0.3, reward_std=0.1, pass_rate=0.2,
                        stage_seconds={"generate": 1.0, "train": 2.0}, tokens=100)]
    summary = summarize(steps, [first, last], job, cfg, tasks)

    h = summary["heldout"]
    assert h["tasks"] == n
    g, s = h["paired"]["greedy"], h["paired"]["sampled"]
    for p in (g, s):
        assert {"base", "final", "diff", "ci95"} <= set(p) and len(p["ci95"]) == 2
        assert p["diff"] == pytest.approx(p["final"] - p["base"])
    assert s["samples_per_task"] == 4 and s["temperature"] == job.sample_temperature
    assert g["diff"] == 0 and not g["significant"] and s["significant"] and s["ci95"][0] > 0
    # The curve keeps the numbers, not the completions' texts.
    assert "texts" not in h["curve"][0] and "texts" not in h["curve"][0]["sampled"]
    ex = summary["examples"]
    assert [e["task_id"] for e in ex][-1] == tasks[7].task_id  # the task that fell
    assert all(e["final_sampled"] > e["base_sampled"] for e in ex[:-1]) and len(ex) == 4
    assert ex[0]["base"].startswith("base sample") and ex[0]["final"].startswith("final sample")

    path = report.write(summary, tmp_path)
    md = path.read_text()
    assert "held-out sampled pass@1 (at T=1, 4 samples per task)" in md and "significantly better" in md
    assert "held-out greedy pass@1" in md and "not significant" in md
    assert "demo aim" in md and ": met" in md
    assert "## What changed" in md and tasks[7].prompt[:60] in md and "final sample 7" in md
    # completions carry ``` fences of their own: the block around them needs a longer fence
    assert "````\nbase sample" in md and "```python\ndef f(): pass\n```\n````" in md
    assert json.loads((tmp_path / "report.json").read_text())["heldout"]["paired"]["sampled"]["ci95"]


def test_demo_aim_needs_ten_points_and_greedy_not_worse():
    from services.trainer.report import aim_line

    def p(diff, lo, hi):
        return {"diff": diff, "ci95": [lo, hi]}

    assert ": met" in aim_line({"sampled": p(0.12, 0.05, 0.2), "greedy": p(-0.01, -0.05, 0.02)})
    assert "not met" in aim_line({"sampled": p(0.08, 0.03, 0.12), "greedy": p(0.0, -0.02, 0.02)})
    assert "not met" in aim_line({"sampled": p(0.12, -0.01, 0.2), "greedy": p(0.0, -0.02, 0.02)})
    assert "not met" in aim_line({"sampled": p(0.12, 0.05, 0.2), "greedy": p(-0.05, -0.08, -0.01)})
    assert aim_line({"greedy": p(0.0, 0.0, 0.0)}) is None


def test_evaluate_both_scores_the_same_tasks_greedy_and_sampled():
    import asyncio

    from hotloop.clients import Completion, Score
    from hotloop.tasks import load_tasks
    from services.trainer.recipes.grpo import GrpoJobConfig, evaluate_both

    tasks = load_tasks("builtin", "test")[:5]
    calls = []

    class Rollout:  # task i's sample j passes when j < i (greedy: task i passes when i > 0)
        async def generate(self, chats, n, max_tokens, temperature, seed, pin_version, stop=()):
            calls.append((n, temperature))
            return [Completion(i, j, f"t{i}s{j}T{temperature}", [1], [0.0], "stop", 3)
                    for i in range(len(chats)) for j in range(n)]

    class Reward:
        async def score(self, items):
            rewards = []
            for it in items:
                i, j = (int(x) for x in it.completion[1:].split("T")[0].split("s"))
                rewards.append(float(j < i))
            return [Score(it.id, r, 0, 0, False, "", "ok", 0.0) for it, r in zip(items, rewards)]

    job = GrpoJobConfig(eval_sampled=4, sample_temperature=1.0)
    rec = asyncio.run(evaluate_both(Rollout(), Reward(), tasks, job, SimpleNamespace(max_new_tokens=8), 2))
    assert sorted(calls) == [(1, 0.0), (4, 1.0)]
    assert rec.per_task == [0.0, 1.0, 1.0, 1.0, 1.0] and rec.step == 2 and rec.version == 3
    assert rec.sampled.per_task == [0.0, 0.25, 0.5, 0.75, 1.0] and rec.sampled.samples_per_task == 4
    assert rec.texts[1] == "t1s0T0.0" and rec.sampled.texts[1] == "t1s0T1.0"
