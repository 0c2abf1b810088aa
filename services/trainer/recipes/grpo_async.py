"""Asynchronous GRPO: the rollout of step k+1 runs while the trainer trains step k.

Owns: the pipelined recipe (`run`), which takes the synchronous recipe's inputs and writes its
metrics, checkpoints and summary (grpo.py, which stays the baseline: `max_staleness = 0` runs
`grpo.run`); the staleness gate (`StalenessGate`); and producing a batch (`produce`), where each
group is scored as soon as the engine finishes it and its reference logprobs are requested as
soon as its rewards are known, over one stream per service.

Does not own: the objective (`algorithms.make_offpolicy_algorithm`), evaluation
(`grpo.evaluate_both`), task order and version numbering (grpo.py), publishing (publisher.py), the LoRA step (policy.py).

The bound: batch k is sampled only once the policy has taken k - max_staleness steps, so when
step k trains, every token of its batch came from a version at most `max_staleness` versions
behind the trainer (versions rise by at most one per step). The recipe checks each sample's
staleness (the trainer's version minus the version of the sample's oldest token) before it
trains, and a sample past the bound is an error, not a silent drop: only another writer of
versions could cause it. The off-policy gap is corrected per token with the rollout's own
logprobs by truncated importance sampling (docs/architecture.md, "Asynchronous GRPO").

Failure policy: as grpo.py (a service that is down fails the step; a NaN/inf update publishes
nothing; the checkpoint holds the task position of the last trained batch, so batches produced
ahead and not trained are simply sampled again on resume). The streams are not retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import Field

from hotloop.aio import raise_if_cancelled
from hotloop.clients import Completion, Score
from hotloop.tasks import CodeTask, load_tasks

from .budget import StepBudget
from .grpo import (EvalRecord, GrpoJobConfig, Mesh, StepRecord, TaskStream, chat, evaluate_both,
                   score_item, serve_policy, summarize, train_and_publish)

log = logging.getLogger(__name__)


class AsyncGrpoJobConfig(GrpoJobConfig):
    """The `[grpo]` section, with the asynchronous mode's fields."""

    max_staleness: int = Field(0, ge=0, le=8)
    """Asynchronous GRPO: sample the next batch while the trainer trains this one, with every
    trained token at most this many versions behind the trainer. 0: the synchronous recipe
    (sample, score, reference, train, publish, one after another), the baseline. 1 overlaps
    one batch's rollout with the previous batch's training."""
    is_cap: float = Field(2.0, ge=1.0, le=10.0)
    """Asynchronous GRPO: truncation of the per-token importance weight pi / mu (pi: the
    trainer's policy, mu: the rollout's logprob of the token it sampled), as `[online] is_cap`."""


class StalenessGate:
    """Batch k may be sampled once `trained >= k - max_staleness` steps have finished (and
    published whatever they trained). With 0 the next batch waits for the last step: the
    synchronous schedule."""

    def __init__(self, max_staleness: int, trained: int = 0) -> None:
        self.max_staleness, self.trained = max_staleness, trained
        self._changed = asyncio.Condition()

    def may_sample(self, k: int) -> bool:
        return self.trained >= k - self.max_staleness

    async def wait(self, k: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.may_sample(k))

    async def advance(self) -> None:
        """One more step is done (trained and published, or skipped)."""
        async with self._changed:
            self.trained += 1
            self._changed.notify_all()


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
    # generate: first request -> last completion; score and reference: how much longer each
    # ran after the stage before it ended (they overlap it otherwise); the sum is the batch's
    # wall time.
    seconds: dict[str, float] = field(default_factory=dict)


def _traced(tracer, name: str):
    """A span around a coroutine function (its stage of `produce`; they overlap)."""

    def wrap(fn):
        async def inner():
            with tracer.start_as_current_span(name):
                return await fn()

        return inner

    return wrap


async def _drain(q: asyncio.Queue) -> AsyncIterator:
    while (item := await q.get()) is not None:
        yield item


