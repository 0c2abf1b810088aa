"""Asynchronous GRPO (grpo_async.py) against in-process fakes of the rollout, reward and
reference services and a real LoRA policy on the tiny model: the staleness bound holds (and
a violation is an error), the objective is truncated IS against the rollout's own per-token
logprobs, groups are scored while the engine still generates, and max_staleness 0 is the
synchronous baseline."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from hotloop.clients import Completion, Score
from services.trainer.learner import algorithms
from services.trainer.recipes.grpo_async import AsyncGrpoJobConfig, StalenessGate, produce, recipe, run

G, B = 4, 2


def marker_logprobs(prompt_index: int, sample_index: int, n: int) -> list[float]:
    """What the fake engine reports: values no model computes, to trace them into the loss."""
    return [-(0.5 + 0.01 * k + 0.001 * sample_index + 0.0001 * prompt_index) for k in range(n)]


class FakeRollout:
    """Groups finish one after another, `delay` apart; each is admitted on the latest version.
    `admitted`: the version each training request (`generate_each`) was admitted on."""

    def __init__(self, delay: float = 0.01, events: list | None = None):
        self.latest, self.delay, self.events = 0, delay, events if events is not None else []
        self.stops: list[list[str]] = []  # each request's stop strings
        self.admitted: list[int] = []
        self._admitting = asyncio.Condition()

    async def admitted_at_least(self, n: int) -> None:
        """Until `n` training requests were admitted; a gate that never lets them through is
        a deadlock, reported after a minute instead of hanging the suite."""
        async with asyncio.timeout(60), self._admitting:
            await self._admitting.wait_for(lambda: len(self.admitted) >= n)

    async def generate_each(self, chats, n=1, **kw):
        admitted = self.latest
        self.admitted.append(admitted)
        async with self._admitting:
            self._admitting.notify_all()
        async for c in self._complete(chats, n, admitted, **kw):
            yield c

    async def _complete(self, chats, n, admitted, max_tokens=8, temperature=1.0, seed=None, stop=(), **_):
        self.stops.append(list(stop))
        for p, _chat in enumerate(chats):
            await asyncio.sleep(self.delay)
            self.events.append(("generated", p))
            for j in range(n):
                length = 3 + (p + j) % 4
                yield Completion(p, j, f"text {p} {j}", [7 + (p * 5 + j + k) % 40 for k in range(length)],
                                 marker_logprobs(p, j, length), "stop", admitted, [5, 6, 9 + p],
                                 version_spans=[(admitted, 0)])

    async def generate(self, chats, n=1, **kw):  # the evaluation's call
        out = [c async for c in self._complete(chats, n, self.latest, **kw)]
        return sorted(out, key=lambda c: (c.prompt_index, c.sample_index))

    async def status(self):
        return SimpleNamespace(latest_version=self.latest)


def fake_reward(i: int) -> float:
    return 1.0 if i % 3 == 0 else 0.0  # every group of 4 has both rewards


class FakeReward:
    def __init__(self, events: list | None = None):
        self.events = events if events is not None else []

    async def score_each(self, items):
        async for it in items:
            self.events.append(("scored", int(it.id) // G))
            yield Score(it.id, fake_reward(int(it.id)), 0, 0, False, "", "ok", 0.0)

    async def score(self, items):
        return [Score(it.id, fake_reward(int(it.id)), 0, 0, False, "", "ok", 0.0) for it in items]


class FakeReference:
    def __init__(self):
        self.seen: list[str] = []

    async def logprobs(self, pairs):  # the synchronous recipe's call
        return [[-1.0] * len(c) for _, c in pairs]

    async def logprobs_each(self, pairs):
        async for i, p, c in pairs:
            self.seen.append(i)
            yield i, [-1.0] * len(c)


class FakePublisher:
    """`hold_until_ahead`: publishing version v (step v - 1's update) first waits until the
    producer has had training batch v - 1 + ahead admitted (all of them, near the end), so
    every batch is sampled as early as the staleness gate lets it: batch k on version
    max(0, k - ahead). The schedule that reaches the bound, made by events, not timing."""

    def __init__(self, rollout: FakeRollout, behind: int = 0,
                 hold_until_ahead: tuple[int, int] | None = None):
        self.rollout, self.behind, self.published = rollout, behind, []
        self.hold_until_ahead = hold_until_ahead  # (ahead, number of training batches)
        self.store = SimpleNamespace(latest=lambda: None)

    async def publish(self, version, adapter):
        if self.hold_until_ahead is not None:
            ahead, batches = self.hold_until_ahead
            await self.rollout.admitted_at_least(min(version + ahead, batches))
        self.published.append(version)
        # behind > 0: a replica that serves an older version than the one pushed
        self.rollout.latest = max(0, version - self.behind)


def make_mesh(behind: int = 0, delay: float = 0.01, hold_until_ahead: tuple[int, int] | None = None):
    from services.trainer.recipes.grpo import Mesh

    rollout = FakeRollout(delay)
    return Mesh([rollout], FakeReward(), FakeReference(),
                FakePublisher(rollout, behind, hold_until_ahead))


def job(tmp_path, **kw) -> AsyncGrpoJobConfig:
    return AsyncGrpoJobConfig(**{"eval_limit": 2, "skip_uniform_groups": False, "out_dir": str(tmp_path),
                                 "max_staleness": 1, **kw})


@pytest.fixture
def tcfg(make_cfg):
    return make_cfg(batch_prompts=B, group_size=G, max_new_tokens=8, num_steps=4, checkpoint_interval=2,
                    loss={"kl_beta": 0.04})


# ---- the gate ------------------------------------------------------------------------------


async def test_gate_bounds_how_far_sampling_runs_ahead():
    gate = StalenessGate(1)
    assert gate.may_sample(0) and gate.may_sample(1) and not gate.may_sample(2)
    waiter = asyncio.create_task(gate.wait(2))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await gate.advance()
    await asyncio.wait_for(waiter, 1)
    sync = StalenessGate(0)  # the synchronous schedule: batch k waits for step k - 1
    assert sync.may_sample(0) and not sync.may_sample(1)


# ---- the objective -------------------------------------------------------------------------


def test_offpolicy_objective_is_truncated_is_with_group_advantages(make_cfg):
    cfg = make_cfg(loss={"kl_beta": 0.0})
    algo = algorithms.make_offpolicy_algorithm(cfg, is_cap=2.0)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert torch.equal(algo.advantages(rewards), algorithms.make_algorithm(cfg).advantages(rewards))
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    old = torch.tensor([[-2.0, -2.0], [-0.4, -3.0]])  # ratios e, 1, e^-0.1, e^2.9 (capped at 2)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, m = algo.loss(logp, old, None, adv, mask)
    loss.backward()
    w = torch.exp(logp.detach() - old).clamp(max=2.0)
    assert torch.allclose(logp.grad, -w * adv[:, None] / 4)  # token mean over 4 tokens
    assert m["capped_frac"] == pytest.approx(0.5)
    # on-policy (ratio 1) the gradient is the synchronous objective's
    logp2 = old.clone().requires_grad_(True)
    algo.loss(logp2, old, None, adv, mask)[0].backward()
    logp3 = old.clone().requires_grad_(True)
    algorithms.make_algorithm(cfg).loss(logp3, old, None, adv, mask)[0].backward()
    assert torch.allclose(logp2.grad, logp3.grad)


# ---- producing a batch ---------------------------------------------------------------------


async def test_groups_are_scored_and_referenced_while_the_engine_still_generates(tcfg, tmp_path):
    events: list = []
    mesh = make_mesh(delay=0.05)
    mesh.rollout[0].events = mesh.reward.events = events
    from hotloop.tasks import load_tasks

    tasks = load_tasks("builtin", "train")[:3]
    cfg = tcfg.model_copy(update={"batch_prompts": 3})
    algo = algorithms.make_offpolicy_algorithm(cfg, is_cap=2.0)
    batch = await produce(0, tasks, {}, mesh, algo, job(tmp_path), cfg)
    assert events.index(("scored", 0)) < events.index(("generated", 2))  # group 0 scored first
    assert sorted(batch.ref) == list(range(3 * G)) == batch.keep
    expected = algo.advantages(torch.tensor([[fake_reward(i) for i in range(b * G, (b + 1) * G)]
                                             for b in range(3)])).view(-1)
    assert torch.allclose(batch.advantages, expected)
    assert sum(batch.seconds.values()) > 0.1


async def test_uniform_groups_get_no_reference_pass(tcfg, tmp_path):
    mesh = make_mesh()
    mesh.reward.score_each = _uniform_scores
    from hotloop.tasks import load_tasks

    algo = algorithms.make_offpolicy_algorithm(tcfg, is_cap=2.0)
    batch = await produce(0, load_tasks("builtin", "train")[:B], {}, mesh, algo,
                          job(tmp_path, skip_uniform_groups=True), tcfg)
    assert batch.keep == list(range(G)) and sorted(batch.ref) == batch.keep  # group 1 is uniform


async def _uniform_scores(items):
    async for it in items:
        i = int(it.id)
        yield Score(it.id, float(i == 0) if i < G else 1.0, 0, 0, False, "", "ok", 0.0)


# ---- the recipe ----------------------------------------------------------------------------


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
async def test_staleness_never_exceeds_the_bound_and_the_loss_sees_the_rollouts_logprobs(
        tcfg, tiny_model, tmp_path, monkeypatch, max_staleness):
    seen_old: list[torch.Tensor] = []
    real = algorithms.tis_reinforce_loss

    def spy(logprobs, old_logprobs, ref_logprobs, advantages, mask, cfg, **kw):
        seen_old.extend(old_logprobs[i][mask[i]].clone() for i in range(len(mask)))
        return real(logprobs, old_logprobs, ref_logprobs, advantages, mask, cfg, **kw)

    monkeypatch.setattr(algorithms, "tis_reinforce_loss", spy)
    # Each update is published only once the producer has run as far ahead as the gate allows,
    # so the bound is reached by construction; left to timing, a producer that falls behind
    # the trainer samples fresher batches and staleness never gets to 2.
    mesh = make_mesh(hold_until_ahead=(max_staleness, tcfg.num_steps))
    j = job(tmp_path, max_staleness=max_staleness, run_id="r")
    summary = await run(j, tcfg, tiny_model, mesh, tmp_path / "r", progress=False)
    steps = [json.loads(line)["step"] for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()
             if "step" in json.loads(line)]
    assert mesh.rollout[0].admitted == [max(0, k - max_staleness) for k in range(4)]
    assert all(s["train"]["staleness_max"] <= max_staleness for s in steps)
    assert [s["train"]["staleness_max"] for s in steps] == [min(k, max_staleness) for k in range(4)]
    assert summary["async"]["staleness_max"] == max_staleness
    assert mesh.publisher.published == [1, 2, 3, 4]
    # every trained row is exactly what the engine reported for some (prompt, sample)
    markers = {tuple(torch.tensor(marker_logprobs(p, s, 3 + (p + s) % 4)).tolist())  # as float32
               for p in range(B) for s in range(G)}
    assert len(seen_old) == 4 * B * G
    assert all(tuple(row.tolist()) in markers for row in seen_old)
    assert all(s["train"]["is_weight_mean"] > 0 for s in steps)  # the TIS objective ran


@pytest.mark.parametrize("max_staleness", [0, 1])
async def test_the_jobs_stop_strings_reach_every_request_training_and_evaluation(
        tcfg, tiny_model, tmp_path, max_staleness):
    mesh = make_mesh()
    stop = ["\n```\n\n"]
    j = job(tmp_path, max_staleness=max_staleness, run_id="s", stop=stop)
    await recipe(j)(j, tcfg.model_copy(update={"num_steps": 2}), tiny_model, mesh, tmp_path / "s",
                    progress=False)
    stops = mesh.rollout[0].stops
    # 2 training batches, then the greedy evaluations before and after
    assert len(stops) == 2 + 2 and all(s == stop for s in stops)


@pytest.mark.parametrize("max_staleness", [0, 1])
async def test_a_run_budget_gives_way_to_the_final_evaluation(tcfg, tiny_model, tmp_path, max_staleness):
    """A slow engine (0.3 s a prompt): the base evaluation takes 0.6 s of a 2 s run budget, so
    after one step training stops and the final evaluation still runs; with room, all 4."""
    def steps_and_evals(run_id: str) -> tuple[int, int]:
        lines = [json.loads(x) for x in (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()]
        return sum("step" in x for x in lines), sum("eval" in x for x in lines)

    for run_id, run_budget_s in (("tight", 2.0), ("roomy", 600.0)):
        j = job(tmp_path, max_staleness=max_staleness, run_id=run_id, run_budget_s=run_budget_s)
        await recipe(j)(j, tcfg, tiny_model, make_mesh(delay=0.3), tmp_path / run_id, progress=False)
    assert steps_and_evals("tight") == (1, 2)
    assert steps_and_evals("roomy") == (4, 2)


async def test_a_sample_past_the_bound_is_an_error(tcfg, tiny_model, tmp_path):
    # the replica lags a version behind every push; batch 2 is admitted before step 1 publishes
    mesh = make_mesh(behind=1, hold_until_ahead=(1, tcfg.num_steps))
    with pytest.raises(RuntimeError, match="over max_staleness = 1"):
        await run(job(tmp_path, run_id="x"), tcfg, tiny_model, mesh, tmp_path / "x", progress=False)


def test_max_staleness_zero_runs_the_synchronous_recipe(tmp_path):
    from services.trainer.recipes import grpo, grpo_async
    from services.trainer.recipes.grpo import GrpoJobConfig

    assert recipe(AsyncGrpoJobConfig()) is grpo.run and AsyncGrpoJobConfig().max_staleness == 0
    assert recipe(GrpoJobConfig()) is grpo.run
    assert recipe(AsyncGrpoJobConfig(max_staleness=1)) is grpo_async.run


def test_the_grpo_section_reads_the_async_fields(tmp_path):
    from launch.jobs import load_job
    from hotloop.config import ConfigError

    cfg = tmp_path / "c.toml"
    cfg.write_text("[grpo]\nmax_staleness = 1\nis_cap = 1.5\n")
    _, j, _ = load_job(str(cfg), [], "grpo")
    assert (j.max_staleness, j.is_cap) == (1, 1.5)
    with pytest.raises(ConfigError, match=r"\[grpo\] max_staleness"):
        load_job(str(cfg), ["grpo.max_staleness=-1"], "grpo")


@pytest.mark.parametrize("max_staleness", [0, 1])
async def test_data_parallel_ranks_run_the_recipe_as_one_rank_does(tcfg, tiny_model, tmp_path,
                                                                   max_staleness):
    """`[trainer] data_parallel = 2` under the synchronous and the asynchronous recipe: the
    same losses and gradient norms as one rank (the first step's to rounding; the second
    starts from parameters AdamW's sign-like first step may have moved by rounding), and the
    other rank is gone when the run ends."""
    import os
    from pathlib import Path

    def records(run_id: str) -> list[dict]:
        lines = (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()
        return [x["step"]["train"] for x in map(json.loads, lines) if "step" in x]

    cfg = tcfg.model_copy(update={"num_steps": 2, "torch_threads": 1})
    for n in (1, 2):
        j = job(tmp_path, max_staleness=max_staleness, run_id=f"dp{n}")
        await recipe(j)(j, cfg.model_copy(update={"data_parallel": n}), tiny_model, make_mesh(),
                        tmp_path / f"dp{n}", progress=False)
    one, two = records("dp1"), records("dp2")
    assert len(one) == len(two) == 2 and not any(r["skipped"] for r in one + two)
    for k, rel in (("loss", 1e-5), ("grad_norm", 1e-5)):
        assert two[0][k] == pytest.approx(one[0][k], rel=rel), k
        assert two[1][k] == pytest.approx(one[1][k], rel=1e-2), k
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    assert not [c for c in children
                if b"learner.rank" in Path(f"/proc/{c}/cmdline").read_bytes()]
