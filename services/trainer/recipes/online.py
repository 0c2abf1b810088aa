"""The online recipe: user feedback -> join with its traffic -> batch -> (reference) -> LoRA
step -> publish -> checkpoint -> ack.

Reads top to bottom like grpo.py (setup, train, save). The gateway publishes one
`TrafficEvent` per served choice (prompt and completion ids, the serving version's per-token
logprobs) and one `FeedbackEvent` per user rating; this loop consumes FEEDBACK with a durable
pull consumer, looks each feedback's traffic up by subject (`Bus.traffic`), and trains the
LoRA policy with truncated-importance-sampling REINFORCE against a running (EMA) baseline
(`algorithms.tis_reinforce_loss`; docs/architecture.md, "The online loop", says why). Every
update is published as a new version with the same `Publisher` GRPO uses. Each update is one
trace (consume, join, reference, train, pack, publish, checkpoint, ack) whose parent is the
gateway's feedback span, read from the message headers; the other feedback of the batch are
links. The publish span belongs to its update's trace, though it ends during the next update.

Delivery: nothing lost, nothing trained twice.
- A feedback is acked only after the version trained on it is published and a checkpoint lists
  its stream sequence in `trained`; the acks follow that checkpoint.
- Killed before the checkpoint: the restored policy predates the update and the feedback was
  never acked, so JetStream redelivers it (after ack_wait) and it is trained once into the
  restored lineage. A version published from the lost update is superseded: on start the loop
  publishes the restored policy above the highest version the mesh has seen, so serving always
  matches the policy that trains (and staleness is measured against it).
- Killed between checkpoint and ack: the redelivered feedback is in `trained` and is acked
  without training. `trained` is pruned to sequences above the consumer's ack floor (JetStream
  never redelivers at or below it), so it holds about one checkpoint interval of feedback.
- Redelivered while still held (ack_wait shorter than a step): kept once, with the newer
  delivery's handle for the ack.
- An update's publish runs beside the next update's training (most of a push is the replica
  building and swapping the version, not this process computing). Its feedback joins `trained`
  only once the publish returned; the next publish, every checkpoint and the end of the run
  wait for it, so versions go out in order and a checkpoint never holds an unpublished update.
  A publish that fails stops the loop at its next step or while it waits for feedback.
- One trainer per lineage: `setup` claims the lineage's lease (`hotloop.leases`) before it
  restores or publishes anything, and is refused while another live trainer holds it; a
  restart of the same run takes its own lease over at once. Each publish first checks that
  the lease is still this run's.

Rejected feedback is settled at once (it can never train, so acking it loses nothing) and
written to metrics.jsonl with its reason: malformed feedback (score unset, NaN or outside
[-1, 1], empty response id), feedback without a traffic record, and traffic whose lengths do
not match go to the dead-letter subject (`bus.DEAD`) with the reason; stale feedback (served by
a version more than `max_staleness_versions` behind, or more than `max_staleness_s` ago) and
shed feedback are acked and counted.

Hold (`hold(True)`; a multi-tenant trainer's lane follows its tenant's registry record,
`Registry.hold`): the loop takes no update until `hold(False)`. An update under way when the
hold comes finishes and its version lands; then the lineage serves that version, whatever
feedback arrives. The feedback waits in the queue and the stream as under any load (nothing
is acked untrained), and the time held does not count toward its `max_wait_s`: no version was
published meanwhile, so waiting through a hold made it no staler, and on resume the backlog
trains newest first as if it had just arrived (what the updates cannot take within
`max_wait_s` of learning is shed as under any load).

Load: an intake task fetches into a queue of `max_queue` and stops fetching while it is full
(JetStream keeps the rest; the consumer's max_ack_pending bounds what it hands out). Each update
takes the newest queued feedback first, up to `batch_size` feedback and `max_batch_tokens`
tokens, and sheds (acks unused, counts, writes with its reason) what waited in the queue longer
than `max_wait_s`; the newest is always taken. So when feedback arrives faster than the trainer
computes, the queue stays within what arrives in `max_wait_s`, every update stays within its
token bound, and what trains is the freshest feedback, served by the most recent versions (the
importance ratios stay near 1). Which feedback trains depends on when it arrived, never on its
content or length.

Failure policy: errors propagate (a reference that stays down fails the loop after the
clients' bounded retries; un-acked feedback is redelivered to the next run). A replica that
cannot be reached during a publish fails the loop only when no replica took the version: once
it is announced, the replicas that were away catch up from the store (`publish_tolerant`), so
one replica's restart does not stop training. A non-finite loss publishes nothing and
dead-letters its batch, since retraining it would fail the same way.

Metrics: `OnlineMetrics` holds the loop's `Counters` (read into Prometheus when scraped, as
they are written to metrics.jsonl) and observes each update's seconds, per stage and whole, and
each trained feedback's loop: from its arrival at the gateway to its version serving.

Served weights: with `serve_average` > 0 a version is a running average of the trained adapter
(learner/averaging.py), updated in the update's turn before it is packed and checkpointed with
it; 0 publishes the adapter as trained.

Many tenants: one loop trains one lineage. A multi-tenant trainer runs a loop per tenant on one
shared policy (tenants/tenants/lanes.py); every use of the policy here (restore, the colocated reference, train,
pack, checkpoint) is inside the injected `turn`, where that tenant's adapter is swapped in and
the fair share decides whose update runs. Alone, the turn is a no-op (`solo_turn`).

Does not own: the services it talks to, the policy's update math (policy.py, algorithms.py),
the loop around its steps and the stop handling (base.py), the tenants' turns (tenants/tenants/lanes.py), or
the process around it (runner.py, __main__.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import shutil
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram

from hotloop import telemetry
from hotloop.aio import finish, raise_if_cancelled
from hotloop.bus import Bus, BusError, PullConsumer, Received, feedback_subject
from hotloop.clients import ReferenceClient, RolloutClient
from hotloop.errors import FailedPrecondition, InvalidArgument, Unavailable
from hotloop.leases import Holder, LineageLease
from hotloop.metrics import STEP_BUCKETS, StateCollector, counter, gauge
from hotloop.proto.v1 import bus_pb2, common_pb2

from ..config import OnlineConfig, TrainerConfig
from .base import Recipe, Run, Schedule, run_recipe
from .registry import Registered, register
from ..pacing.usersfirst import UsersFirst

if TYPE_CHECKING:
    from ..learner.averaging import PolyakAverage

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)
AVERAGE = "average"  # a checkpoint's subdirectory holding the served average (`serve_average`)
STAGES = ("consume", "join", "reference", "train", "pack", "publish", "checkpoint", "ack")


@dataclass
class OnlineMesh:
    """What the loop talks to."""

    bus: Bus
    publisher: Any  # services.trainer.publish.Publisher
    reference: ReferenceClient | None = None
    rollout: list[RolloutClient] = field(default_factory=list)  # read for their latest version
    # the tenant registry (hotloop.tenants.Registry), whose hold of this lineage `run` applies
    registry: Any = None


@dataclass
class Pending:
    """A fetched feedback, queued or in a batch, until it is acked."""

    msg: Received
    seq: int  # stream sequence: the feedback's identity across redeliveries and restarts
    arrived: float  # monotonic, when it entered the queue (the batch window, the wait metrics)
    waits_from: float = field(init=False)  # monotonic, where its wait toward `max_wait_s`
    # starts: `arrived`, moved on by the time its lineage was held since (`FeedbackQueue.resume`)

    def __post_init__(self) -> None:
        self.waits_from = self.arrived


@dataclass
class Counters:
    received: int = 0
    trained: int = 0
    already_trained: int = 0  # redelivered after a restart; acked without training
    redelivered: int = 0  # redelivered while still held (ack_wait shorter than a step)
    queue_full: int = 0  # times the intake found the queue full and stopped fetching
    dropped: dict[str, int] = field(default_factory=dict)  # acked unused, by reason
    dead_lettered: dict[str, int] = field(default_factory=dict)  # by reason

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


DROP_REASONS = ("stale_version", "stale_age", "shed")  # acked unused
DEAD_REASONS = ("malformed", "missing_traffic", "bad_traffic", "other_tenant", "not_finite")  # dead-lettered


class OnlineMetrics:
    """The online trainer's Prometheus metrics, on `registry` (a private one by default).

    `counters` is the loop's own count (`Online` uses this object's), read when scraped; steps,
    stage seconds, published versions and the loop latency are observed as they happen, once
    per update or per trained feedback, never inside the training step."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = reg = registry if registry is not None else CollectorRegistry()
        self.counters = Counters()
        self.version = 0  # the last version published
        self.queue: FeedbackQueue | None = None  # set by `Online.setup`: fetched, not yet in a batch
        self.held: dict | None = None  # set by `Online.setup`: fetched, not yet acked
        self.steps = PromCounter(
            "hotloop_trainer_steps", "Updates of the online loop, by result: published, or "
            "skipped (a non-finite loss or gradient: nothing published, the batch dead-lettered).",
            ["result"], registry=reg)
        self.step_seconds = Histogram(
            "hotloop_trainer_step_seconds", "Seconds of one update, from its start (the batch "
            "window included) until its publish is under way, or to its checkpoint.",
            buckets=STEP_BUCKETS, registry=reg)
        self.stage_seconds = Histogram(
            "hotloop_trainer_stage_seconds", "Seconds of each stage of an update: consume, "
            "join, reference, turn_wait (a tenant's lane waiting for its share of a trainer "
            "of several tenants), train, pack, publish_wait (for the previous version to land), "
            "publish (beside the next update), commit.", ["stage"],
            buckets=STEP_BUCKETS, registry=reg)
        self.loop_seconds = Histogram(
            "hotloop_trainer_loop_seconds", "Seconds from a trained feedback's arrival at the "
            "gateway to the version trained on it serving on the replicas (the gateway's clock "
            "against the trainer's).", buckets=STEP_BUCKETS, registry=reg)
        self.wait_seconds = Histogram(
            "hotloop_trainer_queue_wait_seconds", "Seconds a trained feedback waited in the "
            "trainer's queue before its update took it.", buckets=STEP_BUCKETS, registry=reg)
        self.published = PromCounter(
            "hotloop_trainer_versions_published", "Versions the loop published (at start, the "
            "restored or initial policy above the mesh's latest, too).", registry=reg)
        StateCollector(self._metric_families, reg)

    def _metric_families(self):
        """Read when scraped, in the endpoint's thread: ints, `len`, and copies of the dicts."""
        c = self.counters
        yield gauge("hotloop_trainer_version", "The last version this trainer published.",
                    self.version)
        yield counter("hotloop_trainer_feedback_received_total",
                      "Feedback fetched from the FEEDBACK stream (a redelivery counts once).",
                      c.received)
        yield counter("hotloop_trainer_feedback_trained_total",
                      "Feedback trained into a published version.", c.trained)
        yield counter("hotloop_trainer_feedback_already_trained_total",
                      "Feedback redelivered after a restart that the checkpoint had trained: "
                      "acked without training.", c.already_trained)
        yield counter("hotloop_trainer_feedback_redelivered_total",
                      "Feedback redelivered while still held (ack_wait shorter than a step).",
                      c.redelivered)
        yield counter("hotloop_trainer_feedback_dropped_total",
                      "Feedback acked without training, by reason: too stale to train on, or "
                      "shed (waited in the queue past max_wait_s).",
                      labels=["reason"],
                      samples=[([r], n) for r, n in {**dict.fromkeys(DROP_REASONS, 0),
                                                     **dict(c.dropped)}.items()])
        yield counter("hotloop_trainer_feedback_dead_lettered_total",
                      "Feedback that can never train, sent to the dead-letter subject, by reason.",
                      labels=["reason"],
                      samples=[([r], n) for r, n in {**dict.fromkeys(DEAD_REASONS, 0),
                                                     **dict(c.dead_lettered)}.items()])
        yield counter("hotloop_trainer_intake_queue_full_total",
                      "Times the intake found its queue full and stopped fetching.", c.queue_full)
        yield gauge("hotloop_trainer_feedback_queued", "Feedback fetched, waiting for a batch.",
                    self.queue.qsize() if self.queue is not None else 0)
        yield gauge("hotloop_trainer_feedback_held", "Feedback fetched and not yet acked.",
                    len(self.held) if self.held is not None else 0)