async def produce(step: int, tasks: list[CodeTask], position: dict, mesh: Mesh, algo, job,
                  trainer_cfg, *, seed: int | None = None) -> Batch:
    """Sample G completions per task and score each group as soon as the engine finishes it;
    a group's reference logprobs are requested as soon as its rewards are in (when kl_beta > 0
    and the group is kept). Advantages are per group, so per-group computation is exact."""
    import torch
    from opentelemetry import trace

    tracer = trace.get_tracer("hotloop.trainer")
    B, G = len(tasks), trainer_cfg.group_size
    need_ref = trainer_cfg.loss.kl_beta > 0 and mesh.reference is not None
    comps: list[Completion | None] = [None] * (B * G)
    scores: list[Score | None] = [None] * (B * G)
    rewards = torch.zeros((B, G), dtype=torch.float32)
    advantages = torch.zeros(B * G, dtype=torch.float32)
    keep: list[int] = []
    ref: dict[int, list[float]] = {}
    scored = [0] * B
    to_score: asyncio.Queue = asyncio.Queue()
    to_ref: asyncio.Queue = asyncio.Queue()
    t0 = time.perf_counter()
    ends: dict[str, float] = {}

    @_traced(tracer, "generate")
    async def generate() -> None:
        try:
            async for c in mesh.rollout[0].generate_each(
                    [chat(t) for t in tasks], n=G, max_tokens=trainer_cfg.max_new_tokens,
                    temperature=job.sample_temperature, seed=seed, stop=job.stop):
                i = c.prompt_index * G + c.sample_index
                comps[i] = c
                await to_score.put(score_item(tasks[c.prompt_index], c, i))
        finally:
            ends["generate"] = time.perf_counter()
            await to_score.put(None)
        if (missing := sum(c is None for c in comps)) > 0:
            raise RuntimeError(f"rollout returned {B * G - missing} completions, expected {B * G}")

    @_traced(tracer, "score")
    async def score() -> None:
        try:
            async for s in mesh.reward.score_each(_drain(to_score)):
                i = int(s.id)
                scores[i] = s
                b = i // G
                scored[b] += 1
                if scored[b] < G:
                    continue
                r = torch.tensor([scores[b * G + j].reward for j in range(G)], dtype=torch.float32)
                rewards[b] = r
                advantages[b * G:(b + 1) * G] = algo.advantages(r.view(1, G)).view(-1)
                if job.skip_uniform_groups and float(r.max()) == float(r.min()):
                    continue  # no policy gradient: no reference pass, no training compute
                keep.extend(range(b * G, (b + 1) * G))
                if need_ref:
                    for j in range(b * G, (b + 1) * G):
                        await to_ref.put((str(j), comps[j].prompt_token_ids, comps[j].token_ids))
        finally:
            ends["score"] = time.perf_counter()
            await to_ref.put(None)

    @_traced(tracer, "reference")
    async def reference() -> None:
        async for i, lp in mesh.reference.logprobs_each(_drain(to_ref)):
            ref[int(i)] = lp
        ends["reference"] = time.perf_counter()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(generate())
        tg.create_task(score())
        if need_ref:
            tg.create_task(reference())
    if any(s is None for s in scores):
        raise RuntimeError(f"reward service returned {sum(s is not None for s in scores)} of {B * G} scores")
    if need_ref and len(ref) != len(keep):
        raise RuntimeError(f"reference returned {len(ref)} of {len(keep)} results")
    done_ref = ends.get("reference", ends["score"])
    return Batch(step, tasks, position, comps, scores, rewards, advantages, sorted(keep), ref, {
        "generate": ends["generate"] - t0,
        "score": max(0.0, ends["score"] - ends["generate"]),
        "reference": max(0.0, done_ref - ends["score"]),
    })


def staleness(comps: list[Completion], version: int) -> list[int]:
    """Per completion: the trainer's `version` minus the version of its oldest token (the
    first span's; an in-flight update can only make later tokens newer)."""
    return [version - (c.version_spans[0][0] if c.version_spans else c.policy_version) for c in comps]


