"""The PPO recipe: sample -> score -> reference -> values -> GAE -> minibatch epochs -> publish.

PPO as RLHF runs it (Ziegler et al. 2019; InstructGPT), on LoRA, on the engine that also
serves users. Per step:
1. sample `batch_prompts x group_size` completions from the rollout at TRAINING_PRIORITY, so
   vLLM's priority scheduler admits users' requests first;
2. score them (the reward service: code tests, rules, reward models, composites);
3. reference logprobs: the same base with the adapter disabled, inside this process
   (`reference = "colocated"`, no second copy of the base), or the reference service;
4. values V(s_t) from the critic (critic.py), per token;
5. per-token reward = -kl_coef * (logp - ref) + score at the last token; GAE; whitening;
6. `epochs` passes of `minibatches` optimizer steps; each step updates policy and critic
   together (policy.train_step with the critic);
7. publish the adapter as a new version; adapt kl_coef toward kl_target.
Users first: `users_first` chooses how the trainer yields the CPU to users sharing the host
(pacing/usersfirst.py); benchmarks/joint.py measures the policies.

Failure policy (as GRPO's): a reward scorer error is a sample with reward 0 and its status
counted; a non-finite loss, or a value loss past `[trainer.critic] max_value_loss`
(divergence), skips that minibatch's update and is reported; a step none of whose
minibatches updated publishes nothing; Ctrl-C checkpoints the last completed step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from opentelemetry import trace
from pydantic import Field

from hotloop.clients import TRAINING_PRIORITY, Completion, ScoreItem
from hotloop.tasks import CodeTask, load_tasks

from .. import report
from .base import Recipe, Run, Schedule, runner
from .grpo import Mesh, TaskJobConfig, chat, publish, start_on_tasks
from .registry import Registered, register
from ..pacing.usersfirst import UsersFirst

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("hotloop.trainer")
STAGES = ("generate", "score", "reference", "values", "train", "publish")


class PpoJobConfig(TaskJobConfig):
    """The `[ppo]` section: what PPO trains on, where its reference comes from, how it yields to
    users, and how it is evaluated. The algorithm's knobs are `[trainer.ppo]` and
    `[trainer.critic]`; optimizer and LoRA are `[trainer]` as for GRPO."""

    eval_limit: int = Field(64, ge=0)
    """Evaluate on the first N held-out prompts before and after (0: no evaluation)."""
    eval_sampled: int = Field(4, ge=0, le=64)
    """Besides greedy, the mean reward of this many samples per held-out prompt at the training
    temperature: what PPO optimizes, and far less noisy per prompt than one greedy answer
    (0: greedy only)."""
    scorer: str = ""
    """Reward-service scorer to request (a composite such as code tests plus a brevity rule or
    a reward model; docs/reward-models.md). Empty: the service's default scorer."""
    reference: Literal["colocated", "service"] = "colocated"
    """`colocated`: reference logprobs from the policy's own base with the adapter disabled,
    in this process (no second copy of the base weights; `hotloop up --profile colocated`
    starts no reference service). `service`: the reference service of the mesh."""
    users_first: Literal["none", "nice", "pause"] = "none"
    """How the trainer yields to users served by the same host. `none`: it computes as it
    likes. `nice`: its threads run at the lowest OS priority (19), so the kernel gives the
    cores to the engine whenever users' tokens are being computed. `pause`: its forward and
    backward passes hold between decoder layers while a user waits for a first token (the
    rollout's `WatchLoad` stream or, on its host, its shared-memory board), at most
    `max_pause_s` per busy spell. `hotloop bench joint` measures them in one run
    (docs/results.md, "PPO beside users"): on 2 CPU cores, with the trainer on a core of its
    own and users first inside the engine (`[rollout] max_num_batched_tokens`,
    `training_prompts_beside_users`), `pause` gave users nothing `none` did not, at the same
    PPO samples/s, hence the default; a host where the trainer shares the engine's cores may
    measure otherwise."""
    max_pause_s: float = Field(2.0, gt=0.0, le=60.0)
    """`pause`: the longest one busy spell of users stops training, so training progresses."""
    sample_temperature: float = Field(1.0, gt=0)
    """Rollout temperature. Keep 1.0: the rollout reports temperature-1 logprobs, which the
    importance ratio and the KL penalty compare against."""
    train_budget_s: float = Field(0.0, ge=0.0)
    """Stop taking steps once another step would end past this many seconds (0: no limit)."""
    examples: int = Field(3, ge=0, le=32)
    """Held-out prompts whose base and final completions the report shows."""
    run_id: str = ""
    """Empty: `ppo-<timestamp>`. Reusing an id resumes from its last checkpoint."""


