"""The GRPO recipe: sample -> score -> reference -> advantages -> LoRA step -> publish.

`Grpo` reads top to bottom (setup, step = sample then learn, save, evaluate) on the runner
that every recipe shares (base.py). Every stage is a span in one trace per step and a number
in the step's metrics; nothing here knows about gRPC or NATS beyond the clients and the
publisher it is given. This module also holds what the recipes over code tasks share (PPO
and asynchronous GRPO import it): the `Mesh`, the task stream, `start_on_tasks`, `publish`,
`Batch`, and the held-out evaluation and summary.

Every stage is spread over its service's replicas (hotloop.replicas): generation over the
rollout replicas, scoring over the reward replicas, reference passes over the reference
replicas; what a replica that dies mid-step held is re-run on the others.

Failure policy: a reward or reference service whose every replica is down fails the step after
bounded retries (hotloop.clients, hotloop.replicas), never a silent zero reward; a NaN/inf loss
skips the update and publishes nothing; everything a resumed run needs is in the checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

from opentelemetry import trace
from pydantic import Field

from hotloop.clients import Completion, ReferenceClient, RewardClient, Score, ScoreItem
from hotloop.config import Section
from hotloop.replicas import References, Rewards, Rollouts
from hotloop.tasks import CodeTask, load_tasks

from .base import Recipe, Run, Schedule, runner

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("hotloop.trainer")
STAGES = ("generate", "score", "reference", "train", "publish")


class TaskJobConfig(Section):
    """What a batch job trains and evaluates on: the fields `[grpo]` and `[ppo]` share."""

    tasks: str = "builtin"
    """Training tasks: `builtin`, `humaneval`, or a JSONL path (hotloop/tasks/README.md)."""
    train_split: str = "train"
    """Split of `tasks` to train on."""
    eval_tasks: str = "builtin"
    """Held-out evaluation tasks (same forms as `tasks`), from templates disjoint from
    training."""
    eval_split: str = "test"
    """Split of `eval_tasks` to evaluate on."""
    out_dir: str = "runs"
    """Run reports and checkpoints go under `<out_dir>/<run_id>/`."""
    seed: int = 0
    """Task order."""
    run_budget_s: float = Field(0.0, ge=0.0)
    """Bound the whole run (setup, both evaluations, training) to about this many seconds:
    training also stops once another step would leave less time than the final evaluation
    needs, predicted from the base one (`pacing/budget.py`). At least one step runs. 0: no bound."""
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=8)
    """Strings that end a completion, in training and in evaluation alike (left out of its
    text; its tokens are trained on). The demo ends each completion at the first code block's
    closing fence followed by a blank line, where the model moves on to prose and further
    examples that the reward never reads: that halves the tokens every stage pays for."""


class GrpoJobConfig(TaskJobConfig):
    """The `[grpo]` section: what to train on and how to evaluate (optimizer, loss and
    LoRA settings live in `[trainer]`)."""

    eval_limit: int = Field(64, ge=0)
    """Evaluate on the first N held-out tasks (0: all)."""
    eval_samples: int = Field(1, ge=1, le=64)
    """Samples per held-out task. 1: greedy pass@1; more: sampled at `eval_temperature`."""
    eval_temperature: float = Field(0.6, gt=0)
    """Sampling temperature for evaluation when eval_samples > 1."""
    eval_sampled: int = Field(0, ge=0, le=64)
    """Also measure sampled pass@1 at the training temperature (`sample_temperature`) with
    this many samples per task (unbiased estimator; >= 4 resolves far more than 1); 0: skip.
    Reported before/after as a paired difference, like the main figure."""
    train_budget_s: float = Field(0.0, ge=0.0)
    """Stop taking steps once another step would end past this many seconds of training
    (0: no limit; num_steps still caps the run). The run then checkpoints and evaluates as
    usual. With `run_budget_s`, this is how `make demo` fits its 15 minutes on CPUs of
    different speed."""
    eval_every: int = Field(0, ge=0)
    """Evaluate every N steps as well as before and after training (0: before and after only)."""
    sample_temperature: float = Field(1.0, gt=0)
    """Rollout temperature for training samples. Keep 1.0: the rollout reports
    temperature-1 logprobs, which the importance ratio compares against."""
    run_id: str = ""
    """Empty: a timestamp. Reusing an id resumes from its last checkpoint."""
    skip_uniform_groups: bool = True
    """Leave out groups whose samples all got the same reward (their advantage is zero, so
    they add no policy gradient; only their KL term is lost). Saves their reference and
    training compute, which dominates a step on a CPU (DAPO's dynamic sampling, without
    resampling). A step where every group is uniform trains nothing and publishes nothing."""


@dataclass
class StepRecord:
    step: int
    version: int
    reward_mean: float
    reward_std: float
    pass_rate: float
    stage_seconds: dict[str, float]
    tokens: int
    skipped: bool = False
    skip_reason: str = ""
    train: dict[str, float] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)


@dataclass
class EvalRecord:
    step: int
    version: int
    tasks: int
    samples_per_task: int
    pass_at_1: float
    ci95: float
    pass_at_k: dict[str, float] = field(default_factory=dict)
    per_task: list[float] = field(default_factory=list)  # pass@1 per task, in task order
    sampled: EvalRecord | None = None  # sampled pass@1 at the training temperature, if asked
    texts: list[str] = field(default_factory=list)  # the first completion per task, in task order

    def as_dict(self) -> dict:
        """For metrics and the report's curve: everything but the completions' texts."""
        d = asdict(self)
        d.pop("texts")
        if d["sampled"] is not None:
            d["sampled"].pop("texts")
        return d


@dataclass
class Batch:
    """One step's samples, scored, with advantages and (kept samples') reference logprobs.
    Flat index i = prompt * G + sample."""

    step: int
    tasks: list[CodeTask]
    position: dict  # the task stream's position after this batch's tasks
    comps: list[Completion]  # [B * G]
    scores: list[Score]  # [B * G]
    rewards: object  # torch.Tensor [B, G]
    advantages: object  # torch.Tensor [B * G]; zero for groups with equal rewards
    keep: list[int]  # flat indices to train on, ascending
    ref: dict[int, list[float]]  # flat index -> reference logprobs (kept samples, kl_beta > 0)
    # The seconds of its stages. Sampled in the step: each stage's own. Produced ahead
    # (grpo_async.produce): generate is first request -> last completion; score and reference
    # how much longer each ran after the stage before it ended; the sum is the batch's wall time.
    seconds: dict[str, float] = field(default_factory=dict)


def chat(task: CodeTask) -> list[dict[str, str]]:
    return [{"role": "user", "content": task.prompt}]


def score_item(task: CodeTask, c: Completion, i: int) -> ScoreItem:
    return ScoreItem(
        id=str(i), prompt=task.prompt, completion=c.text, task_id=task.task_id,
        tests=task.test_block, entry_point=task.entry_point, test_cases=list(task.tests),
        extra={"code_prefix": task.prefix} if task.prefix else {},
    )


def informative(rewards) -> list[int]:
    """Flat indices of samples in groups whose rewards differ. rewards: [B, G]."""
    B, G = rewards.shape
    varied = (rewards.max(dim=1).values > rewards.min(dim=1).values).tolist()  # [B]
    return [i for i in range(B * G) if varied[i // G]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


async def evaluate(rollout: Rollouts, reward: Rewards | RewardClient, tasks: list[CodeTask],
                   samples: int, temperature: float, max_tokens: int, version: int = 0,
                   ks: tuple[int, ...] = (1,), step: int = 0, stop: Sequence[str] = ()) -> EvalRecord:
    """pass@k of the version the replica serves (or `version` when pinned) on `tasks`."""
    greedy = samples == 1
    comps = await rollout.generate(
        [chat(t) for t in tasks], n=samples, max_tokens=max_tokens,
        temperature=0.0 if greedy else temperature, seed=1234, pin_version=version, stop=stop,
    )
    scores = await reward.score([score_item(tasks[c.prompt_index], c, i) for i, c in enumerate(comps)])
    correct = [0] * len(tasks)
    texts: list[str | None] = [None] * len(tasks)
    for c, s in zip(comps, scores):
        correct[c.prompt_index] += int(s.reward >= 1.0)
        if texts[c.prompt_index] is None:
            texts[c.prompt_index] = c.text
    per_task = [pass_at_k(samples, ci, 1) for ci in correct]
    mean = statistics.fmean(per_task)
    sd = statistics.pstdev(per_task) if len(per_task) > 1 else 0.0
    served = comps[0].policy_version if comps else version
    return EvalRecord(
        step=step, version=served, tasks=len(tasks), samples_per_task=samples, pass_at_1=mean,
        ci95=1.96 * sd / math.sqrt(max(1, len(per_task))),
        pass_at_k={str(k): statistics.fmean(pass_at_k(samples, ci, k) for ci in correct)
                   for k in ks if k <= samples},
        per_task=per_task, texts=[t or "" for t in texts],
    )


async def evaluate_both(rollout: Rollouts, reward: Rewards | RewardClient, heldout: list[CodeTask],
                        job: GrpoJobConfig, trainer_cfg, step: int) -> EvalRecord:
    """The held-out evaluation of a run: the main one (greedy with eval_samples == 1) and,
    with `eval_sampled`, sampled pass@1 at the training temperature (as `.sampled`). Both
    run at once: the engine batches their requests together, and the greedy completions
    are scored while the sampled ones still generate."""
    runs = [evaluate(rollout, reward, heldout, samples=job.eval_samples, temperature=job.eval_temperature,
                     max_tokens=trainer_cfg.max_new_tokens, step=step, stop=job.stop)]
    if job.eval_sampled:
        runs.append(evaluate(rollout, reward, heldout, samples=job.eval_sampled,
                             temperature=job.sample_temperature, max_tokens=trainer_cfg.max_new_tokens,
                             step=step, stop=job.stop))
    rec, *sampled = await asyncio.gather(*runs)
    rec.sampled = sampled[0] if sampled else None
    return rec


class TaskStream:
    """Shuffled epochs over the training tasks; its position is part of a checkpoint."""

    def __init__(self, tasks: list[CodeTask], seed: int, epoch: int = 0, offset: int = 0):
        self.tasks, self.seed, self.epoch, self.offset = tasks, seed, epoch, offset

    def _order(self) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[CodeTask]:
        out = []
        while len(out) < k:
            order = self._order()
            if self.offset >= len(order):
                self.epoch, self.offset = self.epoch + 1, 0
                continue
            out.append(self.tasks[order[self.offset]])
            self.offset += 1
        return out

    def position(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}


@dataclass
class Mesh:
    """The services a run talks to, each spread over its replicas (a single client works for
    reward and reference; a list of rollout clients becomes a `Rollouts`)."""

    rollout: Rollouts  # every replica, each pushed every version; training samples spread over them
    reward: Rewards | RewardClient
    reference: References | ReferenceClient | None
    publisher: object  # services.trainer.publish.Publisher

    def __post_init__(self) -> None:
        if not isinstance(self.rollout, Rollouts):
            self.rollout = Rollouts(list(self.rollout))


async def serve_policy(policy, mesh: Mesh, run_dir: Path, version: int) -> int:
    """Make the replicas serve exactly what `policy` computes before a run samples from them;
    returns the version they serve. `version`: the last one the run's checkpoint published.

    New versions are numbered above anything this run stored (a crash between a publish and
    the next checkpoint leaves a newer stored version than the checkpoint knows of) and
    anything a replica holds (the mesh outlives runs, and a replica refuses a version older
    than its latest). A fresh run on a fresh mesh publishes nothing: version 0 is the base,
    which a zero-initialised adapter computes exactly."""
    stored = mesh.publisher.store.latest()
    serving = max([(await r.status()).latest_version for r in mesh.rollout], default=0)
    if version == 0 and serving == 0 and stored is None:
        return 0
    version = max(version, stored.version if stored else 0, serving) + 1
    await publish(policy, mesh, run_dir, version)
    log.info("the replicas now serve this run's policy as version %d", version)
    return version


async def start_on_tasks(run: Run, policy, job: TaskJobConfig, mesh: Mesh,
                         extras: dict | None = None) -> tuple[TaskStream, int, dict]:
    """Where a recipe over code tasks starts: `policy` (and `extras`, as `Run.restore`)
    restored from the run's latest checkpoint, the task stream at the position that checkpoint
    recorded, and the replicas serving the policy. Returns (the stream, the version they serve,
    the checkpoint's data position: empty for a fresh run)."""
    pos = run.restore(policy, extras) or {}
    stream = TaskStream(load_tasks(job.tasks, job.train_split), job.seed, pos.get("epoch", 0),
                        pos.get("offset", 0))
    return stream, await serve_policy(policy, mesh, run.dir, pos.get("version", 0)), pos


async def publish(policy, mesh: Mesh, run_dir: Path, version: int) -> None:
    """Make `policy` the mesh's `version`: its adapter under the run, pushed and announced."""
    adapter = policy.save_adapter(run_dir / "adapters" / f"v{version}")
    await mesh.publisher.publish(version, adapter)  # opens the "publish" span


# ---- the recipe ------------------------------------------------------------------------------


class Grpo(Recipe):
    """Each step samples, scores, references, trains and publishes, one stage after another.

    `algorithm(trainer_cfg)`: an objective to train with instead of the policy's own
    (`make_algorithm`). grpo_async.py composes this class: its off-policy objective, batches
    produced ahead in place of `sample`, and `learn` as it is."""

    name = "grpo"

    def __init__(self, job: GrpoJobConfig, trainer_cfg, model_dir: Path, mesh: Mesh,
                 algorithm: Callable | None = None) -> None:
        self.job, self.cfg, self.model_dir, self.mesh = job, trainer_cfg, model_dir, mesh
        self.algorithm = algorithm
        self.evals: list[EvalRecord] = []

    async def setup(self, run: Run) -> Schedule:
        from ..learner.distributed import make_policy

        job, cfg = self.job, self.cfg
        self.run = run
        self.heldout = load_tasks(job.eval_tasks, job.eval_split)
        if job.eval_limit:
            self.heldout = self.heldout[: job.eval_limit]
        self.policy = make_policy(cfg, self.model_dir)
        if self.algorithm is not None:
            self.policy.algorithm = self.algorithm(cfg)
        self.stream, self.version, _ = await start_on_tasks(run, self.policy, job, self.mesh)
        # The task position the policy's weights have consumed, and its step then: what a
        # checkpoint records, so that a resume neither repeats a batch nor skips one.
        self.consumed, self.consumed_at = self.stream.position(), self.policy.step
        self.batch_position = self.consumed  # of the batch `learn` trains now
        return Schedule(self.policy.step, cfg.num_steps, cfg.checkpoint_interval,
                        evaluate=bool(self.heldout), evaluate_every=job.eval_every,
                        train_budget_s=job.train_budget_s, run_budget_s=job.run_budget_s)

    async def step(self, step: int) -> StepRecord:
        batch = await self.sample(step)
        return await self.learn(batch, step, batch.seconds)

    async def sample(self, step: int) -> Batch:
        """G completions for each of the next tasks, their rewards and group advantages, and
        the kept samples' reference logprobs: one stage after another."""
        import torch

        cfg, job, mesh = self.cfg, self.job, self.mesh
        tasks, G = self.stream.take(cfg.batch_prompts), cfg.group_size
        secs: dict[str, float] = {}

        t = time.perf_counter()
        with _tracer.start_as_current_span("generate"):
            # the prompts spread over the replicas, which all serve the same version
            comps = await mesh.rollout.generate(
                [chat(tk) for tk in tasks], n=G, max_tokens=cfg.max_new_tokens,
                temperature=job.sample_temperature, seed=job.seed * 100_003 + step, stop=job.stop)
        secs["generate"] = time.perf_counter() - t
        if len(comps) != len(tasks) * G:
            raise RuntimeError(f"rollout returned {len(comps)} completions, expected {len(tasks) * G}")

        t = time.perf_counter()
        with _tracer.start_as_current_span("score"):
            scores = await mesh.reward.score(
                [score_item(tasks[c.prompt_index], c, i) for i, c in enumerate(comps)])
        secs["score"] = time.perf_counter() - t

        rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32).view(len(tasks), G)
        adv = self.policy.algorithm.advantages(rewards).view(-1)  # [B*G], 0 for uniform groups
        keep = informative(rewards) if job.skip_uniform_groups else list(range(len(comps)))

        t = time.perf_counter()
        ref: dict[int, list[float]] = {}
        if cfg.loss.kl_beta > 0 and mesh.reference is not None and keep:
            with _tracer.start_as_current_span("reference"):
                ref = dict(zip(keep, await mesh.reference.logprobs(
                    [(comps[i].prompt_token_ids, comps[i].token_ids) for i in keep])))
        secs["reference"] = time.perf_counter() - t
        return Batch(step, tasks, self.stream.position(), comps, scores, rewards, adv, keep, ref, secs)

    async def learn(self, batch: Batch, step: int, secs: dict[str, float],
                    **train_extra: float) -> StepRecord:
        """Train on the batch's kept samples (none: the step is skipped), publish the update
        as the next version; the step's record. Adds "train" and "publish" to `secs`, the
        step's stage seconds; `train_extra` goes into the record's `train`."""
        from ..learner.batching import Sample

        comps, rewards = batch.comps, batch.rewards
        self.batch_position = batch.position
        samples = [
            Sample(prompt_ids=comps[i].prompt_token_ids, completion_ids=comps[i].token_ids,
                   old_logprobs=comps[i].logprobs, advantage=float(batch.advantages[i]),
                   ref_logprobs=batch.ref.get(i) if batch.ref else None)
            for i in batch.keep
        ]
        t = time.perf_counter()
        if samples:
            with _tracer.start_as_current_span("train"):
                m = await self.run.train(self.policy, samples)
            skipped, why = m.skipped, m.skip_reason or ""
        else:
            m, skipped, why = None, True, "every group got uniform rewards: no signal"
        secs["train"] = time.perf_counter() - t

        t = time.perf_counter()
        if skipped:
            log.warning("step %d: no update (%s); nothing published", step, why)
        else:  # the version counts once it is published (a stop during the push: not yet)
            await publish(self.policy, self.mesh, self.run.dir, self.version + 1)
            self.version += 1
        secs["publish"] = time.perf_counter() - t
        self.consumed, self.consumed_at = batch.position, self.policy.step
        return StepRecord(
            step=step + 1, version=self.version,
            reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
            pass_rate=float((rewards >= 1.0).float().mean()), stage_seconds=secs,
            tokens=sum(len(c.token_ids) for c in comps), skipped=skipped, skip_reason=why,
            train={**(m.as_dict() if m is not None else {}), "trained_samples": len(samples),
                   **train_extra},
            statuses=dict(Counter(s.status for s in batch.scores)),
        )

    async def save(self) -> None:
        # a step stopped after its update applied has consumed its batch all the same
        position = self.batch_position if self.policy.step > self.consumed_at else self.consumed
        self.policy.save_checkpoint(self.run.checkpoints,
                                    data_position={**position, "version": self.version})

    async def evaluate(self, step: int) -> dict:
        rec = await evaluate_both(self.mesh.rollout, self.mesh.reward, self.heldout, self.job,
                                  self.cfg, step)
        self.evals.append(rec)
        log.info("held-out pass@1 at step %d (v%d): %.3f ± %.3f", step, rec.version, rec.pass_at_1,
                 rec.ci95)
        if rec.sampled is not None:
            log.info("held-out sampled pass@1 at step %d: %.3f ± %.3f", step, rec.sampled.pass_at_1,
                     rec.sampled.ci95)
        return rec.as_dict()

    def progress(self, rec: StepRecord) -> str:
        return (f"reward {rec.reward_mean:.2f} pass {rec.pass_rate:.2f} "
                + " ".join(f"{k[:3]} {v:.1f}s" for k, v in rec.stage_seconds.items()))

    async def close(self) -> None:
        """Stop the policy's other data-parallel ranks; nothing else runs beside the steps."""
        if hasattr(self, "policy"):
            self.policy.close()

    def summary(self, records: list[StepRecord]) -> dict:
        return summarize(records, self.evals, self.job, self.cfg, self.heldout)


