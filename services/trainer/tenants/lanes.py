"""One online trainer process for many tenants (`[online] tenants`): a lane per tenant, all
time-sharing one base model.

A lane is an `Online` loop (recipes/online.py) with everything of its own: its adapter and AdamW state
(swapped into the shared `LoraPolicy` for its turns: learner/tenancy.py), step count, EMA
baseline, version counter, durable consumer (`<durable>-<tenant>`), feedback queue, publisher
(`Publisher(tenant=...)`) and run directory: `<run_dir>/tenants/<tenant>/` (metrics.jsonl,
checkpoints, store), and for the default tenant "" `<run_dir>/` itself, so that a process that
moves from one lineage to several resumes the default lineage where it was. Intake, queue,
join, settle, publishing beside training, acks after the checkpoint and dedupe of redeliveries
are the loop's, unchanged, per lane.

Owns:
- `Turns`: who uses the shared policy now. Every use by a lane (restore, pack, train step,
  checkpoint) is a turn: one at a time, with the lane's tenant swapped in. A training turn goes
  to the tenant that the fair share (fairshare.py: start-time fair queueing on trained prompt
  and completion tokens) picks among those waiting; the other turns are short (a pack or a
  checkpoint, milliseconds; one per update at most) and go first, in arrival order, so an
  update's checkpoint and acks never wait behind another tenant's training.
- `Lanes`: builds the policy (once), the turns and one `UsersFirst` for the process, runs every
  lane concurrently on the event loop and stops them all on a stop (cancellation) or the first
  failure; and the lane lifecycle an admin calls at runtime: `add_tenant`, `reset_tenant`,
  `hold_tenant`, `remove_tenant` (below). Each lane's metrics are on a registry of its own and
  exported on the process's with a `tenant` label (the names stay those of the single-lane
  trainer).

Lifecycle. `add_tenant(t)` starts a lane (it restores the tenant's checkpoint if its directory
has one, publishes above the lineage's latest when serving is ahead of it, and consumes) and
returns once it consumes. `reset_tenant(t)` stops the lane, puts its adapter back at the fresh
LoRA init (B = 0: the base model) with no optimizer state and a fresh baseline, publishes that
as a new version above the lineage's latest (so serving and training agree), checkpoints it,
and starts the lane again from that checkpoint. Feedback the lane had trained but not
checkpointed was never acked: it is redelivered and trained into the reset lineage; what the
previous checkpoint held stays deduplicated. `remove_tenant(t)` stops the lane (un-acked
feedback stays in the stream), deletes its durable consumer, and moves its directory aside
under `<run_dir>/removed/`, so that adding the tenant again starts a new lineage from the
base rather than resuming one whose consumer position is gone. `hold_tenant(t, True)` holds
the lane at its version (`Online.hold`: no update starts until `hold_tenant(t, False)`); the
hold outlives a reset (the reset's base version is what the lineage then holds at).

Does not own: the loop (recipes/online.py), the swap (learner/tenancy.py), the fairness rule (fairshare.py),
connections and the trainer's server (runner.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from hotloop.errors import NotFound
from hotloop.tenants import TenantId

from ..config import OnlineConfig, TrainerConfig
from ..tracking import lane_tracker
from ..recipes.base import run_recipe
from .fairshare import FairShare
from ..recipes.online import Grant, Online, OnlineMesh, OnlineMetrics, read_version, reset_lineage
from ..pacing.usersfirst import UsersFirst

log = logging.getLogger(__name__)


def lane_dir(run_dir: Path, tenant: TenantId) -> Path:
    """A tenant's lane directory: `<run_dir>/tenants/<tenant>`, `<run_dir>` for the default."""
    return Path(run_dir) / "tenants" / tenant if tenant else Path(run_dir)