@dataclass
class PpoStep:
    step: int
    version: int
    samples: int
    reward_mean: float  # the scorer's reward (before the KL penalty)
    kl: float  # mean per-token logp - ref of the sampled tokens (k1)
    kl_coef: float
    value_loss: float
    explained_variance: float  # of the rollout-time values against the GAE returns
    stage_seconds: dict[str, float]
    tokens: int
    updates: int  # minibatch optimizer steps applied
    skipped: bool = False
    skip_reason: str = ""
    paused_s: float = 0.0  # `pause`: time the step's compute (reference, values, train) waited for users
    train: dict[str, float] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)


def score_items(tasks: list[CodeTask], comps: list[Completion], scorer: str) -> list[ScoreItem]:
    return [ScoreItem(id=str(i), prompt=tasks[c.prompt_index].prompt, completion=c.text,
                      task_id=tasks[c.prompt_index].task_id, tests=tasks[c.prompt_index].test_block,
                      entry_point=tasks[c.prompt_index].entry_point,
                      test_cases=list(tasks[c.prompt_index].tests),
                      extra={"code_prefix": tasks[c.prompt_index].prefix} if tasks[c.prompt_index].prefix else {},
                      scorer=scorer)
            for i, c in enumerate(comps)]


@dataclass
class HeldOut:
    """Reward per held-out prompt (the same prompts before and after): greedy, and the mean
    of `samples` answers at the training temperature when asked."""

    step: int
    version: int
    per_task: list[float]  # greedy
    texts: list[str]  # greedy answers
    sampled: list[float] = field(default_factory=list)  # mean reward of the samples per prompt
    samples: int = 0

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_task) if self.per_task else math.nan

    @property
    def sampled_mean(self) -> float:
        return statistics.fmean(self.sampled) if self.sampled else math.nan


async def _rewards(mesh: Mesh, tasks: list[CodeTask], scorer: str, n: int, temperature: float,
                   max_tokens: int, stop: Sequence[str]) -> tuple[list[float], list[Completion]]:
    comps = await mesh.rollout.generate([chat(t) for t in tasks], n=n, max_tokens=max_tokens,
                                        temperature=temperature, seed=1234,
                                        priority=TRAINING_PRIORITY, stop=stop)
    scores = await mesh.reward.score(score_items(tasks, comps, scorer))
    per = [0.0] * len(tasks)
    for c, s in zip(comps, scores):
        per[c.prompt_index] += s.reward / n
    return per, comps


async def evaluate_heldout(mesh: Mesh, tasks: list[CodeTask], scorer: str, max_tokens: int, step: int,
                   samples: int = 0, temperature: float = 1.0, stop: Sequence[str] = ()) -> HeldOut:
    greedy, comps = await _rewards(mesh, tasks, scorer, 1, 0.0, max_tokens, stop)
    rec = HeldOut(step=step, version=comps[0].policy_version if comps else 0, per_task=greedy,
                  texts=[c.text for c in comps])
    if samples:
        rec.sampled, _ = await _rewards(mesh, tasks, scorer, samples, temperature, max_tokens, stop)
        rec.samples = samples
    return rec


