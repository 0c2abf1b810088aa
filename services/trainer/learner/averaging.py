"""The weights a lineage serves: a running (Polyak, exponential) average of what it trains.

An online lineage learns from one or two rated answers per update; at a learning rate that
moves it within a few minutes, AdamW moves every adapter parameter by about the rate at each
update, so adjacent versions differ as much as distant ones and a share measured over the
answers of several versions says little about the next one (measured in the tenant demo: a
window of 30 answers held 0.47 of its preference, the version after it 0.04, though much of
that gap was a sliding window read at its luckiest; the demo reads consecutive blocks).
`PolyakAverage` keeps s <- decay * s + (1 - decay) * theta over the adapter's tensors after each
update, and the lineage publishes s: the served model changes by (1 - decay) of an update at a
time, and moves where the updates agree (Polyak & Juditsky 1992; the EMA "target" weights of
DQN and of diffusion models are the same average). The trainer still learns theta from
answers sampled from s; the loss's truncated importance weight (pi_theta / mu_s, capped)
accounts for the difference, as for any stale version.

Owns: the averaged tensors, their update, and their file in a checkpoint. Does not own which
tensors a version publishes (the online recipe passes these to `LoraPolicy.save_adapter`).
Averaging LoRA's factors is not averaging their product (B A): with updates as small as these
the difference is second order in the step, and the served adapter stays a LoRA adapter of
the same rank, which is what the engine loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["PolyakAverage"]

_FILE = "average.safetensors"


class PolyakAverage:
    """s <- decay * s + (1 - decay) * theta, per tensor, from `start` (copied). Kept in
    float32 whatever the adapter's dtype: an update moves s by a fifth of a step or less,
    which bfloat16's 8 bits of mantissa would round away."""

    def __init__(self, decay: float, start: Sequence[torch.Tensor]) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.tensors = [t.detach().float().clone() for t in start]

    @torch.no_grad()
    def update(self, tensors: Sequence[torch.Tensor]) -> None:
        """Fold the trained tensors (same shapes, same order as `start`) into the average."""
        if len(tensors) != len(self.tensors):
            raise ValueError(f"{len(tensors)} tensors for an average of {len(self.tensors)}")
        for s, t in zip(self.tensors, tensors):
            if s.shape != t.shape:
                raise ValueError(f"a tensor of shape {tuple(t.shape)} for one of {tuple(s.shape)}")
            s.lerp_(t.detach().float(), 1.0 - self.decay)

    def save(self, directory: Path) -> None:
        """Write the average under `directory` (a checkpoint's subdirectory)."""
        directory.mkdir(parents=True, exist_ok=True)
        save_file({str(i): t.contiguous().cpu() for i, t in enumerate(self.tensors)},
                  str(directory / _FILE))

    def load(self, directory: Path) -> bool:
        """Take the average saved under `directory`; False (and the average as it was) when
        there is none: a checkpoint written without averaging, or by a reset to the base."""
        path = directory / _FILE
        if not path.exists():
            return False
        saved = load_file(str(path))
        if len(saved) != len(self.tensors):
            raise ValueError(f"{path}: {len(saved)} tensors, the adapter has {len(self.tensors)}")
        loaded = []
        for i, s in enumerate(self.tensors):
            t = saved[str(i)]
            if t.shape != s.shape:
                raise ValueError(f"{path}: tensor {i} has shape {tuple(t.shape)}, the adapter's "
                                 f"{tuple(s.shape)}")
            loaded.append(t.to(device=s.device, dtype=torch.float32))
        self.tensors = loaded
        return True
