"""Tenants: many adapter lineages served by one engine at once, each request by its own
tenant's version, in the same batch.

Owns: the label a request carries to the engine, and the residency of tenants'
versions in the engine (`TenantSlots`): which versions are loaded, loading on demand, evicting
the least recently used one that no running request holds, and waiting (bounded) when every
slot is held. A request holds its version's slot from admission to its end, so the version it
started on serves every token it produces, and a slot is never reloaded under it.

Two ways, chosen by `core.make_updater` with the update mode:
- `WorkerSlots` (CPU, merged mode): `tenant_slots` slots inside the worker
  (services/rollout/updates/slots.py): the packed base GEMM once per layer, then a low-rank
  term per slot over its own requests' rows. Each request names its adapter by label in
  `SamplingParams.extra_args`; the worker maps rows to slots from those labels every step.
- `LoraSlots` (lora mode, CUDA): one vLLM `LoRARequest` per (tenant, version); vLLM's own
  slots (max_loras per batch, an LRU of max_cpu_loras) do the residency.
Elsewhere (merged mode on a GPU, or `tenant_slots = 0`) `NoSlots` refuses tenants clearly.

Also owns the slots' metrics (`SlotMetrics`, on the core's registry): loads into a slot by
result and their seconds, evictions, waits for a slot and refusals, and what is resident (count
and bytes), with the same numbers as a plain `stats()` snapshot for a benchmark in the process.
`WorkerSlots` feeds them; in lora mode vLLM keeps its own residency and they stay at zero.

Plain asyncio; no gRPC.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hotloop import adapters
from hotloop.errors import FailedPrecondition, ResourceExhausted
from hotloop.metrics import LATENCY_BUCKETS
from hotloop.tenants import TenantId

BASE = "@base"  # the label of a request served by the load-time base weights
LABEL_KEY = "hotloop_adapter"  # SamplingParams.extra_args key that names a request's adapter


def label(tenant: TenantId, version: int) -> str:
    return f"{tenant}@v{version}"


@dataclass(frozen=True)
class Lease:
    """What a request on one tenant version carries to the engine."""

    label: str
    lora_request: object | None = None
    extra_args: dict | None = None


class SlotMetrics:
    """What the slots count as it happens, as Prometheus metrics on `registry` (the core's; a
    private one by default) and as plain numbers (`stats()`), updated together."""

    KEEP_LOADS = 10_000  # load durations kept for `stats()` (the newest)

    def __init__(self, registry: CollectorRegistry | None = None):
        registry = registry if registry is not None else CollectorRegistry()
        self._load_seconds = Histogram(
            "hotloop_rollout_tenant_slot_load_seconds", "Seconds to load a tenant's adapter "
            "version into a slot in the worker (read, build, between two engine steps), by "
            "result (ok, failed); its _count is the number of loads.", ["result"],
            buckets=LATENCY_BUCKETS, registry=registry)
        self._evictions = Counter(
            "hotloop_rollout_tenant_slot_evictions", "Resident adapter versions replaced by "
            "another one (the least recently used one no request held); retired versions "
            "freed are not counted.", registry=registry)
        self._wait_seconds = Histogram(
            "hotloop_rollout_tenant_slot_wait_seconds", "Seconds a tenant's request waited for "
            "a slot while every slot was held by running requests of other versions (requests "
            "that waited only, refused ones too).", buckets=LATENCY_BUCKETS, registry=registry)
        self._refusals = Counter(
            "hotloop_rollout_tenant_slot_refusals", "Tenants' requests refused with "
            "RESOURCE_EXHAUSTED after waiting tenant_slot_wait_s for a slot.", registry=registry)
        self._resident = Gauge(
            "hotloop_rollout_tenant_resident_adapters", "Tenants' adapter versions resident in "
            "slots.", registry=registry)
        self._resident_bytes = Gauge(
            "hotloop_rollout_tenant_resident_adapter_bytes", "Bytes of the resident adapters' "
            "factors in the worker.", registry=registry)
        self.loads = {"ok": 0, "failed": 0}
        self.load_s: deque[float] = deque(maxlen=self.KEEP_LOADS)  # ok loads, oldest first
        self.evictions = 0
        self.waits = 0
        self.wait_s = 0.0
        self.refusals = 0
        self.resident = 0
        self.resident_bytes = 0

    def loaded(self, result: str, seconds: float) -> None:
        self.loads[result] = self.loads.get(result, 0) + 1
        self._load_seconds.labels(result).observe(seconds)
        if result == "ok":
            self.load_s.append(seconds)

    def evicted(self) -> None:
        self.evictions += 1
        self._evictions.inc()

    def waited(self, seconds: float, refused: bool) -> None:
        self.waits += 1
        self.wait_s += seconds
        self._wait_seconds.observe(seconds)
        if refused:
            self.refusals += 1
            self._refusals.inc()

    def set_resident(self, count: int, nbytes: int) -> None:
        self.resident, self.resident_bytes = count, nbytes
        self._resident.set(count)
        self._resident_bytes.set(nbytes)

    def stats(self) -> dict:
        """A snapshot: counts since start, the ok loads' seconds (newest `KEEP_LOADS`), and
        what is resident now."""
        return {"loads": self.loads.get("ok", 0), "failed_loads": self.loads.get("failed", 0),
                "load_s": list(self.load_s),
                "load_p50_s": statistics.median(self.load_s) if self.load_s else None,
                "evictions": self.evictions, "waits": self.waits, "wait_s": self.wait_s,
                "refusals": self.refusals, "resident_adapters": self.resident,
                "resident_bytes": self.resident_bytes}


class TenantSlots(ABC):
    """Residency of tenants' versions in the engine."""

    metrics: SlotMetrics | None = None

    async def init(self) -> None:
        """Called once the engine runs."""

    async def prepare(self, tenant: TenantId, version: int, archive: Path) -> None:
        """A version was stored at `archive`; make it loadable. Default: nothing (loaded on
        demand)."""

    @abstractmethod
    async def acquire(self, tenant: TenantId, version: int, archive: Path | None) -> Lease:
        """Hold `version` of `tenant` resident until `release` (version 0: the base model)."""

    async def release(self, lease: Lease) -> None:
        """A request on `lease` ended."""

    async def forget(self, tenant: TenantId, version: int) -> None:
        """The version is retired: nothing holds it; free what it used."""

    def status(self) -> dict:
        return {}

    def stats(self) -> dict:
        """`SlotMetrics.stats()` of these slots (zeros where the engine keeps residency)."""
        return (self.metrics or SlotMetrics()).stats()