class Ppo(Recipe):
    """PPO on LoRA with a critic, beside the users the same engine serves."""

    name = "ppo"

    def __init__(self, job: PpoJobConfig, trainer_cfg, model_dir: Path, mesh: Mesh) -> None:
        self.job, self.cfg, self.model_dir, self.mesh = job, trainer_cfg, model_dir, mesh
        self.users = UsersFirst(job.users_first, mesh.rollout[0].address, job.max_pause_s)
        self.evals: list[HeldOut] = []

    async def setup(self, run: Run) -> Schedule:
        import random

        from ..learner.algorithms import AdaptiveKl
        from ..learner.critic import make_critic
        from ..learner.distributed import make_policy

        job, cfg, pc = self.job, self.cfg, self.cfg.ppo
        self.run, self.rng = run, random.Random(job.seed)
        self.heldout = load_tasks(job.eval_tasks, job.eval_split)[: job.eval_limit] if job.eval_limit else []
        self.users.start()  # before the policy loads: torch's threads inherit a lower priority
        self.policy = make_policy(cfg, self.model_dir)
        self.critic = make_critic(self.policy, cfg.critic)
        self.users.attach(self.policy.model)  # `pause`: every forward and backward in this process holds
        self.kl = AdaptiveKl(pc.kl_coef, pc.kl_target, pc.kl_horizon)
        # CriticMismatch names what differs from the checkpoint's critic
        self.stream, self.version, pos = await start_on_tasks(
            run, self.policy, job, self.mesh, extras={"critic": self.critic.load})
        self.done, self.kl.coef = pos.get("ppo_step", 0), pos.get("kl_coef", self.kl.coef)
        self.users.watch()
        return Schedule(self.done, cfg.num_steps, cfg.checkpoint_interval, evaluate=bool(self.heldout),
                        train_budget_s=job.train_budget_s, run_budget_s=job.run_budget_s)

    async def step(self, step: int) -> PpoStep:
        from ..learner.algorithms import ppo_targets
        from ..learner.batching import Sample

        cfg, job, pc, mesh = self.cfg, self.job, self.cfg.ppo, self.mesh
        secs: dict[str, float] = {}
        paused0 = self.users.paused_s
        tasks = self.stream.take(cfg.batch_prompts)
        t = time.perf_counter()
        with _tracer.start_as_current_span("generate"):
            comps = await mesh.rollout.generate(
                [chat(tk) for tk in tasks], n=cfg.group_size, max_tokens=cfg.max_new_tokens,
                temperature=job.sample_temperature, seed=job.seed * 100_003 + step,
                priority=TRAINING_PRIORITY, stop=job.stop)
        secs["generate"] = time.perf_counter() - t

        t = time.perf_counter()
        with _tracer.start_as_current_span("score"):
            scores = await mesh.reward.score(score_items(tasks, comps, job.scorer))
        secs["score"] = time.perf_counter() - t

        pairs = [(c.prompt_token_ids, c.token_ids) for c in comps]
        t = time.perf_counter()
        with _tracer.start_as_current_span("reference"):
            ref = await self.reference_logprobs(pairs)
        secs["reference"] = time.perf_counter() - t

        t = time.perf_counter()
        with _tracer.start_as_current_span("values"):
            values = await asyncio.to_thread(self.critic.values, pairs)
        secs["values"] = time.perf_counter() - t

        est = ppo_targets(
            [{"score": s.reward, "logprobs": c.logprobs, "ref": r, "values": v}
             for s, c, r, v in zip(scores, comps, ref, values)], self.kl.coef, pc)
        samples = [
            Sample(prompt_ids=c.prompt_token_ids, completion_ids=c.token_ids,
                   old_logprobs=c.logprobs, advantage=a, returns=ret, old_values=v)
            for c, a, ret, v in zip(comps, est["advantages"], est["returns"], values)
            if c.token_ids  # an empty completion has no token to train
        ]

        t = time.perf_counter()
        results = []
        with _tracer.start_as_current_span("train"):
            for _ in range(pc.epochs):
                order = list(range(len(samples)))
                self.rng.shuffle(order)
                k = min(pc.minibatches, max(1, len(order)))
                for part in (order[i::k] for i in range(k)):
                    if part:
                        results.append(await self.run.train(self.policy, [samples[i] for i in part],
                                                            self.critic))
        secs["train"] = time.perf_counter() - t

        applied = [m for m in results if not m.skipped]
        skipped = not applied
        why = "; ".join(sorted({m.skip_reason or "" for m in results if m.skipped}))
        t = time.perf_counter()
        if skipped:
            log.warning("step %d: no update (%s); nothing published", step, why or "no samples")
        else:  # the version counts from its push on (a stop during it checkpoints this one)
            self.version += 1
            await publish(self.policy, mesh, self.run.dir, self.version)
        secs["publish"] = time.perf_counter() - t
        self.kl.update(est["kl"], len(comps))

        train = _mean_metrics(applied)
        rec = PpoStep(
            step=step + 1, version=self.version, samples=len(comps),
            reward_mean=statistics.fmean(s.reward for s in scores) if scores else math.nan,
            kl=est["kl"], kl_coef=self.kl.coef, value_loss=train.get("value_loss", math.nan),
            explained_variance=est["explained_variance"], stage_seconds=secs,
            tokens=sum(len(c.token_ids) for c in comps), updates=len(applied),
            skipped=skipped, skip_reason=why if skipped else "",
            paused_s=self.users.paused_s - paused0, train=train,
            statuses=dict(Counter(s.status for s in scores)))
        if not skipped and len(applied) < len(results):
            rec.skip_reason = f"{len(results) - len(applied)} minibatch update(s) skipped: {why}"
        self.done = step + 1
        return rec

    async def reference_logprobs(self, pairs):
        if self.job.reference == "colocated":
            return await asyncio.to_thread(self.policy.base_logprobs, pairs)
        if self.mesh.reference is None:
            raise RuntimeError("[ppo] reference = 'service' but no reference endpoint is configured")
        return await self.mesh.reference.logprobs(pairs)

    async def save(self) -> None:
        # After a stop mid-step, the minibatch updates it applied stay in the weights and the
        # position is past its tasks: the resumed run samples fresh ones from those weights.
        position = {**self.stream.position(), "version": self.version, "ppo_step": self.done,
                    "kl_coef": self.kl.coef}
        self.policy.save_checkpoint(self.run.checkpoints, data_position=position,
                                    extras={"critic": self.critic.save})

    async def evaluate(self, step: int) -> dict:
        job = self.job
        rec = await evaluate_heldout(self.mesh, self.heldout, job.scorer, self.cfg.max_new_tokens, step,
                                     job.eval_sampled, job.sample_temperature, job.stop)
        self.evals.append(rec)
        log.info("held-out reward at step %d (v%d): greedy %.3f, sampled %.3f", step,
                 rec.version, rec.mean, rec.sampled_mean)
        return {"step": step, "version": rec.version, "reward_mean": rec.mean,
                "sampled_reward_mean": rec.sampled_mean}

    def progress(self, rec: PpoStep) -> str:
        return (f"reward {rec.reward_mean:.2f} kl {rec.kl:.3f} "
                f"vloss {rec.value_loss:.3f} ev {rec.explained_variance:.2f}")

    async def close(self) -> None:
        await self.users.close()
        if hasattr(self, "policy"):
            self.policy.close()  # its other data-parallel ranks

    def summary(self, records: list[PpoStep]) -> dict:
        return summarize(records, self.evals, self.heldout, self.job, self.cfg)


