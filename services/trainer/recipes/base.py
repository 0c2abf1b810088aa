"""The recipe interface, and the one runner every recipe runs under.

A recipe holds what is its own: what to sample, how that becomes an update, what a checkpoint
must hold for a resume, how it evaluates and what its summary says. What goes around it is
the same for every recipe and lives here, in `run_recipe`:

    setup          the recipe builds its policy, restores it (`Run.restore`) and makes the
                   replicas serve it; it returns its `Schedule`
    evaluate       before the first step, when the schedule evaluates
    each step      `raise_if_cancelled`, a `<name>.step` span around `Recipe.step`, the step's
                   record in metrics.jsonl (and the run's trackers: `[report]`), a checkpoint
                   when due (`Recipe.save`), `on_step`, an evaluation when due, the step
                   budget (pacing/budget.py)
    the end        a checkpoint of what is not saved yet, `Recipe.close`, the final
                   evaluation, summary.json
    a stop         (Ctrl-C or SIGTERM cancel the task) the train thread stops within its
                   micro-batch (`Run.train`), the recipe checkpoints what it trained, so that
                   the same `run_id` resumes there (not one that checkpoints inside its steps:
                   `Schedule.checkpoint_every`), and the cancellation propagates
    always         `Recipe.close`

Adding an algorithm is one file beside grpo.py: a class that subclasses `Recipe` and
implements, top to bottom, `setup` (build a `LoraPolicy` with the algorithm's objective,
`run.restore` it, make the replicas serve it, return a `Schedule`), `step` (sample, score,
update through `run.train`, publish; return the step's record, a dataclass with `step`,
`version` and `stage_seconds`), `save` (`policy.save_checkpoint` with the data position a
resume needs), `evaluate` if it evaluates, `close` and `summary`; then `run = runner(TheClass)`
is its entry point. `hotloop train <name>` reaches it through runner.py's `run_job`, which maps
the name to the recipe and its report (apps/train.py loads its config section). grpo.py is the
shortest example; ppo.py adds a critic and users-first; online.py steps on feedback as it
arrives.

Does not own: the mesh's clients and the trainer's own server (runner.py), or the update's math
(services.trainer.learner).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from opentelemetry import trace
from opentelemetry.context import Context

from hotloop.aio import finish, raise_if_cancelled

from ..pacing.budget import StepBudget

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("hotloop.trainer")


@dataclass(frozen=True)
class Schedule:
    """How the runner paces a recipe; `Recipe.setup` returns it."""

    first: int
    """The step to start at: 0, or where the restored checkpoint stopped."""
    last: int | None
    """Stop before this step; None: until cancelled."""
    checkpoint_every: int
    """Checkpoint after every N steps and after the last. 0: the recipe checkpoints inside its
    steps, where its delivery protocol needs it (the online recipe: a checkpoint, then the acks
    it covers); the runner then calls `save` only once the steps end, never on a stop, since
    what such a recipe did not checkpoint is delivered to it again."""
    evaluate: bool = False
    """Evaluate (`Recipe.evaluate`) before the first step and after the last."""
    evaluate_every: int = 0
    """Also evaluate every N steps (0: not in between)."""
    train_budget_s: float = 0.0
    """Stop once another step would end past this many seconds of training (0: no bound)."""
    run_budget_s: float = 0.0
    """Stop early enough for the whole run to fit (pacing/budget.py; 0: no bound)."""


class Run:
    """What the runner lends a recipe: the run's directory, its metrics.jsonl, its checkpoints,
    and the thread that computes updates, which a stop interrupts between micro-batches."""

    def __init__(self, run_dir: Path, tracker=None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.dir = run_dir
        self.tracker = tracker  # hotloop.tracking.Tracker: mirrors the records that have a step
        self.checkpoints = run_dir / "checkpoints"
        self.started = time.monotonic()
        self.loop_seconds = 0.0  # the steps' wall time, set once they end
        self._metrics = None  # metrics.jsonl, opened by the first line
        self._stop = threading.Event()  # polled by the train thread before each micro-batch
        self._update: asyncio.Future | None = None

    def write(self, kind: str, record: dict) -> None:
        """One line of metrics.jsonl, `{kind: record}`, flushed."""
        if self._metrics is None:
            self._metrics = open(self.dir / "metrics.jsonl", "a")
        self._metrics.write(json.dumps({kind: record}) + "\n")
        self._metrics.flush()
        if isinstance(record.get("step"), int):
            self.track(kind, record, record["step"])

    def track(self, group: str, record: dict, step: int) -> None:
        """`record`'s numbers to the run's trackers (if any), as `group/...` at `step`."""
        if self.tracker is not None:
            from hotloop.tracking import scalars

            self.tracker.log_metrics(step, scalars(record, group))

    def restore(self, policy, extras: dict[str, Callable[[Path], None]] | None = None) -> dict | None:
        """Restore `policy` from the run's latest checkpoint, and each of `extras` (name -> a
        reader) from the subdirectory `policy.save_checkpoint(extras=...)` wrote under that
        name; returns the checkpoint's data position, or None for a fresh run."""
        from ..learner.checkpoint import latest_checkpoint

        if (ckpt := latest_checkpoint(self.checkpoints)) is None:
            return None
        state = policy.restore(ckpt)
        for name, read in (extras or {}).items():
            read(ckpt / name)
        log.info("resumed from %s at step %d", ckpt, state.step)
        return state.data_position

    async def train(self, policy, samples: Sequence, critic=None, reference: bool = False):
        """One optimizer update of `policy` on `samples` (`LoraPolicy.train_step`, its
        colocated reference computed in the step when `reference`), in a thread.
        A cancellation does not stop the thread: the runner stops it before its next
        micro-batch and waits for it, so a checkpoint never races an optimizer step."""
        self._update = asyncio.ensure_future(asyncio.to_thread(
            policy.train_step, samples, self._stop.is_set, critic, reference))
        return await asyncio.shield(self._update)

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the policy, in a thread (a forward pass without an update). A
        cancellation waits for the thread to end, as `halt` does for an update: it holds the
        policy, which a checkpoint or another lane's turn must not touch meanwhile."""
        return await finish(asyncio.ensure_future(asyncio.to_thread(fn, *args)))

    async def halt(self) -> None:
        """Stop the update in flight (if any) before its next micro-batch and wait for it."""
        from ..learner.policy import Interrupted

        self._stop.set()
        if self._update is not None and not self._update.done():
            with contextlib.suppress(Interrupted):
                await finish(self._update)

    def _holds(self, step: int) -> bool:
        """Whether the latest checkpoint is of the policy at `step` (nothing new to save)."""
        from ..learner.checkpoint import latest_checkpoint

        last = latest_checkpoint(self.checkpoints)
        return last is not None and last.name.endswith(f"{step:08d}")

    def _close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()