class NoSlots(TenantSlots):
    def __init__(self, why: str):
        self.why = why

    async def prepare(self, tenant: TenantId, version: int, archive: Path) -> None:
        raise FailedPrecondition(self.why)

    async def acquire(self, tenant: TenantId, version: int, archive: Path | None) -> Lease:
        raise FailedPrecondition(self.why)


class _Waiter:
    """A request's place in the line for a slot."""

    __slots__ = ("seeking",)

    def __init__(self) -> None:
        self.seeking = False  # its version is not resident: it needs a slot


@dataclass
class _Slot:
    label: str | None = None
    refs: int = 0
    used: int = 0  # LRU clock of the last acquire or release
    loading: bool = False
    nbytes: int = 0  # the loaded adapter's factors in the worker (its load report)
    drained_for: _Waiter | None = None  # the waiter it drains for: no later request holds it


class WorkerSlots(TenantSlots):
    """`n` adapter slots in the CPU worker, filled on demand, least recently used evicted.

    Fair under steady load: a version that needs a slot while every slot is held waits in
    line (first come, first served among the waiters), and once it has waited `drain_after_s`
    marks the resident version it will replace (the one with the fewest requests running, then
    the least recently used) as draining: that version's running requests finish, its new ones
    wait in line behind, and the slot goes to the first waiter that needs one. Without the
    mark, tenants whose users keep a request running at every moment would hold their slots
    for ever, and a quiet tenant's users would be refused after `wait_s` however long it
    waited. Marking at once cost the busy tenants' tail instead (`hotloop bench tenants`, 16
    tenants, 8 users: TTFT p99 9.2 s against 5.3 s), so the mark waits while slots turn over by
    themselves."""

    def __init__(self, engine, n: int, wait_s: float, metrics: SlotMetrics | None = None,
                 drain_after_s: float | None = None):
        """`drain_after_s`: how long a request waits for a slot before it marks a version to
        replace (default a quarter of `wait_s`); until then resident versions keep admitting
        their requests, which is what keeps a busy tenant's tail latency low when slots turn
        over by themselves."""
        self.engine = engine
        self.wait_s = wait_s
        self.drain_after_s = wait_s / 4 if drain_after_s is None else drain_after_s
        self.metrics = metrics if metrics is not None else SlotMetrics()
        self.slots = [_Slot() for _ in range(n)]
        self._cond = asyncio.Condition()
        self._line: list[_Waiter] = []  # requests waiting, first come first
        self._clock = 0
        self.loads = 0  # adapters loaded into a slot (evictions included), for tests and status

    async def init(self) -> None:
        await self.engine.collective_rpc("hotloop_slots_init", args=(len(self.slots),))

    async def acquire(self, tenant: TenantId, version: int, archive: Path | None) -> Lease:
        if version == 0:
            return Lease(BASE, extra_args={LABEL_KEY: BASE})
        name = label(tenant, version)
        lease = Lease(name, extra_args={LABEL_KEY: name})
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + self.wait_s
        waited = False  # for a slot (every one held), not for a load of this version
        me = _Waiter()  # this request's place in the line, while it waits
        async with self._cond:
            try:
                while True:
                    k = next((i for i, s in enumerate(self.slots) if s.label == name), None)
                    me.seeking = k is None
                    if k is not None and not self.slots[k].loading:
                        if self._ahead(me, self.slots[k].drained_for):
                            self._hold(k)
                            if waited:
                                self.metrics.waited(loop.time() - t0, refused=False)
                            return lease
                        # resident but going, for a waiter ahead: wait in line behind it
                        if me not in self._line:
                            self._line.append(me)
                        waited = True
                    elif k is None:
                        if me not in self._line:
                            self._line.append(me)
                        first = next(w for w in self._line if w.seeking)
                        k = self._victim() if first is me else None
                        if k is not None:
                            break
                        if loop.time() - t0 >= self.drain_after_s:
                            self._mark_victim(me)
                        waited = True
                    left = deadline - loop.time()
                    if left <= 0:
                        self.metrics.waited(loop.time() - t0, refused=True)
                        # the resident labels (other tenants' names) are the operator's, in
                        # `status()`: this message goes back towards the request's user
                        raise ResourceExhausted(
                            f"all {len(self.slots)} adapter slots are held by running requests "
                            f"of other versions; {name} waited {self.wait_s:g}s for one "
                            "(raise [rollout] tenant_slots)")
                    patience = t0 + self.drain_after_s - loop.time()  # then it marks one
                    try:
                        await asyncio.wait_for(self._cond.wait(),
                                               min(left, patience) if patience > 0 else left)
                    except TimeoutError:
                        pass  # the loop marks a slot, or raises with the reason
            finally:  # leaving the line (a slot, a refusal, a cancel): what it marked is free
                if me in self._line:
                    self._line.remove(me)
                    for s in self.slots:
                        if s.drained_for is me:
                            s.drained_for = None
                    self._cond.notify_all()
            if waited:
                self.metrics.waited(loop.time() - t0, refused=False)
            slot = self.slots[k]
            if slot.label is not None:
                self.metrics.evicted()
            slot.label, slot.loading, slot.drained_for = name, True, None
        # Shielded: a caller that goes away mid-load leaves a loaded slot (released when the
        # load ends), never a slot whose worker state differs from this table.
        task = asyncio.ensure_future(self._load(k, name, archive))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            def undo(t: asyncio.Task) -> None:
                if not t.cancelled() and t.exception() is None:
                    asyncio.ensure_future(self.release(lease))

            task.add_done_callback(undo)
            raise
        return lease

    def _hold(self, k: int) -> None:
        self._clock += 1
        self.slots[k].refs += 1
        self.slots[k].used = self._clock

    def _ahead(self, me: _Waiter, drainer: _Waiter | None) -> bool:
        """Whether `me` may hold a slot that drains for `drainer`: none does, or `me` waited in
        line before it (its version became resident while it waited: held back behind a later
        waiter it would wait for ever, since the first waiter seeking a slot goes first)."""
        if drainer is None:
            return True
        line = self._line
        return me in line and drainer in line and line.index(me) < line.index(drainer)

    def _victim(self) -> int | None:
        """An empty slot, else the least recently used one no request holds (one draining
        for a waiter first: it was chosen to go)."""
        free = [i for i, s in enumerate(self.slots) if s.refs == 0 and not s.loading]
        if not free:
            return None
        return min(free, key=lambda i: (self.slots[i].label is not None,
                                         self.slots[i].drained_for is None, self.slots[i].used))

    def _mark_victim(self, me: _Waiter) -> None:
        """Make sure `me` has a slot draining for it, if one can: the resident one with the
        fewest requests running, then the least recently used, not draining for another."""
        if any(s.drained_for is me for s in self.slots):
            return
        open_ = [i for i, s in enumerate(self.slots)
                 if s.label is not None and not s.loading and s.drained_for is None]
        if open_:
            k = min(open_, key=lambda i: (self.slots[i].refs, self.slots[i].used))
            self.slots[k].drained_for = me

    async def _load(self, k: int, name: str, archive: Path | None) -> None:
        t0 = time.perf_counter()
        try:
            (report,) = await self.engine.collective_rpc(
                "hotloop_slot_load", args=(k, name, str(archive)))
        except BaseException:
            self.metrics.loaded("failed", time.perf_counter() - t0)
            async with self._cond:
                self.slots[k].label = None
                self.slots[k].loading = False
                self.slots[k].nbytes = 0
                self._resident_changed()
                self._cond.notify_all()
            raise
        self.metrics.loaded("ok", time.perf_counter() - t0)
        async with self._cond:
            self.slots[k].loading = False
            self.slots[k].nbytes = int((report or {}).get("bytes", 0))
            self._hold(k)  # held by the request that loaded it before anyone can evict it
            self.loads += 1
            self._resident_changed()
            self._cond.notify_all()

    def _resident_changed(self) -> None:
        loaded = [s for s in self.slots if s.label is not None and not s.loading]
        self.metrics.set_resident(len(loaded), sum(s.nbytes for s in loaded))

    async def release(self, lease: Lease) -> None:
        if lease.label == BASE:
            return
        async with self._cond:
            for s in self.slots:
                if s.label == lease.label:
                    s.refs -= 1
                    self._clock += 1
                    s.used = self._clock
            self._cond.notify_all()

    async def forget(self, tenant: TenantId, version: int) -> None:
        name = label(tenant, version)
        async with self._cond:
            ks = [i for i, s in enumerate(self.slots) if s.label == name and s.refs == 0
                  and not s.loading]
            for k in ks:
                self.slots[k].label = None
                self.slots[k].nbytes = 0
                self.slots[k].drained_for = None
            self._resident_changed()
            self._cond.notify_all()  # an empty slot: the line may go on
        for k in ks:
            await self.engine.collective_rpc("hotloop_slot_free", args=(k,))

    def status(self) -> dict:
        return {"slots": len(self.slots), "resident": [s.label for s in self.slots],
                "held": [s.refs for s in self.slots], "loads": self.loads}


class LoraSlots(TenantSlots):
    """One vLLM LoRARequest per (tenant, version); vLLM loads and evicts them itself."""

    FIRST_ID = 1 << 30  # the default lineage's LoRA ids are its version numbers

    def __init__(self, engine):
        self.engine = engine
        self._requests: dict[str, object] = {}
        self._next_id = self.FIRST_ID

    async def prepare(self, tenant: TenantId, version: int, archive: Path) -> None:
        from vllm.lora.request import LoRARequest

        peft = await asyncio.to_thread(adapters.unpack, archive, archive.parent / "peft")
        name = label(tenant, version)
        self._requests[name] = LoRARequest(name, self._next_id, str(peft))
        self._next_id += 1

    async def acquire(self, tenant: TenantId, version: int, archive: Path | None) -> Lease:
        if version == 0:
            return Lease(BASE)
        name = label(tenant, version)
        return Lease(name, lora_request=self._requests[name])

    async def forget(self, tenant: TenantId, version: int) -> None:
        req = self._requests.pop(label(tenant, version), None)
        if req is not None:
            await self.engine.remove_lora(req.lora_int_id)

    def status(self) -> dict:
        return {"lora_requests": sorted(self._requests)}