run = runner(Grpo)


def paired(first: EvalRecord, last: EvalRecord, job: GrpoJobConfig) -> dict:
    """Before/after on the same tasks: per-task differences with a bootstrap CI (stats.py).
    "greedy" is the main evaluation when it is greedy (eval_samples == 1), else "main"."""
    from ..learner.stats import paired_bootstrap

    key = "greedy" if job.eval_samples == 1 else "main"
    out = {key: {**paired_bootstrap(first.per_task, last.per_task),
                 "samples_per_task": first.samples_per_task}}
    if first.sampled is not None and last.sampled is not None:
        out["sampled"] = {**paired_bootstrap(first.sampled.per_task, last.sampled.per_task),
                          "samples_per_task": first.sampled.samples_per_task,
                          "temperature": job.sample_temperature}
    return out


def examples(first: EvalRecord, last: EvalRecord, tasks: list[CodeTask], k: int = 3) -> list[dict]:
    """A few held-out tasks before and after, chosen to show what changed: the k whose
    sampled pass@1 (greedy without a sampled evaluation) rose most, plus the one that fell
    most, if any did, so the report shows losses too. Completions are the first sample (the
    greedy one without a sampled evaluation), drawn with the same seed before and after."""
    main_first, main_last = (first.sampled, last.sampled) if first.sampled and last.sampled else (first, last)
    diffs = [b - a for a, b in zip(main_first.per_task, main_last.per_task)]
    order = sorted(range(len(diffs)), key=lambda i: (-diffs[i], i))
    picked = [i for i in order[:k] if diffs[i] > 0] or order[:k]
    if diffs and min(diffs) < 0 and order[-1] not in picked:
        picked.append(order[-1])
    out = []
    for i in picked:
        ex = {"task_id": tasks[i].task_id, "prompt": tasks[i].prompt,
              "base": main_first.texts[i], "final": main_last.texts[i],
              "shown": "greedy" if main_first is first else "sampled",
              "base_greedy": first.per_task[i], "final_greedy": last.per_task[i]}
        if main_first is not first:
            ex |= {"base_sampled": main_first.per_task[i], "final_sampled": main_last.per_task[i]}
        out.append(ex)
    return out