@dataclass
class OnlineStepRecord:
    step: int  # optimizer steps of the policy, this one included
    version: int
    feedback: int
    seqs: list[int]
    score_mean: float
    baseline: float  # after this batch
    advantage_mean: float
    staleness_versions_max: int
    temperature_mean: float
    stage_seconds: dict[str, float]
    tokens: int
    train: dict[str, float] = field(default_factory=dict)
    counters: dict[str, Any] = field(default_factory=dict)
    queue_depth: int = 0  # left in the queue after this update took its batch
    shed: int = 0  # shed by this update (waited past max_wait_s)
    queue_wait_s: float = 0.0  # the longest a feedback of this batch waited in the queue
    kl_coef: float = 0.0  # the KL coefficient this update trained with (`[online] kl_target`)


# ---- checks on one feedback ----------------------------------------------------------------


def malformed(fb) -> str | None:
    """Why a FeedbackEvent cannot be trained on, or None."""
    if not fb.response_id:
        return "malformed feedback: empty response_id"
    if not fb.HasField("score"):
        return "malformed feedback: score not set"
    if not math.isfinite(fb.score) or not -1.0 <= fb.score <= 1.0:
        return f"malformed feedback: score {fb.score!r} outside [-1, 1]"
    return None


def bad_traffic(tr) -> str | None:
    """Why a TrafficEvent cannot become a training sample, or None."""
    if len(tr.completion_ids) != len(tr.logprobs):
        return (f"bad traffic: {len(tr.completion_ids)} completion ids but "
                f"{len(tr.logprobs)} logprobs")
    if not tr.completion_ids:
        return "bad traffic: empty completion"
    if not tr.prompt_ids:
        return "bad traffic: empty prompt"
    if not all(math.isfinite(x) and x <= 0.0 for x in tr.logprobs):
        return "bad traffic: a behaviour logprob is not a finite value <= 0"
    return None


