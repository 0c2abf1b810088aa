"""Many tenants' adapters time-sharing one `LoraPolicy` (one base model in memory).

Owns: `AdapterState`, what makes a policy one tenant's (its adapter tensors, its AdamW state,
its step count), and `Adapters`, the registry of every tenant's state on one policy, with the
swap that makes the policy a given tenant's. Each tenant owns its own parameter tensors; a
swap moves pointers (`param.data = tensor`, `optimizer.state[param] = state`), never copies,
so it costs O(#parameters) attribute writes whatever the adapter's size. A new tenant starts
from the policy's LoRA init as it was when `Adapters` was built (B = 0: it computes the base
model), with no optimizer state; `reset` puts a tenant back there. Training tenant A, then B,
then A again is the same, for A, as training A alone (tests/trainer/learner/test_tenancy.py).

The swap tells data-parallel ranks (distributed.py) that the state changed, so they take rank
0's before the next step. Not per tenant: the RNG (a LoRA dropout > 0 draws from the one
process-wide stream) and the optimizer's hyperparameters (every tenant trains with the same
`[trainer]`).

Does not own: when to swap or who may use the policy meanwhile (the trainer's turns,
tenants/lanes.py), checkpoints (a tenant's are written and restored while it is swapped in).
Not thread-safe: swap only while no `train_step` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hotloop.tenants import TenantId

__all__ = ["AdapterState", "Adapters", "capture", "swap_in"]


@dataclass
class AdapterState:
    """One tenant's share of a policy: parameter tensors in optimizer order, AdamW state by
    parameter index (absent: not stepped yet), and optimizer steps applied."""

    params: list[torch.Tensor]
    optimizer: dict[int, dict[str, Any]] = field(default_factory=dict)
    step: int = 0

    @classmethod
    def fresh(cls, initial: list[torch.Tensor], step: int = 0) -> "AdapterState":
        """A new tenant: its own copy of the initial tensors, no optimizer state."""
        return cls([t.detach().clone() for t in initial], {}, step)


def capture(policy) -> AdapterState:
    """The policy's current state, by reference: the tensors and optimizer state it trains now
    (what a later `swap_in` puts back exactly as they are then)."""
    params = policy.trainable_tensors()
    state = policy.optimizer.state
    return AdapterState(
        params=[p.data for p in params],
        optimizer={i: state[p] for i, p in enumerate(params) if p in state},
        step=policy.step,
    )


def swap_in(policy, adapter: AdapterState) -> None:
    """Make `policy` train `adapter`: its tensors become the parameters' data, its optimizer
    state the optimizer's, its step the policy's. Gradients left from another tenant's step
    are dropped."""
    params = policy.trainable_tensors()
    if len(params) != len(adapter.params):
        raise ValueError(f"an adapter of {len(adapter.params)} tensors cannot go into a policy "
                         f"of {len(params)}")
    state = policy.optimizer.state
    for i, (p, t) in enumerate(zip(params, adapter.params)):
        if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
            raise ValueError(f"tensor {i}: {tuple(t.shape)} {t.dtype} on {t.device} cannot replace "
                             f"{tuple(p.shape)} {p.dtype} on {p.device}")
        p.data = t
        p.grad = None
        if i in adapter.optimizer:
            state[p] = adapter.optimizer[i]
        else:
            state.pop(p, None)
    policy.step = adapter.step
    policy.dp.state_changed()  # other data-parallel ranks take this state before the next step


class Adapters:
    """Every tenant's `AdapterState` on one policy, and which tenant the policy is now.

    The current tenant's state lives in the policy (what its steps and a restore changed);
    `use` captures it back into the registry before it swaps another tenant in."""

    def __init__(self, policy) -> None:
        self.policy = policy
        # the LoRA init, as built (B = 0): where every new tenant starts
        self._initial = [p.detach().clone() for p in policy.trainable_tensors()]
        self._states: dict[str, AdapterState] = {}
        self.current: str | None = None

    def __contains__(self, tenant: TenantId) -> bool:
        return tenant in self._states

    def tenants(self) -> list[str]:
        return list(self._states)

    def add(self, tenant: TenantId) -> None:
        """A new tenant, at the fresh init."""
        if tenant in self._states:
            raise ValueError(f"tenant {tenant!r} has an adapter already")
        self._states[tenant] = AdapterState.fresh(self._initial)

    def state(self, tenant: TenantId) -> AdapterState:
        """The tenant's state (the policy's own when it is the current one)."""
        if tenant == self.current:
            return capture(self.policy)
        return self._states[tenant]

    def use(self, tenant: TenantId) -> None:
        """Make the policy `tenant`'s (a no-op when it is already)."""
        if tenant not in self._states:
            raise KeyError(f"no adapter for tenant {tenant!r}")
        if tenant == self.current:
            return
        if self.current is not None:
            self._states[self.current] = capture(self.policy)
        swap_in(self.policy, self._states[tenant])
        self.current = tenant

    def reset(self, tenant: TenantId, params: list[torch.Tensor] | None = None) -> None:
        """Put `tenant` back at the fresh init (or at `params`, tensors in the policy's order:
        a version of its own it goes back to) with no optimizer state; its step count stays
        (checkpoint names keep increasing, so the reset one is the latest)."""
        step = self.state(tenant).step
        self._states[tenant] = AdapterState.fresh(self._initial if params is None else params, step)
        if tenant == self.current:
            swap_in(self.policy, self._states[tenant])

    def remove(self, tenant: TenantId) -> None:
        """Forget `tenant`'s state (its memory goes with the last reference)."""
        del self._states[tenant]
        if tenant == self.current:
            self.current = None  # the policy holds its tensors until the next `use`
