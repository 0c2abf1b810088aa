"""Several adapters in one batch on the CPU (tenants): resident adapter slots and, per forward,
which rows of the flattened batch each slot serves.

Every live linear layer's ``cpu_linear`` becomes ``SlotTable.wrap(...)``: the layer's live
function (the load-time packed base GEMM, or the default lineage's merged / factored version)
once over all rows, then for each slot present in this forward ``y[rows] += scale *
(x[rows] @ A^T) @ B^T`` over its own requests' rows, as S-LoRA / punica do. A forward with no
slot rows costs one attribute read per layer on top of the live function.

Rows of one request are contiguous in vLLM v1's flattened batch (the model runner lays them
out request by request, in ``input_batch.req_ids`` order, ``num_scheduled_tokens`` each);
``SlotTable.plan`` turns that into one slice per slot when its rows are one run, else an index
tensor (gather, GEMMs, ``index_add_``). Requests name their adapter by label (``extra_args``
``hotloop_adapter``), never by slot number, so a request can only ever be served by the
adapter it was admitted on: a label that is not resident is an error, not a guess.

Rows labelled ``BASE`` run on the load-time base weights even when the default lineage has a
version live (a tenant with no version yet): their rows are recomputed with the base handle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..tenants import BASE
from .common import LinearSpec, LoraFactor, _Packed
from .factored import factor_layer

Rows = slice | torch.Tensor


@dataclass
class _Factors:
    a: torch.Tensor  # (R, K)
    bt: torch.Tensor  # (R, N)
    scale: float


def build_slot(
    plan: dict[str, list[LoraFactor | None]], specs: dict[str, LinearSpec], dtype: torch.dtype
) -> dict[str, _Factors]:
    """One adapter's per-layer factors for the slot path (vllm_name -> factors)."""
    out = {}
    for vname, shards in plan.items():
        a, b, scale = factor_layer(specs[vname], shards, dtype)
        out[vname] = _Factors(a, b.t(), scale)
    return out


def _rows(idx: list[int]) -> Rows:
    """A slice when the rows are one run, else an index tensor."""
    if idx[-1] - idx[0] + 1 == len(idx):
        return slice(idx[0], idx[-1] + 1)
    return torch.tensor(idx, dtype=torch.long)


class SlotTable:
    """Resident adapters (``n`` slots) and this forward's rows per slot."""

    def __init__(self, n: int):
        self.n = n
        self.labels: list[str | None] = [None] * n
        self.factors: list[dict[str, _Factors] | None] = [None] * n
        self._slot_of: dict[str, int] = {}
        # This forward: (slot, rows) per slot present, and every row not on the live weights
        # (slots and BASE), for layers whose live function is not the base.
        self.segments: list[tuple[int, Rows]] = []
        self.off_live: Rows | None = None
        self.all_off = False  # no row of this forward is on the live weights

    def load(self, slot: int, label: str, factors: dict[str, _Factors]) -> None:
        if not 0 <= slot < self.n:
            raise ValueError(f"slot {slot} is out of range 0..{self.n - 1}")
        if label == BASE or not label:
            raise ValueError(f"{label!r} cannot name an adapter")
        other = self._slot_of.get(label)
        if other is not None:
            # The core is the authority on what runs (it loads a label only when no slot of
            # its own holds it): a copy left behind by a failed load elsewhere goes.
            self.free(other)
        self.free(slot)
        self.labels[slot], self.factors[slot] = label, factors
        self._slot_of[label] = slot

    def free(self, slot: int) -> None:
        old = self.labels[slot]
        if old is not None:
            del self._slot_of[old]
        self.labels[slot] = self.factors[slot] = None

    def plan(self, labels: list[str | None], tokens: list[int]) -> None:
        """Rows per slot for the next forward: request i (adapter ``labels[i]``, None: the live
        weights) has ``tokens[i]`` rows, laid out in this order."""
        per: dict[int, list[int]] = {}
        off_live: list[int] = []
        row = 0
        for label, n in zip(labels, tokens):
            if label is not None:
                rows = range(row, row + n)
                off_live.extend(rows)
                if label != BASE:
                    slot = self._slot_of.get(label)
                    if slot is None:
                        raise RuntimeError(
                            f"a request names adapter {label!r}, which is not resident (slots: "
                            f"{self.labels}); the rollout core must load it before admission")
                    per.setdefault(slot, []).extend(rows)
            row += n
        self.segments = [(s, _rows(idx)) for s, idx in per.items() if idx]
        self.off_live = _rows(off_live) if off_live else None
        self.all_off = len(off_live) == row

    def wrap(self, vname: str, live: _Packed, base: _Packed) -> Callable[..., torch.Tensor]:
        """``vname``'s ``cpu_linear``: ``live`` for the default lineage's rows, ``base`` plus the
        slot's low-rank term for each slot's rows."""
        live_fn, base_fn = live.cpu_linear, base.cpu_linear
        base_weight = base.weight
        live_is_base = live_fn is base_fn
        table = self

        def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            off = table.off_live
            if off is None:
                return live_fn(x, weight, bias)
            if live_is_base or table.all_off:
                # every row on the base (rows past the plan are padding): one base GEMM
                y = base_fn(x, base_weight, bias)
            else:
                y = live_fn(x, weight, bias)
            x2 = x.reshape(-1, x.shape[-1])
            y2 = y.view(-1, y.shape[-1])
            if not live_is_base and not table.all_off:
                # mixed with the default lineage's rows: the slots' rows again on the base
                xs = x2[off] if isinstance(off, slice) else x2.index_select(0, off)
                yb = base_fn(xs, base_weight, bias)
                if isinstance(off, slice):
                    y2[off] = yb
                else:
                    y2.index_copy_(0, off, yb)
            for slot, rows in table.segments:
                f = table.factors[slot].get(vname)
                if f is None:
                    continue
                if isinstance(rows, slice):
                    y2[rows].addmm_(F.linear(x2[rows], f.a), f.bt, alpha=f.scale)
                else:
                    low = F.linear(x2.index_select(0, rows), f.a) @ f.bt
                    y2.index_add_(0, rows, low, alpha=f.scale)
            return y

        return fn

    def status(self) -> dict[str, object]:
        return {"slots": self.n, "labels": list(self.labels)}