class Turns:
    """Hands the one shared policy to one lane at a time, with its tenant's adapter swapped in
    (`turn`). Training turns are granted by `FairShare`; short turns go first."""

    def __init__(self, policy) -> None:
        from ..learner.tenancy import Adapters

        self.adapters = Adapters(policy)
        self.fair = FairShare()
        self.holder: str | None = None
        self.grants: list[str] = []  # the tenants of the training turns, in grant order
        self._train: dict[str, asyncio.Future] = {}
        self._short: deque[tuple[str, asyncio.Future]] = deque()

    def add(self, tenant: TenantId) -> None:
        self.adapters.add(tenant)
        self.fair.add(tenant)

    def remove(self, tenant: TenantId) -> None:
        if self.holder == tenant or tenant in self._train:
            raise RuntimeError(f"tenant {tenant!r} still uses the policy")
        self.adapters.remove(tenant)
        self.fair.remove(tenant)

    def of(self, tenant: TenantId) -> Callable[..., Any]:
        """The `turn` of a lane (what `Online` takes)."""
        return lambda train=False: self.turn(tenant, train)

    @contextlib.asynccontextmanager
    async def turn(self, tenant: TenantId, train: bool = False):
        """The policy, `tenant`'s, until the block ends; a training turn reports its tokens on
        the yielded `Grant`, which the fair share charges."""
        fut = asyncio.get_running_loop().create_future()
        if train:
            if tenant in self._train:
                raise RuntimeError(f"tenant {tenant!r} waits for a training turn already")
            self._train[tenant] = fut
            self.fair.ready(tenant)
        else:
            self._short.append((tenant, fut))
        self._dispatch()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as the stop came: pass it on
                self._release(tenant, train, 0)
            elif train:
                self._train.pop(tenant, None)
                self.fair.withdraw(tenant)
            raise
        grant = Grant()
        try:
            self.adapters.use(tenant)
            yield grant
        finally:
            self._release(tenant, train, grant.tokens)

    def _dispatch(self) -> None:
        if self.holder is not None:
            return
        while self._short:
            tenant, fut = self._short.popleft()
            if not fut.done():  # not cancelled while it waited
                self.holder = tenant
                fut.set_result(None)
                return
        if (tenant := self.fair.grant()) is not None:
            self.holder = tenant
            self.grants.append(tenant)
            self._train.pop(tenant).set_result(None)

    def _release(self, tenant: TenantId, train: bool, tokens: int) -> None:
        self.holder = None
        if train:
            self.fair.done(tenant, tokens)
        self._dispatch()


@dataclass
class Lane:
    """One tenant's loop and what it was started with."""

    tenant: TenantId
    dir: Path
    mesh: OnlineMesh
    metrics: OnlineMetrics
    online: Online
    task: asyncio.Task


