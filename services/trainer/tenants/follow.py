"""Keeps a trainer's lineages in step with the tenant registry: the lanes of a multi-tenant
trainer (`RegistryFollower`; all of it with `[online] follow_registry`), and a trainer of one
named lineage (`FollowedLineage`: its hold and its resets).

The gateway's admin API writes the registry (`hotloop.tenants.Registry`: create, reset, delete);
this follows its watch and calls the lanes' lifecycle (lanes.py):
- a record for a name with no lane here: `add_tenant` (a created tenant; or, at start-up, one
  created earlier, whose lane resumes from its checkpoint). A config tenant's record (it only
  carries a reset's generation) starts no lane: config tenants are trained where
  `[online] tenants` lists them. Several trainers that follow the registry split its tenants
  first come, first served: the first to claim a tenant's lineage (`hotloop.leases`) learns it,
  and the others, refused, leave it alone.
- a record whose generation is above the one this process last applied: `reset_tenant`, to
  the base model or to the lineage's version `reset_to` (read from its store; one the store
  does not hold, or that is not an adapter of this policy, is logged and skipped: the admin
  API checked it was there; the other lanes train on).
- every record of a lane here: `hold_tenant(name, record.held)` (the registry's state, so a
  hold made while the trainer was down holds its lane from the start).
- a deleted name with a lane here: the lane is reset first (so every replica's newest version
  of that lineage is the base model, and nothing routes a user to the deleted tenant's
  adapter again), then removed (`remove_tenant`: its consumer deleted, its files moved aside),
  then its versions-KV key (`latest_key`) is deleted, which lets the admin API create the name
  again as a new tenant.

A trainer with `[online] tenants` but without `follow_registry` runs the same follower with
`manage` off: the resets and holds of the lineages it trains by config, nothing else.

The generations applied are kept in `<run_dir>/registry.json` (written atomically after each
reset), so a reset made while the trainer was down is applied when it comes back, and one
already applied is not applied twice. A tenant first seen here starts at its record's
generation: a new lane is already the base model.

Does not own: the registry (hotloop/tenants.py), the lanes and their lifecycle (lanes.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from hotloop.errors import NotFound
from hotloop.leases import LineageTaken

log = logging.getLogger(__name__)


def _to(version: int) -> str:
    return f"its v{version}" if version else "the base model"


async def held_tenants(registry) -> set[str]:
    """The names the registry holds (`TenantRecord.held`): for `Lanes.held` before the lanes
    start, since the follower's replay comes only after the config tenants' lanes consume, and
    one could take an update from its backlog before it."""
    return {r.name for r in await registry.list() if r.held}


class FollowedLineage:
    """A trainer of one named lineage (`[online] tenant`, no lanes) in step with the registry:
    its hold holds the loop (the registry's state is read before the first update), and its
    reset stops the loop, publishes the base model as the lineage's next version
    (`online.reset_lineage`) and starts the loop again from there, as a lane's reset does.

    The generation applied is kept in `<run_dir>/registry.json`, as `RegistryFollower` keeps
    its lanes': a reset made while the trainer was down is applied once the loop started; on a
    first start the resets on record are history. `run()` returns the loop's summary when it
    ends (`max_steps`); a failure of the loop or of the following is raised; cancelled,
    neither task outlives it. `policy`: as built (its adapter is the LoRA init a reset goes
    back to); else built here."""

    def __init__(self, job, trainer_cfg, model_dir: Path, mesh, run_dir: Path, *,
                 on_step=None, policy=None, metrics=None, tracker=None) -> None:
        from ..recipes.online import OnlineMetrics

        self.job, self.cfg, self.model_dir, self.mesh = job, trainer_cfg, model_dir, mesh
        self.run_dir, self.on_step, self.policy = Path(run_dir), on_step, policy
        self.tracker = tracker  # each loop's records go to it too (`run_recipe`)
        self.metrics = metrics if metrics is not None else OnlineMetrics()
        self.state_path = self.run_dir / "registry.json"
        self.applied: dict[str, int] = (json.loads(self.state_path.read_text())
                                        if self.state_path.exists() else {})
        self.held = False
        self.due: tuple[int, int] | None = None  # a reset (generation, to version) seen in
        # the replay, applied once the loop runs
        self.online = None  # the loop (`online.Online`) now, and its task:
        self.recipe = None
        self.resetting = False
        self.adapters = None  # `tenancy.Adapters`: the LoRA init a reset puts back

    async def run(self) -> dict:
        import asyncio

        from ..learner.distributed import make_policy
        from ..learner.tenancy import Adapters

        owned = None
        if self.policy is None:
            self.policy = owned = make_policy(self.cfg, self.model_dir)
        self.adapters = Adapters(self.policy)  # before any restore: it keeps the init
        self.adapters.add(self.job.tenant)
        self.adapters.use(self.job.tenant)
        self._changed = asyncio.Event()  # a reset started the loop again
        self._lock = asyncio.Lock()  # one reset at a time
        ready = asyncio.Event()
        follower = asyncio.create_task(self._follow(ready), name="registry-hold")
        replayed = asyncio.ensure_future(ready.wait())  # the hold as it is, before any update
        try:
            await asyncio.wait([follower, replayed], return_when=asyncio.FIRST_COMPLETED)
            if follower.done():
                follower.result()  # its error
            self._start()
            if self.due is not None:  # reset while this trainer was down
                await self._reset(*self.due)
            while True:
                self._changed.clear()
                changed = asyncio.ensure_future(self._changed.wait())
                waits = [follower, changed] + ([] if self.resetting else [self.recipe])
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                if follower.done():
                    follower.result()  # its error stops the loop; it never ends otherwise
                    raise RuntimeError("the registry's watch ended")
                if not self.resetting and self.recipe.done():
                    return self.recipe.result()
        finally:  # cancelled, failed or done: neither task outlives the call
            await _cancel(follower)  # first: a reset under way there starts the loop again
            await _cancel(replayed)
            await _cancel(self.recipe)
            if owned is not None:
                owned.close()

    def _start(self, lease=None) -> None:
        """Start the loop; `lease`: the lineage's, kept by the loop a reset stopped."""
        import asyncio

        from ..recipes.base import run_recipe
        from ..recipes.online import Online

        self.online = Online(self.job, self.cfg, self.model_dir, self.mesh, self.policy,
                             self.metrics, lease=lease)
        self.online.hold(self.held)
        self.recipe = asyncio.create_task(
            run_recipe(self.online, self.run_dir, progress=False, on_step=self.on_step,
                       tracker=self.tracker),
            name="online-loop")

    async def _follow(self, ready) -> None:
        tenant = self.job.tenant
        async for name, record in self.mesh.registry.watch(ready):
            if name != tenant:
                continue
            self.held = record is not None and record.held
            if self.online is not None:
                self.online.hold(self.held)
            generation = record.generation if record is not None else 0
            known = self.applied.get(tenant)
            if known is None:  # a first start: the resets on record are the lineage's history
                known = generation if not ready.is_set() else 0
                self._save(known)
            if generation <= known:
                continue
            to = record.reset_to if record is not None else 0
            if self.online is None:  # in the replay: once the loop runs (`run`)
                self.due = (generation, to)
            else:
                await self._reset(generation, to)

    async def _reset(self, generation: int, to_version: int = 0) -> None:
        async with self._lock:
            if generation <= self.applied.get(self.job.tenant, 0):
                return  # applied meanwhile
            await self._reset_loop(generation, to_version)

    async def _reset_loop(self, generation: int, to_version: int) -> None:
        import asyncio

        from ..recipes.online import VersionUnusable, read_version, reset_lineage, solo_turn

        params = None
        if to_version:
            try:
                params = read_version(self.policy, self.mesh.publisher.store, to_version)
            except (NotFound, VersionUnusable) as e:  # the gateway checked it was stored;
                # gone since, or not this policy's: the lineage goes on as it was
                log.error("tenant %r: reset (generation %d) to v%d not applied: %s",
                          self.job.tenant, generation, to_version, e)
                self._save(generation)
                self.due = None
                return
        self.resetting = True
        try:
            recipe = self.recipe
            # restored first: the reset keeps its step count (the checkpoint it writes is then
            # the latest) and what its checkpoint had trained
            started = asyncio.ensure_future(self.online.started.wait())
            try:
                await asyncio.wait([started, recipe], return_when=asyncio.FIRST_COMPLETED)
            finally:
                started.cancel()
            self.online.keep_lease()  # held from the stop to the next loop (recipes/online.py)
            recipe.cancel()
            await asyncio.wait([recipe])  # it stops (and closes); its outcome stays on it
            lease = self.online.lease
            if not recipe.cancelled():  # it had ended by itself: `run` reports how
                log.warning("tenant %r: the loop ended before its reset (generation %d)",
                            self.job.tenant, generation)
                if lease is not None:
                    await lease.release()
                return
            try:
                version = await reset_lineage(self.online, self.run_dir, solo_turn,
                                              lambda: self.adapters.reset(self.job.tenant, params))
            except BaseException:
                if lease is not None:
                    await lease.release()
                raise
            self._save(generation)
            self.due = None
            log.info("tenant %r reset (generation %d) to %s: version %d",
                     self.job.tenant, generation, _to(to_version), version)
            self._start(lease)
        finally:
            self.resetting = False
            self._changed.set()

    def _save(self, generation: int) -> None:
        self.applied[self.job.tenant] = generation
        save_applied(self.state_path, self.applied)


async def _cancel(task) -> None:
    """Cancel `task` (None or done: nothing) and wait for it to end."""
    import asyncio

    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def save_applied(path: Path, applied: dict[str, int]) -> None:
    """The generations applied, by tenant, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(applied, sort_keys=True))
    tmp.replace(path)


class RegistryFollower:
    """Applies the registry's changes to `lanes` (a `lanes.Lanes`), in commit order.

    `manage` False (a trainer without `follow_registry`): only the resets and holds of the
    lineages it trains ([online] tenants) are applied; creates and deletes are left to the
    trainers that follow the registry, so a reset or hold through the admin API is never a
    silent no-op for a lineage trained by config."""

    def __init__(self, lanes, registry, bus, state_path: Path, manage: bool = True) -> None:
        self.lanes, self.registry, self.bus = lanes, registry, bus
        self.manage = manage
        self.state_path = Path(state_path)
        self.applied: dict[str, int] = (json.loads(self.state_path.read_text())
                                        if self.state_path.exists() else {})

    async def run(self, ready=None) -> None:
        """Follow the registry until cancelled; `ready` (an asyncio.Event) is set once the
        registry's state at the start has been applied."""
        import asyncio

        ready = ready if ready is not None else asyncio.Event()
        # The watch sets `ready` when it is resumed after its replay's last item, i.e. once
        # that item was applied here: until then every item is the replay.
        async for name, record in self.registry.watch(ready):
            await self.apply(name, record, replay=not ready.is_set())

    async def apply(self, name: str, record, replay: bool = False) -> None:
        """One registry item. `replay`: part of the state at the start (not a change seen
        live): a lane with no generation on record takes the record's as applied, so that a
        first start with `follow_registry` does not reset a config tenant reset long ago."""
        from hotloop.bus import announced_key, latest_key

        from ..recipes.online import VersionUnusable

        lanes = self.lanes
        if not self.manage and name not in lanes.lanes:
            return  # neither created nor deleted here; not a lineage trained here
        if record is None:
            if not self.manage:
                return  # deleted: its lane stays until the config no longer lists it
            if name not in lanes.lanes:
                if name not in self.applied:
                    return  # never trained here
                await lanes.add_tenant(name)  # deleted while this trainer was down
            await lanes.reset_tenant(name)  # the lineage's newest version is the base model
            await lanes.remove_tenant(name)
            await self.bus.kv_delete(latest_key(name))
            await self.bus.kv_delete(announced_key(name))
            self.applied.pop(name, None)
            self._save()
            log.info("tenant %r deleted: its lane is removed and its lineage reset to the base", name)
            return
        added = False
        if name not in lanes.lanes:
            if record.config:
                return  # trained where [online] tenants lists it
            try:
                await lanes.add_tenant(name, held=record.held)
            except LineageTaken as e:  # another trainer following the registry took it first
                log.info("tenant %r: not trained here: %s", name, e)
                return
            added = True
            log.info("tenant %r: a lane for the registry's tenant", name)
        known = self.applied.get(name)
        if known is None:  # nothing applied here yet: a new lane is the base model already
            known = record.generation if (replay or added) else 0
        if record.generation > known:
            try:
                version = await lanes.reset_tenant(name, record.reset_to)
                log.info("tenant %r reset (generation %d) to %s: version %d", name,
                         record.generation, _to(record.reset_to), version)
            except (NotFound, VersionUnusable) as e:  # the gateway checked it was stored;
                # gone since, or not this policy's: read before the lane stopped, it goes on
                log.error("tenant %r: reset (generation %d) to v%d not applied: %s", name,
                          record.generation, record.reset_to, e)
        if self.applied.get(name) != record.generation:
            self.applied[name] = record.generation
            self._save()
        lanes.hold_tenant(name, record.held)

    def _save(self) -> None:
        save_applied(self.state_path, self.applied)
