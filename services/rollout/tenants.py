"""Tenants: many adapter lineages served by one engine at once, each request by its own
tenant's version, in the same batch.

Owns: tenant names, the label a request carries to the engine, and the residency of tenants'
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

Plain asyncio; no gRPC.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from hotloop import adapters, tenants
from hotloop.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

BASE = "@base"  # the label of a request served by the load-time base weights
LABEL_KEY = "hotloop_adapter"  # SamplingParams.extra_args key that names a request's adapter


def check_tenant(name: str) -> str:
    """`name` if it can name a tenant (`hotloop.tenants`' rule, the gateway's and the bus's
    too); InvalidArgument otherwise. "" is the default lineage."""
    try:
        return tenants.check_tenant(name)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def label(tenant: str, version: int) -> str:
    return f"{tenant}@v{version}"


@dataclass(frozen=True)
class Lease:
    """What a request on one tenant version carries to the engine."""

    label: str
    lora_request: object | None = None
    extra_args: dict | None = None


class TenantSlots(ABC):
    """Residency of tenants' versions in the engine."""

    async def init(self) -> None:
        """Called once the engine runs."""

    async def prepare(self, tenant: str, version: int, archive: Path) -> None:
        """A version was stored at `archive`; make it loadable. Default: nothing (loaded on
        demand)."""

    @abstractmethod
    async def acquire(self, tenant: str, version: int, archive: Path | None) -> Lease:
        """Hold `version` of `tenant` resident until `release` (version 0: the base model)."""

    async def release(self, lease: Lease) -> None:
        """A request on `lease` ended."""

    async def forget(self, tenant: str, version: int) -> None:
        """The version is retired: nothing holds it; free what it used."""

    def status(self) -> dict:
        return {}


class NoSlots(TenantSlots):
    def __init__(self, why: str):
        self.why = why

    async def prepare(self, tenant: str, version: int, archive: Path) -> None:
        raise FailedPrecondition(self.why)

    async def acquire(self, tenant: str, version: int, archive: Path | None) -> Lease:
        raise FailedPrecondition(self.why)


@dataclass
class _Slot:
    label: str | None = None
    refs: int = 0
    used: int = 0  # LRU clock of the last acquire or release
    loading: bool = False


class WorkerSlots(TenantSlots):
    """`n` adapter slots in the CPU worker, filled on demand, least recently used evicted."""

    def __init__(self, engine, n: int, wait_s: float):
        self.engine = engine
        self.wait_s = wait_s
        self.slots = [_Slot() for _ in range(n)]
        self._cond = asyncio.Condition()
        self._clock = 0
        self.loads = 0  # adapters loaded into a slot (evictions included), for tests and status

    async def init(self) -> None:
        await self.engine.collective_rpc("hotloop_slots_init", args=(len(self.slots),))

    async def acquire(self, tenant: str, version: int, archive: Path | None) -> Lease:
        if version == 0:
            return Lease(BASE, extra_args={LABEL_KEY: BASE})
        name = label(tenant, version)
        lease = Lease(name, extra_args={LABEL_KEY: name})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        async with self._cond:
            while True:
                k = next((i for i, s in enumerate(self.slots) if s.label == name), None)
                if k is not None and not self.slots[k].loading:
                    self._hold(k)
                    return lease
                if k is None:
                    k = self._victim()
                    if k is not None:
                        break
                left = deadline - loop.time()
                if left <= 0:
                    raise ResourceExhausted(
                        f"all {len(self.slots)} adapter slots are held by running requests of "
                        f"other versions ({[s.label for s in self.slots]}); {name} waited "
                        f"{self.wait_s:g}s for one (raise [rollout] tenant_slots)")
                try:
                    await asyncio.wait_for(self._cond.wait(), left)
                except TimeoutError:
                    pass  # the loop raises with the reason
            slot = self.slots[k]
            slot.label, slot.loading = name, True
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

    def _victim(self) -> int | None:
        """An empty slot, else the least recently used one no request holds."""
        free = [i for i, s in enumerate(self.slots) if s.refs == 0 and not s.loading]
        if not free:
            return None
        return min(free, key=lambda i: (self.slots[i].label is not None, self.slots[i].used))

    async def _load(self, k: int, name: str, archive: Path | None) -> None:
        try:
            await self.engine.collective_rpc("hotloop_slot_load", args=(k, name, str(archive)))
        except BaseException:
            async with self._cond:
                self.slots[k].label = None
                self.slots[k].loading = False
                self._cond.notify_all()
            raise
        async with self._cond:
            self.slots[k].loading = False
            self._hold(k)  # held by the request that loaded it before anyone can evict it
            self.loads += 1
            self._cond.notify_all()

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

    async def forget(self, tenant: str, version: int) -> None:
        name = label(tenant, version)
        async with self._cond:
            ks = [i for i, s in enumerate(self.slots) if s.label == name and s.refs == 0
                  and not s.loading]
            for k in ks:
                self.slots[k].label = None
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

    async def prepare(self, tenant: str, version: int, archive: Path) -> None:
        from vllm.lora.request import LoRARequest

        peft = await asyncio.to_thread(adapters.unpack, archive, archive.parent / "peft")
        name = label(tenant, version)
        self._requests[name] = LoRARequest(name, self._next_id, str(peft))
        self._next_id += 1

    async def acquire(self, tenant: str, version: int, archive: Path | None) -> Lease:
        if version == 0:
            return Lease(BASE)
        name = label(tenant, version)
        return Lease(name, lora_request=self._requests[name])

    async def forget(self, tenant: str, version: int) -> None:
        req = self._requests.pop(label(tenant, version), None)
        if req is not None:
            await self.engine.remove_lora(req.lora_int_id)

    def status(self) -> dict:
        return {"lora_requests": sorted(self._requests)}
