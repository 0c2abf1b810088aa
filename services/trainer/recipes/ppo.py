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
(usersfirst.py); benchmarks/joint.py measures the policies.

Failure policy (as GRPO's): a reward scorer error is a sample with reward 0 and its status
counted; a non-finite loss, or a value loss past `[trainer.critic] max_value_loss`
(divergence), skips that minibatch's update and is reported; a step none of whose
minibatches updated publishes nothing; Ctrl-C checkpoints the last completed step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field

from hotloop.aio import raise_if_cancelled
from hotloop.clients import TRAINING_PRIORITY, Completion, ScoreItem
from hotloop.tasks import CodeTask, load_tasks

from .budget import StepBudget
from .grpo import Mesh, TaskJobConfig, TaskStream, chat, serve_policy
from .usersfirst import UsersFirst

log = logging.getLogger(__name__)
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
    users_first: Literal["none", "nice", "pause"] = "pause"
    """How the trainer yields to users served by the same host. `none`: it computes as it
    likes. `nice`: its threads run at the lowest OS priority (19), so the kernel gives the
    cores to the engine whenever users' tokens are being computed. `pause`: its forward and
    backward passes hold between decoder layers while a user waits for a first token (the
    rollout's `WatchLoad` stream or, on its host, its shared-memory board), at most
    `max_pause_s` per busy spell. `hotloop bench joint` measures them; docs/architecture.md has
    the runs (`pause` gave users the lower TTFT at no PPO cost, hence the default)."""
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
    comps = await mesh.rollout[0].generate([chat(t) for t in tasks], n=n, max_tokens=max_tokens,
                                           temperature=temperature, seed=1234,
                                           priority=TRAINING_PRIORITY, stop=stop)
    scores = await mesh.reward.score(score_items(tasks, comps, scorer))
    per = [0.0] * len(tasks)
    for c, s in zip(comps, scores):
        per[c.prompt_index] += s.reward / n
    return per, comps


async def evaluate(mesh: Mesh, tasks: list[CodeTask], scorer: str, max_tokens: int, step: int,
                   samples: int = 0, temperature: float = 1.0, stop: Sequence[str] = ()) -> HeldOut:
    greedy, comps = await _rewards(mesh, tasks, scorer, 1, 0.0, max_tokens, stop)
    rec = HeldOut(step=step, version=comps[0].policy_version if comps else 0, per_task=greedy,
                  texts=[c.text for c in comps])
    if samples:
        rec.sampled, _ = await _rewards(mesh, tasks, scorer, samples, temperature, max_tokens, stop)
        rec.samples = samples
    return rec


async def run(job: PpoJobConfig, trainer_cfg, model_dir: Path, mesh: Mesh, run_dir: Path,
              progress: bool = True, on_step=None) -> dict:
    """Train; returns the summary written to `run_dir/summary.json`."""
    import random

    from opentelemetry import trace
    from tqdm import tqdm

    from ..learner.algorithms import AdaptiveKl, ppo_targets
    from ..learner.batching import Sample
    from ..learner.checkpoint import latest_checkpoint
    from ..learner.critic import make_critic
    from ..learner.policy import Interrupted, LoraPolicy

    tracer = trace.get_tracer("hotloop.trainer")
    run_t0 = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    rollout = mesh.rollout[0]
    users = UsersFirst(job.users_first, rollout.address, job.max_pause_s)

    # ---- setup -------------------------------------------------------------------------
    train_tasks = load_tasks(job.tasks, job.train_split)
    heldout = load_tasks(job.eval_tasks, job.eval_split)[: job.eval_limit] if job.eval_limit else []
    users.start()  # before the policy loads: torch's threads inherit a lower priority
    policy = LoraPolicy(trainer_cfg, model_dir)
    critic = make_critic(policy, trainer_cfg.critic)
    users.attach(policy.model)  # `pause`: every forward and backward in this process holds
    pc = trainer_cfg.ppo
    kl_ctl = AdaptiveKl(pc.kl_coef, pc.kl_target, pc.kl_horizon)
    stream = TaskStream(train_tasks, job.seed)
    start_step, version = 0, 0
    ckpt_root = run_dir / "checkpoints"
    if (ckpt := latest_checkpoint(ckpt_root)) is not None:
        state = policy.restore(ckpt)
        critic.load(ckpt / "critic")  # CriticMismatch names what differs
        pos = state.data_position
        start_step, kl_ctl.coef, version = pos["ppo_step"], pos["kl_coef"], pos.get("version", 0)
        stream = TaskStream(train_tasks, job.seed, pos["epoch"], pos["offset"])
        log.info("resumed from %s at step %d", ckpt, start_step)
    version = await serve_policy(policy, mesh, run_dir, version)

    def position(step: int) -> dict:
        return {**stream.position(), "version": version, "ppo_step": step, "kl_coef": kl_ctl.coef}

    def checkpoint(step: int) -> None:
        policy.save_checkpoint(ckpt_root, data_position=position(step),
                               extras={"critic": critic.save})

    async def reference_logprobs(pairs):
        if job.reference == "colocated":
            return await asyncio.to_thread(policy.base_logprobs, pairs)
        if mesh.reference is None:
            raise RuntimeError("[ppo] reference = 'service' but no reference endpoint is configured")
        return await mesh.reference.logprobs(pairs)

    metrics_file = open(run_dir / "metrics.jsonl", "a")
    evals: list[HeldOut] = []
    steps: list[PpoStep] = []
    rng = random.Random(job.seed)

    async def do_eval(step: int) -> None:
        with tracer.start_as_current_span("evaluate"):
            rec = await evaluate(mesh, heldout, job.scorer, trainer_cfg.max_new_tokens, step,
                                 job.eval_sampled, job.sample_temperature, job.stop)
        evals.append(rec)
        metrics_file.write(json.dumps({"eval": {"step": step, "version": rec.version,
                                                "reward_mean": rec.mean,
                                                "sampled_reward_mean": rec.sampled_mean}}) + "\n")
        metrics_file.flush()
        log.info("held-out reward at step %d (v%d): greedy %.3f, sampled %.3f", step,
                 rec.version, rec.mean, rec.sampled_mean)

    stop = threading.Event()  # set on cancellation: the train thread stops within a micro-batch
    train_job: asyncio.Future | None = None
    done_step = start_step

    def poll() -> bool:  # polled by the train thread before each micro-batch
        return stop.is_set()

    try:
        users.watch()
        t = time.monotonic()
        if heldout:
            await do_eval(start_step)
        budget = StepBudget(job.train_budget_s, job.run_budget_s, run_t0, time.monotonic() - t)

        # ---- train -----------------------------------------------------------------------
        bar = tqdm(range(start_step, trainer_cfg.num_steps), initial=start_step,
                   total=trainer_cfg.num_steps, desc="ppo", unit="step", disable=not progress,
                   dynamic_ncols=True)
        for step in bar:
            raise_if_cancelled()  # a Ctrl-C that a library swallowed mid-step (hotloop.aio)
            secs: dict[str, float] = {}
            paused0 = users.paused_s
            with tracer.start_as_current_span("ppo.step", attributes={"step": step}):
                tasks = stream.take(trainer_cfg.batch_prompts)
                t = time.perf_counter()
                with tracer.start_as_current_span("generate"):
                    comps = await rollout.generate(
                        [chat(tk) for tk in tasks], n=trainer_cfg.group_size,
                        max_tokens=trainer_cfg.max_new_tokens, temperature=job.sample_temperature,
                        seed=job.seed * 100_003 + step, priority=TRAINING_PRIORITY, stop=job.stop)
                secs["generate"] = time.perf_counter() - t

                t = time.perf_counter()
                with tracer.start_as_current_span("score"):
                    scores = await mesh.reward.score(score_items(tasks, comps, job.scorer))
                secs["score"] = time.perf_counter() - t

                pairs = [(c.prompt_token_ids, c.token_ids) for c in comps]
                t = time.perf_counter()
                with tracer.start_as_current_span("reference"):
                    ref = await reference_logprobs(pairs)
                secs["reference"] = time.perf_counter() - t

                t = time.perf_counter()
                with tracer.start_as_current_span("values"):
                    values = await asyncio.to_thread(critic.values, pairs)
                secs["values"] = time.perf_counter() - t

                est = ppo_targets(
                    [{"score": s.reward, "logprobs": c.logprobs, "ref": r, "values": v}
                     for s, c, r, v in zip(scores, comps, ref, values)], kl_ctl.coef, pc)
                samples = [
                    Sample(prompt_ids=c.prompt_token_ids, completion_ids=c.token_ids,
                           old_logprobs=c.logprobs, advantage=a, returns=ret, old_values=v)
                    for c, a, ret, v in zip(comps, est["advantages"], est["returns"], values)
                    if c.token_ids  # an empty completion has no token to train
                ]

                t = time.perf_counter()
                results = []
                with tracer.start_as_current_span("train"):
                    for _ in range(pc.epochs):
                        order = list(range(len(samples)))
                        rng.shuffle(order)
                        k = min(pc.minibatches, max(1, len(order)))
                        for part in (order[i::k] for i in range(k)):
                            if not part:
                                continue
                            batch = [samples[i] for i in part]
                            train_job = asyncio.ensure_future(
                                asyncio.to_thread(policy.train_step, batch, poll, critic))
                            results.append(await asyncio.shield(train_job))
                secs["train"] = time.perf_counter() - t

                applied = [m for m in results if not m.skipped]
                skipped = not applied
                why = "; ".join(sorted({m.skip_reason or "" for m in results if m.skipped}))
                t = time.perf_counter()
                if skipped:
                    log.warning("step %d: no update (%s); nothing published", step,
                                why or "no samples")
                else:
                    version += 1
                    adapter = policy.save_adapter(run_dir / "adapters" / f"v{version}")
                    await mesh.publisher.publish(version, adapter)
                secs["publish"] = time.perf_counter() - t
                kl_ctl.update(est["kl"], len(comps))

            statuses: dict[str, int] = {}
            for s in scores:
                statuses[s.status] = statuses.get(s.status, 0) + 1
            train = _mean_metrics(applied)
            rec = PpoStep(
                step=step + 1, version=version, samples=len(comps),
                reward_mean=statistics.fmean(s.reward for s in scores) if scores else math.nan,
                kl=est["kl"], kl_coef=kl_ctl.coef, value_loss=train.get("value_loss", math.nan),
                explained_variance=est["explained_variance"], stage_seconds=secs,
                tokens=sum(len(c.token_ids) for c in comps), updates=len(applied),
                skipped=skipped, skip_reason=why if skipped else "",
                paused_s=users.paused_s - paused0, train=train, statuses=statuses)
            if not skipped and len(applied) < len(results):
                rec.skip_reason = f"{len(results) - len(applied)} minibatch update(s) skipped: {why}"
            steps.append(rec)
            metrics_file.write(json.dumps({"step": asdict(rec)}) + "\n")
            metrics_file.flush()
            bar.set_postfix_str(f"reward {rec.reward_mean:.2f} kl {rec.kl:.3f} "
                                f"vloss {rec.value_loss:.3f} ev {rec.explained_variance:.2f}")
            if (step + 1) % trainer_cfg.checkpoint_interval == 0 or step + 1 == trainer_cfg.num_steps:
                checkpoint(step + 1)
            if on_step is not None:
                on_step(rec)
            done_step = step + 1
            if budget.spent(len(steps)):
                if (step + 1) % trainer_cfg.checkpoint_interval and step + 1 != trainer_cfg.num_steps:
                    checkpoint(step + 1)
                log.warning("%s reached after %d steps (%.0f s of training)", budget.why, step + 1,
                            budget.took())
                break
        bar.close()
    except asyncio.CancelledError:
        # Ctrl-C / SIGTERM: stop the train thread within a micro-batch, then checkpoint
        # (adapter, critic, optimizers) so `run_id` resumes after the last completed step. The
        # minibatch updates an interrupted step already applied stay in the weights; the
        # resumed run samples that step afresh from them.
        stop.set()
        if train_job is not None and not train_job.done():
            with contextlib.suppress(Interrupted):
                await train_job
        last = latest_checkpoint(ckpt_root)
        if last is None or not last.name.endswith(f"{policy.step:08d}"):  # else: already saved
            checkpoint(done_step)
        log.warning("interrupted after step %d; checkpoint under %s", done_step, ckpt_root)
        raise
    finally:
        metrics_file.flush()
        await users.close()

    # ---- evaluate and save ---------------------------------------------------------------
    if heldout and (not evals or evals[-1].step != done_step):
        await do_eval(done_step)
    metrics_file.close()
    summary = summarize(steps, evals, heldout, job, trainer_cfg)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


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
