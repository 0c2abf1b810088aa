"""The device path (CUDA and other platforms whose linear layers keep a real ``weight``; untested
here, import-checked): prepare only moves the small factors to the device; commit writes
base + delta straight into ``layer.weight`` in place, which keeps CUDA-graph captured pointers
valid and needs no pending full copy."""

from __future__ import annotations

import torch

from .common import LinearSpec, LoraFactor, _Packed, merge_layer


def prepare_layer(base: torch.Tensor, shards: list[LoraFactor | None], dtype: torch.dtype) -> _Packed:
    """Move one layer's factors to the device now; the commit merges into the live weight in
    place, which costs a few ms of device time even for 7B."""
    dev = base.device
    on_dev = [
        None if f is None else LoraFactor(f.a.to(dev, dtype), f.b.to(dev, dtype), f.scale)
        for f in shards
    ]
    return _Packed(None, None, on_dev)


def write_layer(layer: torch.nn.Module, base: torch.Tensor, spec: LinearSpec, p: _Packed) -> None:
    """Make ``layer`` compute ``p``'s version: base + delta in place, or base (``shards`` None)."""
    if p.shards is not None:
        # In place (CUDA graphs captured this storage): base + delta written directly.
        merge_layer(base, spec, p.shards, out=layer.weight.data)
    else:
        layer.weight.data.copy_(base)