class Recipe(ABC):
    """A training recipe. `run_recipe` calls its methods in the order they are written."""

    name: ClassVar[str]
    """Names the step's span (`<name>.step`, what `hotloop trace budget --root` reads) and the
    progress bar."""
    policy: Any
    """The `LoraPolicy` that trains, built by `setup`."""

    @abstractmethod
    async def setup(self, run: Run) -> Schedule:
        """Build the policy, restore it from the latest checkpoint, make the replicas serve it."""

    async def before_step(self) -> Context | None:
        """Called before each step, outside its span: the online recipe waits here for
        feedback (idle time is no stage), the asynchronous one starts sampling ahead. Returns
        the trace context the step's span continues (None: a trace of its own)."""
        return None

    @abstractmethod
    async def step(self, step: int) -> Any | None:
        """One training step, inside its span: its record (a dataclass with `step`, `version`
        and `stage_seconds`), or None when it trained nothing worth a line (the step does not
        count)."""

    @abstractmethod
    async def save(self) -> None:
        """Checkpoint what the steps so far trained, with what a resume needs to continue
        right after them. Also called after a stop, while a step was under way."""

    async def evaluate(self, step: int) -> dict:
        """The held-out evaluation at `step` (`Schedule.evaluate`): its line for metrics.jsonl."""
        raise NotImplementedError(f"the {self.name} recipe schedules evaluations but has none")

    def progress(self, record) -> str:
        """The progress bar's text after a step."""
        return ""

    @abstractmethod
    async def close(self) -> None:
        """Stop what runs beside the steps. Called once the steps end, fail or are cancelled,
        before the final evaluation."""

    @abstractmethod
    def summary(self, records: list) -> dict:
        """The run's summary (summary.json) from this run's step records."""


