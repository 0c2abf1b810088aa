"""Which tenant's update runs next when several wait for one trainer: start-time fair
queueing on trained tokens.

Owns: `FairShare`, a plain bookkeeping class (no clock, no asyncio): each tenant has a virtual
time, the tokens it trained divided by its weight. A grant goes to the waiting tenant with the
smallest virtual time (the longest waiting among equals); when its update ends, its virtual
time advances by the update's tokens / weight. A tenant that becomes ready starts at max(its
own, where service stands): while tenants are backlogged (waiting or running) that is the
virtual time the latest grant started at (at most the smallest of theirs when it was given),
and when none is, the highest virtual time an update ended at. Being idle banks no credit, so a tenant that returns with a burst gets its share from then on, never a catch-up
monopoly. So a tenant with a burst of feedback cannot starve a quiet one: the quiet one, once
ready, is granted before the bursty one's next update; and always-backlogged tenants train
equal tokens (within one update's) per weight.

Does not own: waiting for a grant or the policy swap (lanes.py `Turns`), or what an
update is (recipes/online.py).
"""

from __future__ import annotations

import itertools

from hotloop.tenants import TenantId


class FairShare:
    """Start-time fair queueing over tenants' updates, charged in trained tokens.

    `ready(t)` when tenant t wants to run an update, `grant()` picks who runs (one at a time),
    `done(t, tokens)` when its update ended, `withdraw(t)` when t stops waiting ungranted."""

    def __init__(self) -> None:
        self.vtime: dict[TenantId, float] = {}
        self.weights: dict[TenantId, float] = {}
        self._waiting: dict[TenantId, int] = {}  # tenant -> arrival order (ties go to the earliest)
        self.running: str | None = None
        self._order = itertools.count()
        self._high = 0.0  # the highest virtual time an update ended at
        self._start = 0.0  # the virtual time the latest grant started at

    def add(self, tenant: TenantId, weight: float = 1.0) -> None:
        """A tenant joins, at the virtual time service stands at (no credit for not having
        been there)."""
        if tenant in self.vtime:
            raise ValueError(f"tenant {tenant!r} is in the fair share already")
        if not weight > 0:
            raise ValueError(f"a tenant's weight must be positive, got {weight!r}")
        self.weights[tenant] = float(weight)
        self.vtime[tenant] = self._floor()

    def remove(self, tenant: TenantId) -> None:
        self.withdraw(tenant)
        if self.running == tenant:
            self.running = None
        self.vtime.pop(tenant, None)
        self.weights.pop(tenant, None)

    def _floor(self) -> float:
        """Where service stands: the start time of the latest grant while anyone is backlogged,
        else the highest time an update ended at."""
        return self._start if self._waiting or self.running is not None else self._high

    def ready(self, tenant: TenantId) -> None:
        """`tenant` wants a grant (a no-op while it waits already)."""
        if tenant not in self.vtime:
            raise KeyError(f"tenant {tenant!r} is not in the fair share")
        if tenant in self._waiting:
            return
        if tenant != self.running:
            self.vtime[tenant] = max(self.vtime[tenant], self._floor())
        self._waiting[tenant] = next(self._order)

    def waiting(self) -> list[str]:
        return list(self._waiting)

    def grant(self) -> TenantId | None:
        """The waiting tenant that runs now (None: nobody waits, or one runs already)."""
        if self.running is not None or not self._waiting:
            return None
        tenant = min(self._waiting, key=lambda t: (self.vtime[t], self._waiting[t]))
        del self._waiting[tenant]
        self.running = tenant
        self._start = self.vtime[tenant]
        return tenant

    def done(self, tenant: TenantId, tokens: int) -> None:
        """`tenant`'s update ended after training `tokens` (0: it trained nothing)."""
        if self.running != tenant:
            raise ValueError(f"tenant {tenant!r} was not granted (running: {self.running!r})")
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self.running = None
        self.vtime[tenant] += tokens / self.weights[tenant]
        self._high = max(self._high, self.vtime[tenant])

    def withdraw(self, tenant: TenantId) -> None:
        """`tenant` stops waiting before it was granted (its lane stopped)."""
        self._waiting.pop(tenant, None)
