"""Trainer checkpoints: save, find the latest, restore exactly.

Owns: the on-disk layout of a checkpoint and its atomic publication. A checkpoint is a
directory `step-00000042/` holding
    adapter/            the peft adapter (adapter_config.json + adapter_model.safetensors),
                        publishable as a policy version as is
    trainer_state.pt    optimizer state and the torch RNG states (tensors; loaded weights_only)
    state.json          step, python and numpy RNG states, the loop's data position
It is written under a temporary name and renamed into place, so a directory named `step-*` is
always complete; a crash mid-write leaves only a `.tmp-*` directory that `latest_checkpoint`
ignores. A second checkpoint at the same policy step (steps that updated nothing moved the data
position on) supersedes the first. Does not own: when to checkpoint (the loop) or what the data position means (an
opaque JSON-serializable dict from the loop).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file

_NAME = re.compile(r"^step-(\d{8,})$")
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class TrainerState:
    """What a restore hands back to the loop."""

    step: int
    data_position: dict[str, Any] = field(default_factory=dict)


def _rng_state() -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, json-able) RNG states of torch, CUDA (if present), python and numpy."""
    tensors: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    plain = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    return tensors, plain


def _set_rng_state(tensors: dict[str, Any], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(
    root: Path,
    *,
    step: int,
    model: PeftModel,
    optimizer: torch.optim.Optimizer,
    data_position: dict[str, Any] | None = None,
    extras: dict[str, Callable[[Path], None]] | None = None,
) -> Path:
    """Write `root/step-{step:08d}` atomically and return its path. `extras`: name -> a
    writer of a subdirectory (PPO's critic), written inside the same atomic rename."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tensors, plain = _rng_state()
    try:
        tmp.mkdir()
        # Only the policy adapter: a PPO critic's adapter is saved by its own writer (extras).
        model.save_pretrained(tmp / "adapter", selected_adapters=["default"])
        torch.save({"optimizer": optimizer.state_dict(), "rng": tensors}, tmp / "trainer_state.pt")
        state = {"step": step, "rng": plain, "data_position": data_position or {}}
        (tmp / "state.json").write_text(json.dumps(state))
        for name, write in (extras or {}).items():
            write(tmp / name)
        if final.exists():
            # The same policy step again: steps that updated nothing (a skipped group) moved
            # the data position on. The new checkpoint supersedes the old; a crash between the
            # two renames leaves the previous step's checkpoint as the latest, which is
            # consistent (its position and weights agree).
            old = root / f".old-{final.name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under `root`, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest complete checkpoints under `root`; returns the deleted.
    The newest is never deleted (keep >= 1)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    root = Path(root)
    if not root.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)))
    old = [p for _, p in found[:-keep]]
    for p in old:
        shutil.rmtree(p)
    return old


def load_checkpoint(
    path: Path, *, model: PeftModel, optimizer: torch.optim.Optimizer
) -> TrainerState:
    """Restore adapter weights, optimizer state and RNG states in place; return step and data
    position. The model and optimizer must be built from the same config as the saved ones."""
    path = Path(path)
    weights = load_file(path / "adapter" / ADAPTER_WEIGHTS)
    result = set_peft_model_state_dict(model, weights)
    # A key that matched no parameter means a different LoRA layout: fail, don't half-load.
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"checkpoint {path} does not match the model: {result.unexpected_keys}")
    blob = torch.load(path / "trainer_state.pt", weights_only=True)
    optimizer.load_state_dict(blob["optimizer"])
    state = json.loads((path / "state.json").read_text())
    _set_rng_state(blob["rng"], state["rng"])
    return TrainerState(step=int(state["step"]), data_position=state["data_position"])
