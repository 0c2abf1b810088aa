"""The factored CPU path: keep the load-time packed base GEMM and add the low-rank term unmerged
in the closure. Building is just reading the adapter (tens of ms); generation runs ~10-20 %
below base, so a version that goes live factored is later replaced by its merged build."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .common import LinearSpec, LoraFactor, _Packed


def factor_layer(
    spec: LinearSpec, shards: list[LoraFactor | None], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack one layer's factors for ``y += (x @ at) @ bt``: at (K, R), bt (R, N), scale in bt.

    R = sum of the ranks of the shards present. bt is block-structured: the rows of shard s's
    rank block are non-zero only in shard s's output columns, so one pair of GEMMs serves a
    fused qkv / gate_up layer. Zero-padding costs R * N extra MACs per token, negligible.
    """
    present = [
        (f, off, n)
        for f, off, n in zip(shards, spec.offsets, spec.shard_sizes)
        if f is not None
    ]
    r_total = sum(int(f.a.shape[0]) for f, _, _ in present)
    at = torch.empty(spec.in_features, r_total, dtype=dtype)
    bt = torch.zeros(r_total, spec.out_features, dtype=dtype)
    r0 = 0
    for f, off, n in present:
        r = int(f.a.shape[0])
        at[:, r0 : r0 + r].copy_(f.a.T)
        bt[r0 : r0 + r, off : off + n].copy_((f.b * f.scale).T)  # scale folded in fp32
        r0 += r
    return at, bt


def factored_linear(
    base_fn: Callable[..., torch.Tensor], at: torch.Tensor, bt: torch.Tensor
) -> Callable[..., torch.Tensor]:
    """A ``cpu_linear`` that runs the packed base GEMM and adds the low-rank term unmerged."""

    def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = base_fn(x, weight, bias)  # (M, N) from the load-time packed handle
        # (M, K) @ (K, R) -> (M, R); then y += (M, R) @ (R, N), accumulated in place.
        y.view(-1, y.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]) @ at, bt)
        return y

    return fn


def build_layer(
    spec: LinearSpec, shards: list[LoraFactor | None], dtype: torch.dtype, base: _Packed
) -> _Packed:
    """The factored build of one layer over its load-time handle ``base``."""
    at, bt = factor_layer(spec, shards, dtype)
    assert base.cpu_linear is not None
    return _Packed(factored_linear(base.cpu_linear, at, bt), base.weight)
