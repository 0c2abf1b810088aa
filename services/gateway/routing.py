"""Choosing a healthy, current rollout replica for each request.

Owns: per-replica state (healthy, why not, requests this gateway has in flight there, the load
and the version the replica reported), a background poll of every replica, the newest version
seen, and the choice itself: `least_loaded` (fewest requests in flight, ties in turn) or
`round_robin` (in turn), among the replicas that may serve (`servable`).
Staleness: a replica serving a version more than `max_version_lag` behind the newest version
seen (the highest any replica serves or knows announced: a replica catching up reports both)
is skipped, so no user is answered by an older policy than the mesh has while a current replica
can answer; with none, the request is refused (Unavailable), not served stale. The newest
version only grows: it is what the trainer published, whichever replica said it last.
Per tenant, the same preference over the tenant's lineage: a tenant's request goes to a
healthy replica whose lineage of that tenant is within `max_version_lag` of the tenant's
newest version (the highest announced on the bus, KV `latest.tenant.<name>` or its
`WeightsUpdated`, fed in through `announced`, or served or known announced by any replica),
so a replica behind for that tenant (it missed the push, or restarted and is still fetching)
gets none of its users while another replica has it; the default lineage's version plays no
part. When no healthy replica has it, the request goes to the freshest ones (the highest
version of that lineage any healthy replica holds) rather than being refused: an announcement
reaches the gateway straight from the bus, before the next poll sees the replicas that took
the push, so refusing would fail the tenant's users for a poll after each of its versions.
Those requests are counted (`behind_picks`), and the answer names the version that served it.
The base model is never the stand-in: a replica that holds nothing of a lineage it knows was
announced waits for its catch-up, then refuses (services/rollout/core.py).
A replica that fails a request, or says it is not serving, is marked down at once, so the next
request goes elsewhere without waiting; the poll brings it back when it answers again. A poll
that merely gets no answer in time marks it down only after `failures` in a row: a replica (or
this gateway's own loop) busy with a burst answers slowly, and refusing users then would turn
load into outage.
The set of replicas may change while it runs (`update`, from `discovery.Discovery`: a scaled
service's name resolving to other addresses): a replica that stays keeps its state, a new one
gets users after its first poll, a gone one gets no new request and is closed once the
requests it has in flight end.
Does not own: the wire (a `Replica` talks to its server), finding the replicas
(discovery.py), or retrying a request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from hotloop.aio import raise_if_cancelled
from hotloop.errors import Unavailable
from hotloop.tenants import DEFAULT, TenantId

from .types import Replica

log = logging.getLogger(__name__)


@dataclass
class ReplicaState:
    replica: Replica
    healthy: bool = False
    reason: str = "not polled yet"
    in_flight: int = 0  # this gateway's requests on it now
    others: int = 0  # requests of other callers (e.g. training rollouts) at the last poll
    served: int = 0
    failures: int = 0  # requests it failed
    missed_polls: int = 0  # polls in a row without an answer
    version: int = 0  # the version it serves, at the last poll that reached it
    tenants: dict[str, int] = field(default_factory=dict)  # tenant -> the version it serves

    @property
    def load(self) -> int:
        return self.in_flight + self.others


class Router:
    def __init__(self, replicas: list[Replica], policy: str = "least_loaded",
                 interval_s: float = 2.0, timeout_s: float = 1.0, failures: int = 3,
                 max_version_lag: int = 0):
        self._states = [ReplicaState(r) for r in replicas]
        self._retired: list[ReplicaState] = []  # gone from the set, closed when idle
        self._policy = policy
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._failures = failures
        self._max_lag = max_version_lag
        self.newest = 0
        """The newest version seen (served or known announced by any replica); never falls."""
        self.tenant_newest: dict[TenantId, int] = {}
        """Per tenant: the newest version of its lineage announced on the bus or seen at any
        replica; never falls."""
        self.behind_picks = 0
        """Tenants' requests sent to a replica behind the tenant's newest version because no
        healthy replica had it."""
        self._turn = 0
        self._poller: asyncio.Task | None = None

    @property
    def states(self) -> list[ReplicaState]:
        return list(self._states)

    def lag(self, state: ReplicaState) -> int:
        """Versions `state`'s replica is behind the newest seen."""
        return max(0, self.newest - state.version)

    def tenant_lag(self, state: ReplicaState, tenant: TenantId) -> int:
        """Versions `state`'s replica is behind the newest version of `tenant`'s lineage."""
        return max(0, self.tenant_newest.get(tenant, 0) - state.tenants.get(tenant, 0))

    def announced(self, tenant: TenantId, version: int) -> None:
        """The bus says `version` is the newest of `tenant`'s lineage (the default lineage's
        newest comes from the replicas' polls alone)."""
        if tenant and version > self.tenant_newest.get(tenant, 0):
            self.tenant_newest[tenant] = version

    def may_serve(self, state: ReplicaState) -> bool:
        return state.healthy and self.lag(state) <= self._max_lag

    def servable(self) -> list[ReplicaState]:
        """The replicas a request may go to now: healthy and within `max_version_lag` of the
        newest version seen (what a readiness check wants: none means users get 503)."""
        return [s for s in self._states if self.may_serve(s)]

    def why_not(self, s: ReplicaState) -> str:
        """Why `s` may not serve now (unhealthy, or too far behind the newest version)."""
        return self._why_not(s)

    def _why_not(self, s: ReplicaState) -> str:
        if not s.healthy:
            return s.reason
        return (f"serves v{s.version}, {self.lag(s)} behind the newest v{self.newest} "
                f"(max_version_lag {self._max_lag})")

    async def start(self) -> None:
        """Poll once (so a fresh gateway routes at once), then keep polling in the background."""
        await self.poll()
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for s in self._states + self._retired:
            await s.replica.close()
        self._retired.clear()

    def update(self, replicas: list[Replica]) -> None:
        """Route among `replicas` from now on. A replica already here (same address) keeps its
        state; a new one starts unpolled (no user until a poll finds it healthy); one no
        longer listed gets no new request and is closed once its requests in flight end."""
        current = {s.replica.address: s for s in self._states}
        states = []
        for r in replicas:
            state = current.pop(r.address, None)
            if state is None:
                log.info("replica %s found", r.address)
                state = ReplicaState(r)
            states.append(state)
        for gone in current.values():
            log.info("replica %s is gone (%d requests in flight finish there)",
                     gone.replica.address, gone.in_flight)
            self._retired.append(gone)
        self._states = states

    async def _close_retired(self) -> None:
        idle = [s for s in self._retired if s.in_flight == 0]
        self._retired = [s for s in self._retired if s.in_flight > 0]
        for s in idle:
            await s.replica.close()

    async def poll(self) -> None:
        async def one(s: ReplicaState) -> None:
            was = s.healthy
            try:
                status = await s.replica.probe(self._timeout_s)
            except Exception as e:  # a probe that raises is a sick replica, not a crash
                s.missed_polls += 1
                if s.missed_polls >= self._failures or not s.healthy:
                    s.healthy, s.reason = False, f"health check failed: {e}"
            else:
                s.missed_polls = 0
                s.healthy = status is not None
                s.reason = "" if s.healthy else "not serving"
                if status is not None:
                    s.others = max(0, status.running - s.in_flight)
                    s.version = status.version
                    self.newest = max(self.newest, status.version, status.known_latest)
                    s.tenants = dict(status.tenants)
                    for t, v in (*status.tenants.items(), *status.tenants_known.items()):
                        self.announced(t, v)
            if was != s.healthy:
                log.info("replica %s is %s", s.replica.address,
                         "healthy" if s.healthy else f"unhealthy ({s.reason})")

        await self._close_retired()
        servable = {id(s) for s in self.servable()}
        await asyncio.gather(*(one(s) for s in self._states))
        for s in self._states:
            stale = s.healthy and not self.may_serve(s)
            if stale and id(s) in servable:
                log.warning("replica %s skipped: %s", s.replica.address, self._why_not(s))
            elif self.may_serve(s) and id(s) not in servable and s.version < self.newest:
                log.info("replica %s caught up: serves v%d", s.replica.address, s.version)

    async def _poll_forever(self) -> None:
        while True:
            raise_if_cancelled()  # a poll that swallowed the close's cancel (hotloop.aio)
            await asyncio.sleep(self._interval_s)
            await self.poll()

    def mark_down(self, replica: Replica, reason: str) -> None:
        for s in self._states:
            if s.replica is replica:
                if s.healthy:
                    log.warning("replica %s marked unhealthy: %s", replica.address, reason)
                s.healthy, s.reason = False, reason
                s.failures += 1

    def pick(self, exclude: set[int] = frozenset(), tenant: TenantId = DEFAULT) -> ReplicaState:
        """A replica that may serve (`servable`) not in `exclude` (ids of states), else
        Unavailable saying why each one may not. `tenant`: for a tenant's request, by the
        tenant's lineage instead (`_pick_for_tenant`)."""
        n = len(self._states)
        if not n:
            raise Unavailable("no rollout replica found ([endpoints] rollout resolves to no address yet)")
        if tenant:
            return self._pick_for_tenant(tenant, exclude)
        order = [(self._turn + i) % n for i in range(n)]  # rotating start: ties go in turn
        candidates = [self._states[i] for i in order
                      if self.may_serve(self._states[i]) and id(self._states[i]) not in exclude]
        if not candidates:
            why = "; ".join(
                f"{s.replica.address}: "
                f"{'failed this request' if self.may_serve(s) else self._why_not(s)}"
                for s in self._states)
            if any(s.healthy and not self.may_serve(s) for s in self._states):
                raise Unavailable(f"no current rollout replica ({why})")
            raise Unavailable(f"no healthy rollout replica ({why})")
        self._turn = (self._turn + 1) % n
        if self._policy == "least_loaded":
            return min(candidates, key=lambda s: s.load)  # min keeps the first of equals
        return candidates[0]

    def _pick_for_tenant(self, tenant: TenantId, exclude: set[int]) -> ReplicaState:
        """A healthy replica not in `exclude` whose lineage of `tenant` is within
        `max_version_lag` of the tenant's newest version; with none, one of the freshest
        healthy ones (see the module's docstring); with no healthy one, Unavailable."""
        n = len(self._states)
        order = [self._states[(self._turn + i) % n] for i in range(n)]
        healthy = [s for s in order if s.healthy and id(s) not in exclude]
        if not healthy:
            why = "; ".join(f"{s.replica.address}: "
                            f"{'failed this request' if s.healthy else s.reason}"
                            for s in self._states)
            raise Unavailable(f"no healthy rollout replica ({why})")
        candidates = [s for s in healthy if self.tenant_lag(s, tenant) <= self._max_lag]
        if not candidates:
            freshest = max(s.tenants.get(tenant, 0) for s in healthy)
            candidates = [s for s in healthy if s.tenants.get(tenant, 0) == freshest]
            self.behind_picks += 1
            log.debug("tenant %r: no healthy replica has its v%d; the freshest (v%d) serve",
                     tenant, self.tenant_newest.get(tenant, 0), freshest)
        self._turn = (self._turn + 1) % n
        if self._policy == "least_loaded":
            return min(candidates, key=lambda s: s.load)
        return candidates[0]

    @staticmethod
    def acquire(state: ReplicaState) -> None:
        state.in_flight += 1

    @staticmethod
    def release(state: ReplicaState, ok: bool) -> None:
        state.in_flight -= 1
        if ok:
            state.served += 1