async def _next_batch(ready: asyncio.Queue, producer: asyncio.Task) -> Batch:
    """The next produced batch; the producer's error if it failed first."""
    get = asyncio.ensure_future(ready.get())
    try:
        await asyncio.wait({get, producer}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done() and producer.done() and producer.exception() is not None:
            raise producer.exception()
        return await get
    finally:
        get.cancel()


def recipe(job: GrpoJobConfig):
    """The GRPO recipe a job runs: the synchronous baseline (`grpo.run`) at max_staleness 0
    (or a plain `GrpoJobConfig`), else the pipelined one here."""
    from . import grpo

    return run if getattr(job, "max_staleness", 0) else grpo.run


async def run(job: AsyncGrpoJobConfig, trainer_cfg, model_dir: Path, mesh: Mesh, run_dir: Path,
              progress: bool = True, on_step=None) -> dict:
    """Train with the rollout one batch (up to `max_staleness`) ahead of the trainer; returns
    the summary written to `run_dir/summary.json` (grpo.summarize's, with `samples_per_s` from
    the training loop's wall time, since stages overlap, and an `async` block)."""
    from opentelemetry import trace
    from tqdm import tqdm

    from ..learner.algorithms import make_offpolicy_algorithm
    from ..learner.batching import Sample
    from ..learner.checkpoint import latest_checkpoint
    from ..learner.policy import LoraPolicy

    tracer = trace.get_tracer("hotloop.trainer")
    run_t0 = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)

    # ---- setup -------------------------------------------------------------------------
    train_tasks = load_tasks(job.tasks, job.train_split)
    heldout = load_tasks(job.eval_tasks, job.eval_split)
    if job.eval_limit:
        heldout = heldout[: job.eval_limit]
    policy = LoraPolicy(trainer_cfg, model_dir)
    policy.algorithm = algo = make_offpolicy_algorithm(trainer_cfg, is_cap=job.is_cap)
    stream = TaskStream(train_tasks, job.seed)
    start_step, version = 0, 0
    ckpt_root = run_dir / "checkpoints"
    if (ckpt := latest_checkpoint(ckpt_root)) is not None:
        state = policy.restore(ckpt)
        start_step = state.step
        stream = TaskStream(train_tasks, job.seed, state.data_position["epoch"], state.data_position["offset"])
        version = state.data_position.get("version", 0)
        log.info("resumed from %s at step %d", ckpt, start_step)
    version = await serve_policy(policy, mesh, run_dir, version)
    rollout = mesh.rollout[0]
    metrics_file = open(run_dir / "metrics.jsonl", "a")
    evals: list[EvalRecord] = []
    steps: list[StepRecord] = []
    stale_seen: list[int] = []

    async def do_eval(step: int) -> None:
        with tracer.start_as_current_span("evaluate"):
            rec = await evaluate_both(rollout, mesh.reward, heldout, job, trainer_cfg, step)
        evals.append(rec)
        metrics_file.write(json.dumps({"eval": rec.as_dict()}) + "\n")
        metrics_file.flush()
        log.info("held-out pass@1 at step %d (v%d): %.3f ± %.3f", step, rec.version, rec.pass_at_1, rec.ci95)

    t = time.monotonic()
    if heldout:
        await do_eval(start_step)
    budget = StepBudget(job.train_budget_s, job.run_budget_s, run_t0, time.monotonic() - t)

    # ---- train: a producer task samples ahead, bounded by the gate --------------------------
    gate = StalenessGate(job.max_staleness, trained=start_step)
    ready: asyncio.Queue[Batch] = asyncio.Queue()

    async def producer() -> None:
        for k in range(start_step, trainer_cfg.num_steps):
            await gate.wait(k)
            tasks = stream.take(trainer_cfg.batch_prompts)
            with tracer.start_as_current_span("grpo.produce", attributes={"step": k}):
                batch = await produce(k, tasks, stream.position(), mesh, algo, job, trainer_cfg,
                                      seed=job.seed * 100_003 + k)
            await ready.put(batch)

    bar = tqdm(range(start_step, trainer_cfg.num_steps), initial=start_step, total=trainer_cfg.num_steps,
               desc="grpo async", unit="step", disable=not progress, dynamic_ncols=True)
    train_t0 = last_end = time.monotonic()
    done_step = start_step
    stop = threading.Event()
    trained_position = stream.position()  # where the last trained batch left the task stream
    resume_at = ({**trained_position, "version": version}, policy.step)
    prod = asyncio.create_task(producer())
    try:
        for step in bar:
            raise_if_cancelled()  # a Ctrl-C that a library swallowed mid-step (hotloop.aio)
            secs: dict[str, float] = {}
            resume_at = ({**trained_position, "version": version}, policy.step)
            with tracer.start_as_current_span("grpo.step", attributes={"step": step}):
                t = time.perf_counter()
                with tracer.start_as_current_span("wait"):
                    batch = await _next_batch(ready, prod)
                secs.update(batch.seconds)
                secs["wait"] = time.perf_counter() - t
                ages = staleness(batch.comps, version)
                if max(ages) > job.max_staleness:
                    raise RuntimeError(
                        f"step {step}: a sample is {max(ages)} versions behind the trainer (v{version}), "
                        f"over max_staleness = {job.max_staleness}: does a replica serve an older version than "
                        f"was pushed, or does something else publish versions?")
                stale_seen.extend(ages)
                comps, keep = batch.comps, batch.keep
                samples = [
                    Sample(prompt_ids=comps[i].prompt_token_ids, completion_ids=comps[i].token_ids,
                           old_logprobs=comps[i].logprobs, advantage=float(batch.advantages[i]),
                           ref_logprobs=batch.ref.get(i) if batch.ref else None)
                    for i in keep
                ]
                m, skipped, why, version = await train_and_publish(
                    policy, samples, stop, mesh, run_dir, version, step, secs)
            trained_position = batch.position
            await gate.advance()

            statuses: dict[str, int] = {}
            for s in batch.scores:
                statuses[s.status] = statuses.get(s.status, 0) + 1
            rewards = batch.rewards
            rec = StepRecord(
                step=step + 1, version=version,
                reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                pass_rate=float((rewards >= 1.0).float().mean()), stage_seconds=secs,
                tokens=sum(len(c.token_ids) for c in comps), skipped=skipped, skip_reason=why,
                train={**(m.as_dict() if m is not None else {}), "trained_samples": len(samples),
                       "staleness_max": float(max(ages)), "staleness_mean": statistics.fmean(ages),
                       # the time between two steps' ends: what a step costs once overlapped
                       "step_wall_s": time.monotonic() - last_end},
                statuses=statuses,
            )
            last_end = time.monotonic()
            steps.append(rec)
            metrics_file.write(json.dumps({"step": asdict(rec)}) + "\n")
            metrics_file.flush()
            bar.set_postfix_str(
                f"reward {rec.reward_mean:.2f} pass {rec.pass_rate:.2f} stale {max(ages)} "
                + " ".join(f"{k[:3]} {v:.1f}s" for k, v in secs.items()))
            if (step + 1) % trainer_cfg.checkpoint_interval == 0 or step + 1 == trainer_cfg.num_steps:
                policy.save_checkpoint(ckpt_root, data_position={**trained_position, "version": version})
            if on_step is not None:
                on_step(rec)
            done_step = step + 1
            if job.eval_every and (step + 1) % job.eval_every == 0 and step + 1 < trainer_cfg.num_steps:
                await do_eval(step + 1)
            if budget.spent(len(steps)):
                if (step + 1) % trainer_cfg.checkpoint_interval and step + 1 != trainer_cfg.num_steps:
                    policy.save_checkpoint(ckpt_root, data_position={**trained_position, "version": version})
                log.warning("%s reached after %d steps (%.0f s of training); evaluating",
                            budget.why, step + 1, budget.took())
                break
    except asyncio.CancelledError:
        # As grpo.run: stop the train thread, then checkpoint the last completed state.
        stop.set()
        position, trained = resume_at
        if policy.step > trained:  # the interrupted step still applied its update
            position = {**batch.position, "version": version}
        last = latest_checkpoint(ckpt_root)
        if last is None or not last.name.endswith(f"{policy.step:08d}"):
            policy.save_checkpoint(ckpt_root, data_position=position)
        log.warning("interrupted after step %d; checkpoint under %s", policy.step, ckpt_root)
        raise
    finally:
        loop_s = time.monotonic() - train_t0
        prod.cancel()  # a batch produced ahead of the last step is not trained
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await prod
        metrics_file.flush()
    bar.close()

    # ---- evaluate and save ---------------------------------------------------------------
    if heldout and (not evals or evals[-1].step != done_step):
        await do_eval(done_step)
    metrics_file.close()
    summary = summarize(steps, evals, job, trainer_cfg, heldout)
    summary["samples_per_s"] = summary["samples"] / loop_s if loop_s > 0 else 0.0
    summary["async"] = {
        "max_staleness": job.max_staleness, "is_cap": job.is_cap, "loop_seconds": loop_s,
        "staleness_max": max(stale_seen, default=0),
        "staleness_mean": statistics.fmean(stale_seen) if stale_seen else 0.0,
        "wait_seconds": [r.stage_seconds.get("wait", 0.0) for r in steps],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