def served_version(tr) -> int:
    """The oldest version any token of the completion came from (an in-flight update can
    switch versions mid-completion; the oldest token is the stalest)."""
    if tr.version_spans:
        return min(int(s.version) for s in tr.version_spans)
    return int(tr.policy_version)


def stale(tr, version: int, now: float, job: OnlineConfig) -> str | None:
    """"stale_version" / "stale_age" when the feedback is too old to train on, else None."""
    if version - served_version(tr) > job.max_staleness_versions:
        return "stale_version"
    if tr.served_at > 0 and now - tr.served_at > job.max_staleness_s:
        return "stale_age"
    return None


# ---- intake: the bounded queue ---------------------------------------------------------------


class FeedbackQueue:
    """Fetched feedback waiting for an update, in arrival order, at most `maxsize`: the intake
    puts, an update takes the newest first and sheds the oldest (`Online.step`). Both run on
    the event loop, so nothing here locks."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: deque[Pending] = deque()
        self._changed = asyncio.Event()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def free(self) -> int:
        return self.maxsize - len(self._items)

    def put(self, p: Pending) -> None:
        if len(self._items) >= self.maxsize:
            raise OverflowError(f"the feedback queue holds {self.maxsize} already")
        self._items.append(p)
        self._changed.set()

    def oldest(self) -> Pending:
        return self._items[0]

    def newest(self) -> Pending:
        return self._items[-1]

    def pop_newest(self) -> Pending:
        return self._items.pop()

    def shed(self, cutoff: float) -> list[Pending]:
        """Remove and return what began its wait before `cutoff` (monotonic; `waits_from`),
        except the newest."""
        out = []
        while len(self._items) > 1 and self._items[0].waits_from < cutoff:
            out.append(self._items.popleft())
        return out

    def resume(self, held_since: float, now: float) -> None:
        """The lineage was held from `held_since` to `now`: what is queued waited for no
        update meanwhile, so that time does not count toward its wait (what came during the
        hold waits from `now`). The order of `waits_from` stays the queue's."""
        for p in self._items:
            p.waits_from = min(p.waits_from + (now - held_since), now)

    async def changed(self) -> None:
        """Until the next `put`."""
        self._changed.clear()
        await self._changed.wait()


class Intake:
    """Fetches FEEDBACK into a bounded queue; stops fetching while the queue is full.

    Owns the dedup of deliveries: a sequence already in `trained` (a restart's checkpoint) is
    acked at once; one already held gets the newer delivery's handle and is not queued twice.
    """

    def __init__(self, consumer: PullConsumer, queue: FeedbackQueue, held: dict[int, Pending],
                 trained: set[int], counters: Counters, fetch_max: int) -> None:
        self.consumer, self.queue, self.held = consumer, queue, held
        self.trained, self.counters, self.fetch_max = trained, counters, fetch_max

    async def run(self) -> None:
        full = False
        while True:
            # nats-py's fetch can swallow the loop's cancel (hotloop.aio): without this check
            # the task fetched on and a stopping trainer waited out its 10 s bound
            raise_if_cancelled()
            free = self.queue.free()
            if free <= 0:
                if not full:
                    self.counters.queue_full += 1
                full = True
                await asyncio.sleep(0.02)
                continue
            full = False
            for m in await self.consumer.fetch(min(free, self.fetch_max), 1.0):
                seq = m.seq
                # `held` first: a held sequence may be trained but not yet checkpointed, and
                # acking it now could lose it to a crash before the checkpoint.
                if seq in self.held:
                    self.counters.redelivered += 1
                    self.held[seq].msg = m
                elif seq in self.trained:
                    self.counters.already_trained += 1
                    await m.ack()
                else:
                    p = Pending(m, seq, time.monotonic())
                    self.held[seq] = p
                    self.counters.received += 1
                    self.queue.put(p)


