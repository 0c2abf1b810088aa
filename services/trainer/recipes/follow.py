"""Keeps a trainer's lineages in step with the tenant registry: the lanes of a multi-tenant
trainer (`RegistryFollower`; all of it with `[online] follow_registry`), the hold of a trainer
of one named lineage (`follow_hold`).

The gateway's admin API writes the registry (`hotloop.tenants.Registry`: create, reset, delete);
this follows its watch and calls the lanes' lifecycle (lanes.py):
- a record for a name with no lane here: `add_tenant` (a created tenant; or, at start-up, one
  created earlier, whose lane resumes from its checkpoint). A config tenant's record (it only
  carries a reset's generation) starts no lane: config tenants are trained where
  `[online] tenants` lists them. Several trainers that follow the registry split its tenants
  first come, first served: the first to claim a tenant's lineage (`hotloop.leases`) learns it,
  and the others, refused, leave it alone.
- a record whose generation is above the one this process last applied: `reset_tenant`.
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

import json
import logging
import os
from pathlib import Path

from hotloop.leases import LineageTaken

log = logging.getLogger(__name__)


async def held_tenants(registry) -> set[str]:
    """The names the registry holds (`TenantRecord.held`): for `Lanes.held` before the lanes
    start, since the follower's replay comes only after the config tenants' lanes consume, and
    one could take an update from its backlog before it."""
    return {r.name for r in await registry.list() if r.held}


async def follow_hold(online, registry, tenant: str, ready=None) -> None:
    """A trainer of one lineage (`[online] tenant`, no lanes): the registry's hold of it,
    applied to `online` (an `online.Online`) until cancelled; `ready` (an asyncio.Event) is
    set once the registry's state at the start was applied. A reset is not applied here (it
    restarts a lane, and this trainer has none): one made while it runs is logged as an
    error that names the setting that applies it."""
    import asyncio

    ready = ready if ready is not None else asyncio.Event()
    applied: int | None = None
    async for name, record in registry.watch(ready):
        if name != tenant:
            continue
        online.hold(record is not None and record.held)
        generation = record.generation if record is not None else 0
        if applied is None:  # at the start: the resets before it are the lineage's history
            applied = generation if not ready.is_set() else 0
        if generation > applied:
            applied = generation
            log.error("tenant %r was reset through the admin API (generation %d), but this "
                      "trainer trains its lineage alone ([online] tenant) and cannot reset it: "
                      "train it with [online] tenants = [%r] to apply resets", tenant,
                      generation, tenant)


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
            version = await lanes.reset_tenant(name)
            log.info("tenant %r reset (generation %d): the base model is version %d", name,
                     record.generation, version)
        if self.applied.get(name) != record.generation:
            self.applied[name] = record.generation
            self._save()
        lanes.hold_tenant(name, record.held)

    def _save(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(f".{self.state_path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.applied, sort_keys=True))
        tmp.replace(self.state_path)