async def run_recipe(recipe: Recipe, run_dir: Path, *, progress: bool = True,
                     on_step: Callable[[Any], None] | None = None, tracker=None) -> dict:
    """Run `recipe` in `run_dir`; returns the summary also written to `run_dir/summary.json`.
    `on_step(record)` after each step's checkpoint (the trainer's Status reads it). `tracker`
    (hotloop.tracking; its owner opens and closes it) gets the records, each step's
    throughput and the summary (services/trainer/tracking.py lists what)."""
    from tqdm import tqdm

    from ..tracking import throughput

    run = Run(run_dir, tracker)
    records: list = []
    evaluated: int | None = None  # the step of the last evaluation

    async def evaluate(at: int) -> None:
        nonlocal evaluated
        with _tracer.start_as_current_span("evaluate"):
            line = await recipe.evaluate(at)
        run.write("eval", line)
        evaluated = at

    try:
        try:
            plan = await recipe.setup(run)
            step = plan.first
            saved = True  # whether the last step that ended is checkpointed
            bar = tqdm(total=plan.last, initial=step, desc=recipe.name, unit="step",
                       disable=not progress, dynamic_ncols=True)
            loop_started = time.monotonic()
            try:
                if plan.evaluate:
                    await evaluate(step)
                budget = StepBudget(plan.train_budget_s, plan.run_budget_s, run.started,
                                    time.monotonic() - loop_started)
                loop_started = last_ended = time.monotonic()
                while plan.last is None or step < plan.last:
                    raise_if_cancelled()  # a Ctrl-C that a library swallowed mid-step (hotloop.aio)
                    parent = await recipe.before_step()
                    with _tracer.start_as_current_span(f"{recipe.name}.step", context=parent,
                                                       attributes={"step": step}):
                        rec = await recipe.step(step)
                    if rec is None:
                        continue
                    step += 1
                    records.append(rec)
                    line = asdict(rec)
                    run.write("step", line)
                    now = time.monotonic()
                    run.track("throughput", throughput(line, now - last_ended), rec.step)
                    last_ended = now
                    bar.update()
                    bar.set_postfix_str(recipe.progress(rec))
                    every = plan.checkpoint_every
                    saved = bool(every) and (step % every == 0 or step == plan.last)
                    if saved:
                        await recipe.save()
                    if on_step is not None:
                        on_step(rec)
                    if plan.evaluate and plan.evaluate_every and step % plan.evaluate_every == 0 \
                            and step != plan.last:
                        await evaluate(step)
                    if budget.spent(len(records)):
                        log.warning("%s reached after %d steps (%.0f s of training)", budget.why,
                                    step, budget.took())
                        break
                if not saved:
                    await recipe.save()
            except asyncio.CancelledError:
                await run.halt()
                if plan.checkpoint_every:
                    if not run._holds(recipe.policy.step):
                        await recipe.save()
                    log.warning("interrupted after step %d; checkpoint under %s", step,
                                run.checkpoints)
                raise
            finally:
                run.loop_seconds = time.monotonic() - loop_started
                bar.close()
        finally:
            await recipe.close()
        if plan.evaluate and evaluated != step:
            await evaluate(step)
        summary = recipe.summary(records)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if records:
            run.track("summary", summary, records[-1].step)
        return summary
    finally:
        run._close()


def runner(recipe: Callable[..., Recipe]) -> Callable[..., Awaitable[dict]]:
    """The entry point of a recipe built from a job's sections and a mesh: what runner.py and the
    tests call as `run(job, trainer_cfg, model_dir, mesh, run_dir, progress=True, on_step=None)`."""

    async def run(job, trainer_cfg, model_dir: Path, mesh, run_dir: Path, progress: bool = True,
                  on_step: Callable[[Any], None] | None = None, tracker=None) -> dict:
        """Train; returns the summary written to `run_dir/summary.json`."""
        return await run_recipe(recipe(job, trainer_cfg, model_dir, mesh), run_dir,
                                progress=progress, on_step=on_step, tracker=tracker)

    return run