class Lanes:
    """Every tenant's lane in one process (module docstring). `run()` runs them until they all
    end (`max_steps`), one fails (its error is raised after the others stopped) or it is
    cancelled (all stop; un-acked feedback stays in JetStream).

    `publisher_for(tenant, store_dir)`: a `Publisher` for the tenant's lineage (closed here).
    `policy`: an already built `LoraPolicy` (tests), else built by `run`. `registry`: where
    the lanes' metrics are exported with a `tenant` label (None: not exported).
    `on_step(tenant, record)`: after each update's record, as `online.run`'s. `tracker`
    (hotloop.tracking): each lane's records go to it under its tenant's prefix. `follow`, when
    set before `run`: (lanes) -> a coroutine run beside the lanes (the registry follower,
    follow.py); its failure stops them as a lane's does."""

    def __init__(self, job: OnlineConfig, trainer_cfg: TrainerConfig, model_dir: Path, *,
                 bus, publisher_for: Callable[[str, Path], Any], run_dir: Path,
                 reference=None, rollout: list | None = None, policy=None,
                 registry: CollectorRegistry | None = None,
                 on_step: Callable[[str, Any], None] | None = None, tracker=None) -> None:
        self.job, self.cfg, self.model_dir = job, trainer_cfg, model_dir
        self.tracker = tracker
        self.bus, self.reference, self.rollout = bus, reference, list(rollout or [])
        self.publisher_for, self.run_dir, self.on_step = publisher_for, Path(run_dir), on_step
        self.policy, self.owned = policy, None
        self.lanes: dict[str, Lane] = {}
        self.turns: Turns | None = None
        self.users: UsersFirst | None = None
        self.summaries: dict[TenantId, dict] = {}  # of lanes that ended, by tenant
        self.held: set[str] = set()  # tenants whose lineage is held (`hold_tenant`); set
        # before `run` for the config tenants' lanes to start held
        self._changed = asyncio.Event()
        self._resetting: set[str] = set()  # lanes stopped by a reset, about to start again
        self._ready = asyncio.Event()  # the policy is built: lanes can be added
        self.follow: Callable[[Lanes], Any] | None = None  # (lanes) -> a coroutine run beside them
        if registry is not None:
            registry.register(_ByTenant(self))

    # ---- the process ------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the policy and start a lane per `[online] tenants`; returns once each consumes."""
        from ..learner.distributed import make_policy

        if self.policy is None:
            self.policy = self.owned = make_policy(self.cfg, self.model_dir)
        self.turns = Turns(self.policy)
        job = self.job
        self.users = UsersFirst(job.users_first, self.rollout[0].address if self.rollout else None,
                                job.max_pause_s)
        self._ready.set()
        await asyncio.gather(*(self.add_tenant(t, held=t in self.held) for t in job.lane_tenants))

    async def run(self) -> dict[str, dict]:
        """Start, then run every lane until all end; returns each tenant's summary."""
        follower = None
        try:
            await self.start()
            if self.follow is not None:  # the registry's tenants too (follow.py)
                follower = asyncio.create_task(self.follow(self), name="registry-follower")
            while True:
                self._changed.clear()
                lanes = list(self.lanes.values())
                for task in [lane.task for lane in lanes] + ([follower] if follower else []):
                    if task.done() and not task.cancelled() and task.exception():
                        raise task.exception()
                # a follower that adds lanes keeps the trainer up for the tenants to come; a
                # lane being reset was stopped to start again, not ended
                if lanes and all(lane.task.done() for lane in lanes) and not self._resetting \
                        and (follower is None or not self.job.follow_registry):
                    break
                changed = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait([*(lane.task for lane in lanes if not lane.task.done()),
                                    changed, *([follower] if follower else [])],
                                   return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
            for lane in lanes:
                self.summaries[lane.tenant] = lane.task.result()
            return dict(self.summaries)
        finally:
            if follower is not None:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await follower
            await self.close()

    async def close(self) -> None:
        """Stop every lane (each halts its update and closes), then the shared parts."""
        for lane in list(self.lanes.values()):
            await self._stop(lane)
        for lane in self.lanes.values():
            await lane.mesh.publisher.close()
        if self.users is not None:
            await self.users.close()
        if self.owned is not None:
            self.owned.close()
            self.owned = None

    def store(self, tenant: TenantId):
        """The `VersionStore` of a lineage this process trains (the trainer's FetchAdapter)."""
        lane = self.lanes.get(tenant)
        if lane is None:
            raise NotFound(f"this trainer does not train the lineage of tenant {tenant!r} "
                           f"(it trains {sorted(self.lanes)})")
        return lane.mesh.publisher.store

    def steps(self) -> int:
        """Optimizer steps of every lane together."""
        return sum(lane.online.steps for lane in self.lanes.values())

    # ---- the lifecycle ----------------------------------------------------------------------
    async def add_tenant(self, tenant: TenantId, held: bool = False) -> None:
        """Start `tenant`'s lane, held from the start or not (`held`, which replaces whatever
        `self.held` said of the name); returns once it consumes (its setup's error is raised)."""
        tenant = TenantId(tenant)  # its lane's directory is named after it
        await self._ready.wait()
        if tenant in self.lanes:
            raise ValueError(f"tenant {tenant!r} is trained here already")
        if held:
            self.held.add(tenant)
        else:
            self.held.discard(tenant)
        directory = lane_dir(self.run_dir, tenant)
        mesh = OnlineMesh(self.bus, self.publisher_for(tenant, directory / "store"),
                          self.reference, self.rollout)
        self.turns.add(tenant)
        self._start(tenant, directory, mesh, OnlineMetrics())
        try:
            await self._started(self.lanes[tenant])
        except BaseException:  # it never consumed: gone again, the caller hears why
            self.held.discard(tenant)
            lane = self.lanes.pop(tenant)
            await self._stop(lane)
            self.turns.remove(tenant)
            await mesh.publisher.close()
            raise
        log.info("tenant %r: lane started in %s", tenant, directory)

    async def reset_tenant(self, tenant: TenantId, to_version: int = 0) -> int:
        """Back to the base (or to the lineage's own `to_version`, read from its store): that
        adapter with no optimizer state, published as a new version above the lineage's latest
        and checkpointed, then the lane goes on from there. Returns the version. A version
        the store does not hold is NotFound, one that is not this policy's adapter
        VersionUnusable (recipes/online.py, `read_version`), and the lane goes on untouched."""
        lane = self._lane(tenant)
        params = (read_version(self.policy, lane.mesh.publisher.store, to_version)
                  if to_version else None)
        self._resetting.add(tenant)  # `run` does not take the stopped lane for an ended one
        try:
            lane.online.keep_lease()  # held from the stop to the next loop: no trainer between
            await self._stop(lane)
            lease = lane.online.lease
            try:
                version = await reset_lineage(lane.online, lane.dir,
                                              lambda: self.turns.turn(tenant),
                                              lambda: self.turns.adapters.reset(tenant, params))
            except BaseException:
                if lease is not None:
                    await lease.release()
                raise
            log.info("tenant %r: reset to %s as version %d", tenant,
                     f"its v{to_version}" if to_version else "the base", version)
            self._start(tenant, lane.dir, lane.mesh, lane.metrics, lease=lease)
        finally:
            self._resetting.discard(tenant)
            self._changed.set()
        await self._started(self.lanes[tenant])
        return version

    def hold_tenant(self, tenant: TenantId, held: bool = True) -> None:
        """Hold `tenant`'s lineage at its version, or let it learn again (`held` False)."""
        lane = self._lane(tenant)
        if held:
            self.held.add(tenant)
        else:
            self.held.discard(tenant)
        lane.online.hold(held)

    async def remove_tenant(self, tenant: TenantId) -> Path:
        """Stop the lane, delete its durable consumer (what it had not acked stays in the
        stream), move its directory aside; returns where it went."""
        lane = self._lane(tenant)
        await self._stop(lane)
        del self.lanes[tenant]
        self._changed.set()
        self.held.discard(tenant)
        self.turns.remove(tenant)
        await lane.mesh.publisher.close()
        if (consumer := getattr(lane.online, "consumer", None)) is not None:
            await consumer.delete()
        else:  # stopped before it consumed: the consumer may be there from an earlier run
            await self.bus.delete_consumer("FEEDBACK", self.job.for_tenant(tenant).consumer_name)
        aside = _retire(self.run_dir, tenant)
        log.info("tenant %r: lane removed; its files are in %s", tenant, aside)
        return aside

    # ---- inside ---------------------------------------------------------------------------
    def _lane(self, tenant: TenantId) -> Lane:
        lane = self.lanes.get(tenant)
        if lane is None:
            raise NotFound(f"tenant {tenant!r} is not trained here (trained: {sorted(self.lanes)})")
        return lane

    def _start(self, tenant: TenantId, directory: Path, mesh: OnlineMesh,
               metrics: OnlineMetrics, lease=None) -> None:
        online = Online(self.job.for_tenant(tenant), self.cfg, self.model_dir, mesh,
                        policy=self.policy, metrics=metrics, turn=self.turns.of(tenant),
                        users=self.users, lease=lease)
        online.hold(tenant in self.held)

        def on_step(rec) -> None:
            if self.on_step is not None:
                self.on_step(tenant, rec)

        task = asyncio.create_task(run_recipe(online, directory, progress=False, on_step=on_step,
                                              tracker=lane_tracker(self.tracker, tenant)),
                                   name=f"lane-{tenant or 'default'}")
        self.lanes[tenant] = Lane(tenant, directory, mesh, metrics, online, task)
        self._changed.set()

    async def _started(self, lane: Lane) -> None:
        started = asyncio.ensure_future(lane.online.started.wait())
        try:
            await asyncio.wait([started, lane.task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if not lane.online.started.is_set():
            lane.task.result()  # its error
            raise RuntimeError(f"tenant {lane.tenant!r}: the lane ended before it consumed")

    async def _stop(self, lane: Lane) -> None:
        """Cancel the lane and wait for it (it halts its update, so the policy is free)."""
        if not lane.task.done():
            lane.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await lane.task
        if lane.task.done() and not lane.task.cancelled() and lane.task.exception() is None:
            self.summaries[lane.tenant] = lane.task.result()


_LANE_FILES = ("checkpoints", "store", "adapters", "metrics.jsonl", "summary.json")


def _retire(run_dir: Path, tenant: TenantId) -> Path:
    """Move a removed lane's files to `<run_dir>/removed/<tenant or default>-<time>/`."""
    stem = Path(run_dir) / "removed" / f"{tenant or 'default'}-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, n = stem, 1
    while aside.exists():
        n += 1
        aside = stem.with_name(f"{stem.name}-{n}")
    aside.mkdir(parents=True)
    here = lane_dir(run_dir, tenant)
    for name in _LANE_FILES:
        if (here / name).exists():
            (here / name).rename(aside / name)
    if tenant:
        shutil.rmtree(here, ignore_errors=True)
    return aside


class _ByTenant:
    """The lanes' metrics on the process's registry, each sample with a `tenant` label. Read
    when scraped, in the endpoint's thread: the lanes are read from a copy."""

    def __init__(self, lanes: Lanes) -> None:
        self._lanes = lanes

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.metrics_core import Metric

        families: dict[str, Metric] = {}
        for tenant, lane in list(self._lanes.lanes.items()):
            for fam in lane.metrics.registry.collect():
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples.extend(s._replace(labels={**s.labels, "tenant": tenant})
                                   for s in fam.samples)
        yield from families.values()
