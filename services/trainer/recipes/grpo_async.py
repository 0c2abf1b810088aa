"""Asynchronous GRPO: the rollout of step k+1 runs while the trainer trains step k.

Owns: the pipelined recipe (`AsyncGrpo`), which composes the synchronous one (grpo.py, which
stays the baseline: `max_staleness = 0` runs `grpo.run`) with a producer that samples ahead;
the staleness gate (`StalenessGate`); and producing a batch (`produce`), where each group is
scored as soon as the engine finishes it and its reference logprobs are requested as soon as
its rewards are known, over one stream per replica of each service (hotloop.replicas).

Registers `hotloop train grpo` (`[grpo]`: `AsyncGrpoJobConfig`, both modes' fields), since
choosing between the two modes (`recipe`) is this module's.

Does not own: the objective (`algorithms.make_offpolicy_algorithm`), the update, publishing,
evaluation, checkpoints and task order (`grpo.Grpo`, whose `learn` each step calls), or the
LoRA step (policy.py).

The bound: batch k is sampled only once the policy has taken k - max_staleness steps, so when
step k trains, every token of its batch came from a version at most `max_staleness` versions
behind the trainer (versions rise by at most one per step). The recipe checks each sample's
staleness (the trainer's version minus the version of the sample's oldest token) before it
trains, and a sample past the bound is an error, not a silent drop: only another writer of
versions could cause it. The off-policy gap is corrected per token with the rollout's own
logprobs by truncated importance sampling (docs/architecture.md, "Asynchronous GRPO").

Failure policy: as grpo.py (a service that is down fails the step; a NaN/inf update publishes
nothing; the checkpoint holds the task position of the last trained batch, so batches produced
ahead and not trained are simply sampled again on resume). A stream is not retried on its
replica: what a replica that dies had not answered goes to the others (hotloop.replicas).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

from opentelemetry import trace
from pydantic import Field

from hotloop.clients import Completion, Score
from hotloop.tasks import CodeTask

from .. import report
from .base import Recipe, Run, Schedule, runner
from .grpo import Batch, Grpo, GrpoJobConfig, Mesh, StepRecord, chat, score_item
from .registry import Registered, register

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("hotloop.trainer")


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

    @_traced(_tracer, "generate")
    async def generate() -> None:
        try:
            async for c in mesh.rollout.generate_each(
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

    @_traced(_tracer, "score")
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

    @_traced(_tracer, "reference")
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


class AsyncGrpo(Recipe):
    """GRPO whose batches are produced ahead: `grpo.Grpo` sets up, trains, publishes,
    evaluates and checkpoints; a producer task samples batch k as soon as the gate lets it."""

    name = "grpo"  # its steps are GRPO's: the same span, the same stages

    def __init__(self, job: AsyncGrpoJobConfig, trainer_cfg, model_dir: Path, mesh: Mesh) -> None:
        from ..learner.algorithms import make_offpolicy_algorithm

        self.job, self.cfg, self.mesh = job, trainer_cfg, mesh
        self.grpo = Grpo(job, trainer_cfg, model_dir, mesh,
                         algorithm=lambda cfg: make_offpolicy_algorithm(cfg, is_cap=job.is_cap))
        self.producer: asyncio.Task | None = None
        self.stale_seen: list[int] = []  # every trained sample's staleness

    @property
    def policy(self):
        return self.grpo.policy

    async def setup(self, run: Run) -> Schedule:
        self.run = run
        plan = await self.grpo.setup(run)
        self.gate = StalenessGate(self.job.max_staleness, trained=plan.first)
        self.ready: asyncio.Queue[Batch] = asyncio.Queue()
        self.first = plan.first
        return plan

    async def before_step(self) -> None:
        if self.producer is None:  # outside the first step's span: its batches are their own
            self.producer = asyncio.create_task(self._produce())
            self.last_end = time.monotonic()
        return None

    async def _produce(self) -> None:
        cfg, stream = self.cfg, self.grpo.stream
        for k in range(self.first, cfg.num_steps):
            await self.gate.wait(k)
            tasks = stream.take(cfg.batch_prompts)
            with _tracer.start_as_current_span("grpo.produce", attributes={"step": k}):
                batch = await produce(k, tasks, stream.position(), self.mesh, self.policy.algorithm,
                                      self.job, cfg, seed=self.job.seed * 100_003 + k)
            await self.ready.put(batch)

    async def step(self, step: int) -> StepRecord:
        job = self.job
        t = time.perf_counter()
        with _tracer.start_as_current_span("wait"):
            batch = await _next_batch(self.ready, self.producer)
        secs = {**batch.seconds, "wait": time.perf_counter() - t}
        version = self.grpo.version
        ages = staleness(batch.comps, version)
        if max(ages) > job.max_staleness:
            raise RuntimeError(
                f"step {step}: a sample is {max(ages)} versions behind the trainer (v{version}), "
                f"over max_staleness = {job.max_staleness}: does a replica serve an older version than "
                f"was pushed, or does something else publish versions?")
        self.stale_seen.extend(ages)
        rec = await self.grpo.learn(batch, step, secs, staleness_max=float(max(ages)),
                                    staleness_mean=statistics.fmean(ages))
        await self.gate.advance()
        # the time between two steps' ends: what a step costs once overlapped
        rec.train["step_wall_s"] = time.monotonic() - self.last_end
        self.last_end = time.monotonic()
        return rec

    async def save(self) -> None:
        await self.grpo.save()

    async def evaluate(self, step: int) -> dict:
        return await self.grpo.evaluate(step)

    def progress(self, rec: StepRecord) -> str:
        return (f"reward {rec.reward_mean:.2f} pass {rec.pass_rate:.2f} "
                f"stale {rec.train['staleness_max']:g} "
                + " ".join(f"{k[:3]} {v:.1f}s" for k, v in rec.stage_seconds.items()))

    async def close(self) -> None:
        if self.producer is not None:
            self.producer.cancel()  # a batch produced ahead of the last step is not trained
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.producer
        await self.grpo.close()

    def summary(self, records: list[StepRecord]) -> dict:
        """grpo.summarize's, with `samples_per_s` from the steps' wall time (stages overlap)
        and an `async` block."""
        summary = self.grpo.summary(records)
        loop_s = self.run.loop_seconds
        summary["samples_per_s"] = summary["samples"] / loop_s if loop_s > 0 else 0.0
        summary["async"] = {
            "max_staleness": self.job.max_staleness, "is_cap": self.job.is_cap, "loop_seconds": loop_s,
            "staleness_max": max(self.stale_seen, default=0),
            "staleness_mean": statistics.fmean(self.stale_seen) if self.stale_seen else 0.0,
            "wait_seconds": [r.stage_seconds.get("wait", 0.0) for r in records],
        }
        return summary


run = runner(AsyncGrpo)


def check(job, trainer_cfg, endpoints) -> None:
    """The reference GRPO's KL needs: a service (its logprobs of the sampled tokens only)."""
    if trainer_cfg.loss.kl_beta > 0 and not endpoints.reference:
        raise SystemExit("kl_beta > 0 needs the reference service: no endpoint configured")
    if trainer_cfg.loss.kl_beta > 0 and trainer_cfg.loss.kl_estimator == "full":
        raise SystemExit('[trainer.loss] kl_estimator = "full" needs the colocated reference, '
                         "which GRPO does not have (its reference service returns sampled "
                         'tokens\' logprobs): use "k3"')


register(Registered(
    "grpo", "GRPO on LoRA", AsyncGrpoJobConfig, run=recipe, report=report.write, check=check))