run = runner(Ppo)


def _mean_metrics(results) -> dict[str, float]:
    """Mean of each metric over the applied minibatch updates of a step."""
    keys = sorted({k for m in results for k in m.as_dict()})
    return {k: statistics.fmean(m.as_dict()[k] for m in results if k in m.as_dict()) for k in keys}


def summarize(steps: list[PpoStep], evals: list[HeldOut], heldout: list[CodeTask],
              job: PpoJobConfig, trainer_cfg) -> dict:
    from ..learner.stats import paired_bootstrap

    totals = {s: sum(r.stage_seconds.get(s, 0.0) for r in steps) for s in STAGES}
    total = sum(totals.values()) or 1.0
    samples = sum(r.samples for r in steps)
    out = {
        "algorithm": "ppo",
        "steps": len(steps),
        "samples": samples,
        "samples_per_s": samples / total,
        "stage_seconds": {s: v / max(1, len(steps)) for s, v in totals.items()},
        "stage_share": {s: v / total for s, v in totals.items()},
        "reward_curve": [r.reward_mean for r in steps],
        "value_loss_curve": [r.value_loss for r in steps],
        "explained_variance_curve": [r.explained_variance for r in steps],
        "kl_curve": [r.kl for r in steps],
        "kl_coef_curve": [r.kl_coef for r in steps],
        "skipped_steps": [{"step": r.step, "reason": r.skip_reason} for r in steps if r.skip_reason],
        "users_first": job.users_first,
        "critic": trainer_cfg.critic.mode,
        "heldout": {"tasks": len(heldout), "scorer": job.scorer or "(service default)",
                    "curve": [{"step": e.step, "version": e.version, "reward_mean": e.mean,
                               "sampled_reward_mean": e.sampled_mean} for e in evals]},
    }
    if len(evals) > 1:
        first, last = evals[0], evals[-1]
        out["heldout"]["paired"] = {"greedy_reward": paired_bootstrap(first.per_task, last.per_task)}
        if first.sampled and last.sampled:
            out["heldout"]["paired"]["sampled_reward"] = {
                **paired_bootstrap(first.sampled, last.sampled), "samples_per_task": first.samples,
                "temperature": job.sample_temperature}
        out["examples"] = [{"prompt": t.prompt, "base": first.texts[i], "final": last.texts[i],
                            "base_reward": first.per_task[i], "final_reward": last.per_task[i]}
                           for i, t in enumerate(heldout[: job.examples])]
    return out


def check(job: PpoJobConfig, trainer_cfg, endpoints) -> None:
    """A reference where `[ppo] reference` says it is."""
    if job.reference == "service" and not endpoints.reference:
        raise SystemExit("[ppo] reference = 'service' needs the reference service: no endpoint "
                         "configured (or use reference = 'colocated')")


register(Registered(
    "ppo", "PPO on LoRA with a critic, GAE and a KL-penalised reward ([ppo])", PpoJobConfig,
    run=lambda job: run, report=report.write_ppo, check=check, run_prefix="ppo-",
    trainer={"algorithm": "ppo"}))