def summarize(steps: list[StepRecord], evals: list[EvalRecord], job: GrpoJobConfig, trainer_cfg,
              heldout: list[CodeTask] | None = None) -> dict:
    stage_totals = {s: sum(r.stage_seconds.get(s, 0.0) for r in steps) for s in STAGES}
    total = sum(stage_totals.values()) or 1.0
    samples = sum(trainer_cfg.batch_prompts * trainer_cfg.group_size for _ in steps)
    return {
        "steps": len(steps),
        "samples": samples,
        "samples_per_s": samples / total,
        "stage_seconds": {s: v / max(1, len(steps)) for s, v in stage_totals.items()},
        "stage_share": {s: v / total for s, v in stage_totals.items()},
        "heldout": {
            "tasks": evals[0].tasks if evals else 0,
            "samples_per_task": job.eval_samples,
            "pass_at_1_base": evals[0].pass_at_1 if evals else None,
            "pass_at_1_final": evals[-1].pass_at_1 if evals else None,
            "ci95_base": evals[0].ci95 if evals else None,
            "ci95_final": evals[-1].ci95 if evals else None,
            "curve": [e.as_dict() for e in evals],
            **({"paired": paired(evals[0], evals[-1], job)} if len(evals) > 1 else {}),
        },
        "examples": (examples(evals[0], evals[-1], heldout)
                     if heldout and len(evals) > 1 and evals[0].texts else []),
        "reward_curve": [r.reward_mean for r in steps],
        "pass_rate_curve": [r.pass_rate for r in steps],
        "skipped_steps": [r.step for r in steps if r.skipped],
    }