async def _wait(queue: FeedbackQueue, intake: asyncio.Task, n: int, timeout: float | None,
                publishing: asyncio.Task | None = None) -> bool:
    """Until `n` feedback are queued (True), or `timeout` passes or `publishing` ends (False).
    An intake that died raises here."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while queue.qsize() < n:
        left = None if deadline is None else deadline - time.monotonic()
        if (left is not None and left <= 0) or (publishing is not None and publishing.done()):
            return False
        put = asyncio.ensure_future(queue.changed())
        watched = {put, intake} | ({publishing} if publishing is not None else set())
        try:
            done, _ = await asyncio.wait(watched, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the loop is stopped here: no waiter left behind
            put.cancel()
        if intake in done:
            intake.result()  # raises the intake's error
            raise RuntimeError("feedback intake stopped")
    return True


async def ack_all(items: list[Pending], bus: Bus) -> None:
    """Ack (the feedback's effect is committed) and flush, so the acks have left when this
    returns."""
    for p in items:
        await p.msg.ack()
    await bus.flush()


# ---- resume ------------------------------------------------------------------------------------


async def mesh_latest(mesh: OnlineMesh) -> int:
    """The highest version the mesh has seen: this run's store, the bus's "latest", replicas.
    A replica that does not answer is left out: a restarted replica holds no version (it
    starts from the base and catches up), so it cannot hold one above the others."""
    from hotloop.bus import latest_key

    tenant = mesh.publisher.tenant  # the lineage this loop trains
    held = mesh.publisher.store.latest()
    seen = [held.version if held is not None else 0]
    kv = await mesh.bus.kv_get(latest_key(tenant), common_pb2.VersionInfo)
    seen.append(kv.version if kv is not None else 0)
    for r in mesh.rollout:
        try:
            status = await r.status()
            seen.append(int(status.latest_version) if not tenant else
                        max((int(t.latest_version) for t in status.tenants if t.tenant == tenant),
                            default=0))
        except Unavailable as e:
            log.warning("left out of the mesh's latest version: %s", e)
    return max(seen)


# ---- the recipe --------------------------------------------------------------------------------


@dataclass
class Grant:
    """What a turn on the policy hands its holder: a training turn says here how many tokens
    its update trained (what the fair share charges; tenants/lanes.py)."""

    tokens: int = 0


@contextlib.asynccontextmanager
async def solo_turn(train: bool = False):
    """The turn of a loop that has its policy to itself: nothing to wait for or swap."""
    yield Grant()


class Online(Recipe):
    """Trains on feedback as it arrives: each step sheds what waited past `max_wait_s`, takes
    the newest queued feedback within its bounds (`take`), joins it with its traffic, trains,
    publishes, and every `checkpoint_interval` updates checkpoints and acks (`save`). `policy`: an already built `LoraPolicy` (tests),
    else built in `setup`; `metrics`: where the loop counts (the service's registry), else a
    private one.

    `turn(train)`: an async context manager around every use of the policy (the restore, the
    initial pack, each update's train and pack, each checkpoint), yielding a `Grant`; a lane
    of a multi-tenant trainer (tenants/tenants/lanes.py) waits there for its fair share and has its tenant's
    adapter swapped in. None: the policy is this loop's alone (`solo_turn`). `users`: the
    process's `UsersFirst`, shared by the lanes and closed by its owner (None: this loop's)."""

    name = "online"

    def __init__(self, job: OnlineConfig, trainer_cfg: TrainerConfig, model_dir: Path,
                 mesh: OnlineMesh, policy=None, metrics: OnlineMetrics | None = None,
                 turn=None, users: UsersFirst | None = None,
                 lease: LineageLease | None = None) -> None:
        """`lease`: the lineage's lease, still held by the loop this one follows (a reset's:
        `keep_lease`); None: `setup` claims it."""
        if trainer_cfg.temperature != 1.0:
            # traffic logprobs are vLLM's raw (T=1) logprobs whatever the user's temperature
            raise SystemExit("online training compares against raw (temperature-1) behaviour logprobs: "
                             f"[trainer] temperature must be 1.0, got {trainer_cfg.temperature}")
        self.job, self.cfg, self.model_dir, self.mesh = job, trainer_cfg, model_dir, mesh
        self.policy = policy
        self.owned = None  # the policy when `setup` built it (closed by `close`)
        self.metrics = metrics if metrics is not None else OnlineMetrics()
        self.counters = self.metrics.counters
        self.turn = turn if turn is not None else solo_turn
        self.owns_users = users is None
        self.users = users if users is not None else UsersFirst(
            job.users_first, mesh.rollout[0].address if mesh.rollout else None, job.max_pause_s)
        self.steps = 0  # optimizer steps of this loop's adapter (the policy's, in its turns)
        self.started = asyncio.Event()  # set once `setup` is done: consuming, its version out
        self.learning = asyncio.Event()  # clear while held (`hold`): no update starts
        self.learning.set()
        self.held_since: float | None = None  # monotonic, while held
        self.queue = FeedbackQueue(job.max_queue)
        self.version = 0
        self.trained: set[int] = set()  # stream sequences trained into the checkpointed policy
        self.held: dict[int, Pending] = {}  # fetched, not yet acked
        self.uncommitted: list[Pending] = []  # trained and published, waiting for a checkpoint and ack
        self.updates = 0
        self.intake: asyncio.Task | None = None
        self.publishing: asyncio.Task | None = None  # the latest update's publish, in flight
        self.lease: LineageLease | None = lease  # this run's hold on its lineage (`setup`)
        self._keep_lease = False  # `cleanup` leaves it held, for the loop that follows
        self.average: PolyakAverage | None = None  # what versions publish (`serve_average`)

    async def setup(self, run: Run) -> Schedule:
        from ..learner.algorithms import AdaptiveKl, EmaBaseline
        from ..learner.averaging import PolyakAverage
        from ..learner.distributed import make_policy

        job, mesh = self.job, self.mesh
        self.run = run
        # one trainer per lineage: refused (LineageTaken) while another live one learns it
        if self.lease is None:
            self.lease = await LineageLease.claim(mesh.bus, job.tenant, Holder.here(str(run.dir)))
        self.lease.check()  # handed over: still this run's
        if self.policy is None:
            self.policy = self.owned = make_policy(self.cfg, self.model_dir)
        self.baseline = EmaBaseline(job.baseline_ema, leave_one_out=job.leave_one_out,
                                    negative_weight=job.negative_weight)
        # kl_beta is the least: a lineage starts at the base, where the KL is ~0 for a while
        self.kl = AdaptiveKl(self.cfg.loss.kl_beta, job.kl_target, job.kl_horizon,
                             floor=self.cfg.loss.kl_beta)
        # an adapter packed by a run that died before its publish stored it: never published
        shutil.rmtree(run.dir / "adapters", ignore_errors=True)
        saved: list[Path] = []  # where the checkpoint keeps the served average, if it does
        async with self.turn(False):
            pos = run.restore(self.policy, extras={AVERAGE: saved.append})
            self.steps = self.policy.step
            if job.serve_average > 0:  # from the restored adapter, unless the checkpoint has one
                self.average = PolyakAverage(job.serve_average, self.policy.trainable_tensors())
                if saved and self.average.load(saved[0]):
                    log.info("resumed the served average (%g)", job.serve_average)
        if pos is not None:
            self.version, self.baseline.value = pos["version"], pos["baseline"]
            if job.kl_target is not None:  # steered: go on from where it was, never under kl_beta
                self.kl.coef = max(self.kl.floor, pos.get("kl_coef", self.kl.coef))
            self.trained = set(pos["trained"])
            log.info("resumed at version %d, %d feedback awaiting ack", self.version, len(self.trained))
        if (seen := await mesh_latest(mesh)) > self.version:
            # Serving runs weights this policy does not have (an update lost in a crash, or another
            # run): publish this policy above them, so serving and staleness refer to it.
            self.version = seen + 1
            async with self.turn(False):
                adapter = self.pack(run.dir / "adapters" / f"v{self.version}")
            await publish_tolerant(mesh, self.version, adapter)
            shutil.rmtree(adapter)
            self.metrics.published.inc()
            log.info("published the %s policy as version %d", "restored" if pos else "initial", self.version)
        elif self.version:
            # Replicas that restarted while no trainer was up serve older weights and may know no
            # address to fetch this one from: tell them (services/rollout/catchup.py).
            await mesh.publisher.reannounce()

        await mesh.bus.ensure_streams()
        in_flight = job.batch_size * job.checkpoint_interval  # trained, waiting for a checkpoint
        self.consumer = await mesh.bus.pull(
            "FEEDBACK", feedback_subject(job.tenant), job.consumer_name, bus_pb2.FeedbackEvent,
            batch=job.batch_size,
            ack_wait_s=job.ack_wait_s, max_ack_pending=job.max_queue + in_flight)
        self.metrics.version, self.metrics.queue, self.metrics.held = self.version, self.queue, self.held
        intake = Intake(self.consumer, self.queue, self.held, self.trained, self.counters, job.batch_size)
        self.intake = asyncio.create_task(intake.run(), name="intake")
        self.users.attach(self.policy.model)  # `pause`: the update holds while users wait for a first token
        self.users.watch()
        self.started.set()
        return Schedule(0, job.max_steps or None, checkpoint_every=0)

    def hold(self, held: bool) -> None:
        """Hold the lineage at its version (no update starts until `hold(False)`), or resume."""
        if held == (not self.learning.is_set()):
            return
        if held:
            self.learning.clear()
            self.held_since = time.monotonic()
        else:
            self.queue.resume(self.held_since, time.monotonic())
            self.held_since = None
            self.learning.set()
        log.info("lineage %r: %s", self.job.tenant,
                 "held (no update starts until it is resumed)" if held else "learning again")

    async def before_step(self) -> Context:
        """Idle until feedback arrives and the lineage is not held (not a stage), or until the
        version in flight fails; the step continues the trace of the newest feedback queued
        then, the first its batch takes."""
        while True:
            while not await _wait(self.queue, self.intake, 1, None, self.publishing):
                await self.landed()  # raises what the publish raised, else clears it
            if self.learning.is_set():
                break
            await self.landed()  # the version in flight lands before the hold holds
            await self.learning.wait()
        self.first = self.queue.newest()
        return telemetry.extract_context(self.first.msg.headers)

    async def step(self, step: int) -> OnlineStepRecord | None:
        import torch

        from ..learner.algorithms import make_online_algorithm
        from ..learner.batching import Sample

        job, mesh, metrics = self.job, self.mesh, self.metrics
        secs: dict[str, float] = {}
        t_step = time.perf_counter()
        root = trace.get_current_span()  # the step's, whose parent is the first feedback's
        t = time.perf_counter()
        with _tracer.start_as_current_span("consume"):
            if job.batch_window_s > 0:  # the window opened when the oldest queued one arrived
                left = self.queue.oldest().arrived + job.batch_window_s - time.monotonic()
                await _wait(self.queue, self.intake, job.batch_size, left)
            started = time.monotonic()
            shed = self.queue.shed(started - job.max_wait_s)
            for p in shed:
                await self.settle(p, "shed", f"waited {started - p.arrived:.1f} s in the trainer's "
                                  f"queue (max_wait_s {job.max_wait_s:g})", dead=False)
        secs["consume"] = time.perf_counter() - t

        t = time.perf_counter()
        joined_at = self.version  # staleness is measured against the version that trains
        with _tracer.start_as_current_span("join"):
            rows, taken = await self.take(job)  # rows: (pending, feedback, traffic)
        secs["join"] = time.perf_counter() - t
        for p in taken:
            if p is not self.first:
                root.add_link(trace.get_current_span(telemetry.extract_context(p.msg.headers))
                              .get_span_context())
        root.set_attribute("hotloop.feedback", len(taken))
        root.set_attribute("hotloop.shed", len(shed))
        if not rows:
            return None
        waited = [started - p.arrived for p, _, _ in rows]

        scores = torch.tensor([fb.score for _, fb, _ in rows], dtype=torch.float32)  # [N]
        adv = self.baseline.advantages(scores)  # [N], against the baseline before this batch
        self.baseline.update(scores)

        pairs = [(list(tr.prompt_ids), list(tr.completion_ids)) for _, _, tr in rows]
        kl = self.cfg.loss.kl_beta > 0
        ref, secs["reference"] = None, 0.0
        if kl and job.reference == "service":  # asked before the turn: the wait overlaps it
            t = time.perf_counter()
            with _tracer.start_as_current_span("reference"):
                ref = await mesh.reference.logprobs(pairs)
            secs["reference"] = time.perf_counter() - t

        t = time.perf_counter()
        adapter = None
        async with self.turn(True) as grant:
            if self.turn is not solo_turn:  # a lane's wait for its fair share (tenants/tenants/lanes.py)
                secs["turn_wait"] = time.perf_counter() - t
            # colocated: the step scores the base itself, in this lane's turn of the shared
            # policy, running the layers below the adapter once for both (`train_step`)
            colocated = kl and job.reference == "colocated"
            samples = [
                Sample(prompt_ids=p, completion_ids=c, old_logprobs=list(tr.logprobs),
                       advantage=float(adv[i]), ref_logprobs=None if ref is None else ref[i])
                for i, ((p, c), (_, _, tr)) in enumerate(zip(pairs, rows))
            ]
            t = time.perf_counter()
            # the objective with this lineage's KL coefficient (the policy may be shared by lanes)
            kl_coef = self.kl.coef
            self.policy.algorithm = make_online_algorithm(self.policy.cfg, is_cap=job.is_cap,
                                                          kl_beta=kl_coef)
            with _tracer.start_as_current_span("train"):
                try:
                    m = await self.run.train(self.policy, samples, reference=colocated)
                except asyncio.CancelledError:
                    await self.run.halt()  # the thread stops before the turn passes on
                    raise
            secs["train"] = time.perf_counter() - t
            if colocated:  # inside the step (no span of its own): the stages stay disjoint
                secs["reference"] = m.extra.get("reference_s", 0.0)
                secs["train"] -= secs["reference"]
            grant.tokens = sum(len(tr.prompt_ids) + len(tr.completion_ids) for _, _, tr in rows)
            self.steps = self.policy.step
            if not m.skipped:  # packed in the same turn: the adapter is this update's
                t = time.perf_counter()
                with _tracer.start_as_current_span("pack"):
                    if self.average is not None:
                        self.average.update(self.policy.trainable_tensors())
                    adapter = self.pack(self.run.dir / "adapters" / f"v{self.version + 1}")
                secs["pack"] = time.perf_counter() - t
        if m.skipped:
            log.warning("update skipped (%s): its %d feedback are dead-lettered", m.skip_reason, len(rows))
            for p, _, _ in rows:
                await self.settle(p, "not_finite", f"training skipped: {m.skip_reason}", dead=True)
            metrics.steps.labels("skipped").inc()
            return None
        if "kl" in m.extra:  # kl_target: the next update's coefficient
            self.kl.update(m.extra["kl"], len(rows))

        t = time.perf_counter()
        await self.landed()  # versions go out in order: the previous one first
        secs["publish_wait"] = time.perf_counter() - t
        self.version += 1
        for w in waited:
            metrics.wait_seconds.observe(w)
        # The push runs beside the next update's training; its "publish" span stays this step's.
        self.publishing = asyncio.create_task(self.publish(self.version, adapter, rows, self.steps),
                                              name=f"publish-v{self.version}")
        self.updates += 1
        t = time.perf_counter()
        if self.updates % job.checkpoint_interval == 0:
            await self.save_whole()
        secs["commit"] = time.perf_counter() - t
        metrics.step_seconds.observe(time.perf_counter() - t_step)
        for stage, seconds in secs.items():
            metrics.stage_seconds.labels(stage).observe(seconds)

        return OnlineStepRecord(
            step=self.steps, version=self.version, feedback=len(rows),
            seqs=[p.seq for p, _, _ in rows], score_mean=float(scores.mean()),
            baseline=self.baseline.value, advantage_mean=float(adv.mean()), kl_coef=kl_coef,
            staleness_versions_max=max(joined_at - served_version(tr) for _, _, tr in rows),
            temperature_mean=statistics.fmean(tr.temperature for _, _, tr in rows),
            stage_seconds=secs, tokens=m.tokens, train=m.as_dict(),
            counters=asdict(self.counters), queue_depth=self.queue.qsize(), shed=len(shed),
            queue_wait_s=max(waited),
        )

    def pack(self, directory: Path) -> Path:
        """Write the version this lineage serves next: the served average (`serve_average`),
        else the adapter as trained. In the policy's turn."""
        return self.policy.save_adapter(
            directory, None if self.average is None else self.average.tensors)

    async def publish(self, version: int, adapter: Path, rows: list[tuple[Pending, Any, Any]],
                      step: int = 0) -> None:
        """Make `version` the mesh's; only then do its feedback count as trained (for the next
        checkpoint, then the ack). Its loop latencies go to metrics.jsonl as a `published`
        record of the update's `step`."""
        t = time.perf_counter()
        self.lease.check()  # another trainer took the lineage over while this one stalled
        await publish_tolerant(self.mesh, version, adapter)  # opens the "publish" span
        served_at = time.time()  # the version serves on the replicas that took it
        shutil.rmtree(adapter)  # the publisher's store keeps the archive
        metrics = self.metrics
        metrics.stage_seconds.labels("publish").observe(time.perf_counter() - t)
        metrics.version = version
        metrics.published.inc()
        metrics.steps.labels("published").inc()
        loops = [max(0.0, served_at - fb.received_at) for _, fb, _ in rows
                 if fb.received_at > 0]  # 0: a gateway that did not say
        for seconds in loops:
            metrics.loop_seconds.observe(seconds)
        if loops:
            self.run.write("published", {"step": step, "version": version, "feedback": len(loops),
                                         "loop_seconds_mean": statistics.fmean(loops),
                                         "loop_seconds_max": max(loops)})
        for p, _, _ in rows:
            self.trained.add(p.seq)
            self.uncommitted.append(p)
        self.counters.trained += len(rows)

    async def landed(self) -> None:
        """Wait for the version in flight to be published; its error is raised here."""
        task, self.publishing = self.publishing, None
        if task is not None:
            await task

    async def take(self, job: OnlineConfig) -> tuple[list[tuple[Pending, Any, Any]], list[Pending]]:
        """The update's batch, newest first: feedback joined with its traffic until it holds
        `batch_size` of them or `max_batch_tokens` tokens (the one that crosses the bound
        included); the ones that cannot train are settled on the way. Returns (rows, every
        feedback taken off the queue)."""
        rows, taken, tokens = [], [], 0
        now = time.time()
        while (not self.queue.empty() and len(rows) < job.batch_size
               and (job.max_batch_tokens is None or tokens < job.max_batch_tokens)):
            p = self.queue.pop_newest()
            taken.append(p)
            if (row := await self.join(p, now)) is not None:
                rows.append(row)
                tokens += len(row[2].prompt_ids) + len(row[2].completion_ids)
        return rows, taken

    async def join(self, p: Pending, now: float) -> tuple[Pending, Any, Any] | None:
        """The feedback with its traffic record, or None once it is settled (it cannot train)."""
        fb = p.msg.payload
        if (why := malformed(fb)) is not None:
            await self.settle(p, "malformed", why, dead=True)
            return None
        try:
            tr = await self.mesh.bus.traffic(fb.response_id, fb.choice)
        except BusError as e:  # a response id that cannot be a subject
            await self.settle(p, "malformed", f"malformed feedback: {e}", dead=True)
            return None
        if tr is None:
            await self.settle(p, "missing_traffic", f"no traffic record for "
                              f"{fb.response_id}:{fb.choice} (never served or aged out)", dead=True)
        elif (why := bad_traffic(tr)) is not None:
            await self.settle(p, "bad_traffic", why, dead=True)
        elif not fb.tenant == tr.tenant == self.job.tenant:
            # the subject carried it here, but the records name another tenant: one tenant's
            # feedback never trains another's adapter, whatever put it on this subject
            await self.settle(p, "other_tenant", f"feedback of tenant {fb.tenant!r} on traffic of "
                              f"tenant {tr.tenant!r}; this trainer's is {self.job.tenant!r}", dead=True)
        elif (kind := stale(tr, self.version, now, self.job)) is not None:
            await self.settle(p, kind, f"served by v{served_version(tr)} "
                              f"{now - tr.served_at:.0f}s ago; trainer at v{self.version}", dead=False)
        else:
            return p, fb, tr
        return None

    async def settle(self, p: Pending, kind: str, reason: str, dead: bool) -> None:
        """Finish a feedback that will never train: dead letter (then ack) or ack."""
        if dead:
            await self.consumer.dead_letter(p.msg.raw, reason)
            self.counters.count(self.counters.dead_lettered, kind)
        else:
            await p.msg.ack()
            self.counters.count(self.counters.dropped, kind)
        self.held.pop(p.seq, None)
        self.run.write("settled", {"seq": p.seq, "kind": kind, "reason": reason})

    async def save(self) -> None:
        """Checkpoint (with the trained set), then ack what it covers. A stop saves nothing:
        what was not acked is redelivered to the next run. The version in flight lands first:
        a checkpoint never holds an update that is not published."""
        from ..learner.checkpoint import prune_checkpoints

        await self.landed()
        if not self.uncommitted:
            return
        with _tracer.start_as_current_span("checkpoint"):
            floor = await self.consumer.ack_floor()
            self.trained.difference_update({s for s in self.trained if s <= floor})  # never redelivered
            async with self.turn(False):
                self.policy.save_checkpoint(self.run.checkpoints, data_position={
                    "version": self.version, "baseline": self.baseline.value,
                    "kl_coef": self.kl.coef, "trained": sorted(self.trained)},
                    extras=None if self.average is None else {AVERAGE: self.average.save})
            prune_checkpoints(self.run.checkpoints, self.job.keep_checkpoints)
        with _tracer.start_as_current_span("ack"):
            await ack_all(self.uncommitted, self.mesh.bus)
        for p in self.uncommitted:
            self.held.pop(p.seq, None)
        self.uncommitted.clear()

    async def save_whole(self) -> None:
        """`save`, finished even when a stop arrives during it, so the acks it sends are always
        followed by the record of the step they belong to; the stop then goes on after that
        step (at the runner's next await)."""
        saving = asyncio.ensure_future(self.save())
        try:
            await finish(saving)  # through every cancel: a stop cancels at its signal and again
        except asyncio.CancelledError:
            if saving.cancelled():
                raise
            saving.result()  # its error, if it failed
            asyncio.current_task().cancel()

    async def close(self) -> None:
        if self.owns_users:
            await self.users.close()
        if self.publishing is not None:  # a stop or a failure: what it carried is not acked
            self.publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.publishing
            self.publishing = None
        if self.intake is not None:
            self.intake.cancel()
            try:
                await self.intake
            except (asyncio.CancelledError, Exception):  # its error, if any, was raised in _wait
                pass
        if getattr(self, "consumer", None) is not None:  # what it held goes to the next run
            with contextlib.suppress(Exception):  # the bus gone or reconnecting: the same
                await self.consumer.close()
        if self.owned is not None:  # a policy it built: stop its other data-parallel ranks
            self.owned.close()
        if self.lease is not None and not self._keep_lease:  # last: nothing publishes after it
            await self.lease.release()
            self.lease = None

    def keep_lease(self) -> None:
        """Stop without giving the lineage's lease up: it stays held (and renewed) in
        `self.lease` for the loop that follows on the same lineage (`reset_lineage` publishes
        under it, then the next `Online` takes it). Released, another trainer could claim the
        lineage between the two loops and publish versions of its own beside the reset's."""
        self._keep_lease = True

    def summary(self, records: list[OnlineStepRecord]) -> dict:
        return {"steps": self.steps, "updates": self.updates, "version": self.version,
                "baseline": self.baseline.value, "counters": asdict(self.counters)}


async def run(job: OnlineConfig, trainer_cfg: TrainerConfig, model_dir: Path, mesh: OnlineMesh,
              run_dir: Path, on_step=None, policy=None, metrics: OnlineMetrics | None = None,
              tracker=None) -> dict:
    """Train from feedback until `job.max_steps` updates (0: until cancelled); returns a summary
    (counters, last version). `policy`, `metrics`: as `Online`. With `mesh.registry`, the
    lineage follows the registry (tenants/follow.py, `FollowedLineage`): its hold holds the loop (read
    before the first update), its reset starts the lineage over from the base model.
    `tracker`: the records go to it too (`run_recipe`)."""
    if mesh.registry is None:
        online = Online(job, trainer_cfg, model_dir, mesh, policy, metrics)
        return await run_recipe(online, run_dir, progress=False, on_step=on_step, tracker=tracker)
    from ..tenants.follow import FollowedLineage

    return await FollowedLineage(job, trainer_cfg, model_dir, mesh, run_dir, on_step=on_step,
                                 policy=policy, metrics=metrics, tracker=tracker).run()


class VersionUnusable(FailedPrecondition):
    """A stored version that is not an adapter of this policy (`read_version`)."""


def read_version(policy, store, version: int) -> list:
    """The tensors of `version` of a lineage, from its trainer's store (`VersionStore`), in
    the policy's order: what a reset to that version puts back. NotFound: not stored;
    VersionUnusable: stored, but not an adapter of this policy's shape (another run's
    LoRA settings, a damaged archive). Either way nothing has changed yet: the caller leaves
    the lineage as it is."""
    from hotloop.adapters import read_archive

    store.get(version)  # NotFound, with the reason
    try:
        return policy.read_adapter(read_archive(store.archive(version)))
    except (ValueError, InvalidArgument) as e:
        raise VersionUnusable(f"v{version} in the store is not an adapter of this "
                              f"policy: {e}") from e


async def reset_lineage(online: Online, directory: Path, turn, fresh: Callable[[], None]) -> int:
    """Back to the base, for a loop that was stopped (`online`, on `directory`): `fresh()`, in a
    `turn()` of the policy, puts the LoRA init and no optimizer state into it; that adapter
    is published as a version above the lineage's latest and checkpointed with what the loop
    had trained and checkpointed (the rest was never acked: it is redelivered), so the loop
    started again on `directory` goes on from the base. Returns the version."""
    from ..learner.checkpoint import prune_checkpoints

    mesh, policy = online.mesh, online.policy
    if online.lease is not None:  # kept through the stop (`keep_lease`)
        online.lease.check()
    trained = online.trained - {p.seq for p in online.uncommitted}
    version = await mesh_latest(mesh) + 1
    async with turn():
        fresh()
        adapter = policy.save_adapter(directory / "adapters" / f"v{version}")
    await publish_tolerant(mesh, version, adapter)
    shutil.rmtree(adapter)
    online.metrics.published.inc()
    online.metrics.version = version
    async with turn():
        policy.save_checkpoint(directory / "checkpoints", data_position={
            "version": version, "baseline": 0.0, "trained": sorted(trained)})
        prune_checkpoints(directory / "checkpoints", online.job.keep_checkpoints)
    return version


async def publish_tolerant(mesh: OnlineMesh, version: int, adapter: Path) -> None:
    """Publish; a replica that could not be reached does not stop training once the version
    is announced (live on another replica): it catches up from the announcement and the
    store when it is back. A refusal, or a version no replica took, still raises."""
    from ..publish import PublishError, ReplicaUnavailable

    try:
        await mesh.publisher.publish(version, adapter)
    except PublishError as e:
        if not e.result.announced or not all(
                isinstance(f, ReplicaUnavailable) for f in e.failures.values()):
            raise
        log.warning("%s; training goes on (the replicas that were away catch up)", e)


# The runner's online path runs it (`runner.run_online_job`: `run` here, or a lane per tenant).
register(Registered(
    "online", "learn from user feedback on the bus ([online]); runs until Ctrl-C", OnlineConfig,
    kind="online"))
