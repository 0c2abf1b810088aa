"""The factored CPU path: keep the load-time packed base GEMM and add the low-rank term unmerged
in the closure. Building is a few small copies per fused layer and none for the others (the
factors are used where they lie); generation runs ~10-20 % below base, so a version that goes
live factored is later replaced by its merged build."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .common import LinearSpec, LoraFactor, _Packed


def factor_layer(
    spec: LinearSpec, shards: list[LoraFactor | None], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One layer's factors for ``y += scale * (x @ a^T) @ b^T``: a (R, K), b (N, R), scale.

    R = sum of the ranks of the shards present. A layer of one shard (o_proj, down_proj) uses
    its factors as they are: no copy when they are in the engine's dtype.
    Fused layers (qkv, gate_up) stack the A's and put each B in its own block of a zero (N, R)
    matrix, so one pair of GEMMs serves all shards; zero-padding costs R * N extra MACs per
    token, negligible. Per-shard scales that differ are folded into the B blocks (scale 1).
    """
    present = [
        (f, off, n)
        for f, off, n in zip(shards, spec.offsets, spec.shard_sizes)
        if f is not None
    ]
    if len(present) == 1 and present[0][2] == spec.out_features:
        f = present[0][0]
        return f.a.to(dtype), f.b.to(dtype), f.scale
    uniform = len({f.scale for f, _, _ in present}) == 1
    scale = present[0][0].scale if uniform else 1.0
    r_total = sum(int(f.a.shape[0]) for f, _, _ in present)
    a = torch.cat([f.a for f, _, _ in present]).to(dtype)
    b = torch.zeros(spec.out_features, r_total, dtype=dtype)
    r0 = 0
    for f, off, n in present:
        r = int(f.a.shape[0])
        b[off : off + n, r0 : r0 + r].copy_(f.b if uniform else f.b * f.scale)  # fp32 fold
        r0 += r
    return a, b, scale


def factored_linear(
    base_fn: Callable[..., torch.Tensor], a: torch.Tensor, b: torch.Tensor, scale: float
) -> Callable[..., torch.Tensor]:
    """A ``cpu_linear`` that runs the packed base GEMM and adds the low-rank term unmerged."""
    bt = b.t()  # (R, N): a transposed view; the GEMM reads it in place

    def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = base_fn(x, weight, bias)  # (M, N) from the load-time packed handle
        # (M, K) @ a^T -> (M, R); then y += scale * (M, R) @ (R, N), accumulated in place.
        y.view(-1, y.shape[-1]).addmm_(F.linear(x.reshape(-1, x.shape[-1]), a), bt, alpha=scale)
        return y

    return fn


def build_layer(
    spec: LinearSpec, shards: list[LoraFactor | None], dtype: torch.dtype, base: _Packed
) -> _Packed:
    """The factored build of one layer over its load-time handle ``base``."""
    a, b, scale = factor_layer(spec, shards, dtype)
    assert base.cpu_linear is not None
    return _Packed(factored_linear(base.cpu_linear, a, b, scale), base.weight)
