"""Policy versions on the wire: a LoRA adapter packed as one content-addressed archive.

Owns: packing a peft adapter directory into deterministic bytes (so the sha256 names the
content), safe unpacking (fixed file names, size limits, no paths), and validation against
the base model (architecture, shapes, rank). Both the trainer (packs) and the rollout
service (verifies, unpacks) use it.
Does not own: loading an adapter into an engine.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hotloop.errors import FailedPrecondition, InvalidArgument

FILES = ("adapter_config.json", "adapter_model.safetensors")
MAX_ARCHIVE_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class Version:
    """A policy version: 0 is the base model; n > 0 is a LoRA adapter."""

    version: int
    sha256: str = ""
    bytes: int = 0
    base_model: str = ""
    created_at: float = field(default_factory=time.time)


def version_to_proto(v: Version):
    """The wire form (hotloop.v1.VersionInfo) used by the rollout, trainer and bus messages."""
    from hotloop.proto.v1 import common_pb2

    return common_pb2.VersionInfo(version=v.version, sha256=v.sha256, bytes=v.bytes,
                                  base_model=v.base_model, created_at=v.created_at)


def version_from_proto(p) -> Version:
    return Version(p.version, p.sha256, p.bytes, p.base_model, p.created_at)


def pack(adapter_dir: str | Path) -> bytes:
    """A deterministic tar (fixed order, zero mtimes, no owners) of the two adapter files."""
    adapter_dir = Path(adapter_dir)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in FILES:
            data = (adapter_dir / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unpack(data: bytes, dest: str | Path) -> Path:
    """Extract an archive made by `pack`; anything else in it is refused, nothing is written
    outside `dest`."""
    dest = Path(dest)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
    except tarfile.TarError as e:
        raise InvalidArgument(f"adapter archive is not a valid tar: {e}") from e
    with tar:
        members = tar.getmembers()
        names = sorted(m.name for m in members)
        if names != sorted(FILES) or not all(m.isfile() for m in members):
            raise InvalidArgument(f"adapter archive must hold exactly {FILES}, found {names}")
        dest.mkdir(parents=True, exist_ok=True)
        for m in members:
            f = tar.extractfile(m)
            assert f is not None
            (dest / m.name).write_bytes(f.read())
    return dest


def read_config(adapter_dir: str | Path) -> dict:
    try:
        return json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidArgument(f"adapter_config.json unreadable: {e}") from e


def validate(adapter_dir: str | Path, model_dir: str | Path, max_rank: int) -> dict:
    """Check an unpacked adapter against the base model; returns its adapter config.

    Catches the pushes that would otherwise fail deep inside an engine: another base model
    (shape mismatch), a rank over the replica's limit, non-finite weights, unknown keys.
    """
    from safetensors import safe_open

    cfg = read_config(adapter_dir)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise InvalidArgument(f"only LoRA adapters are supported, got {cfg.get('peft_type')}")
    r = int(cfg.get("r", 0))
    if not 0 < r <= max_rank:
        raise FailedPrecondition(f"adapter rank {r} is outside this replica's limit 1..{max_rank}")
    model_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = model_cfg["hidden_size"]
    layers = model_cfg["num_hidden_layers"]
    heads = model_cfg["num_attention_heads"]
    kv_heads = model_cfg.get("num_key_value_heads", heads)
    head_dim = model_cfg.get("head_dim") or hidden // heads
    inter = model_cfg["intermediate_size"]
    # (in_features, out_features) of every linear a LoRA may target, by module name
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    path = Path(adapter_dir) / "adapter_model.safetensors"
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise InvalidArgument(f"adapter weights unreadable: {e}") from e
    import torch

    with handle as f:
        keys = list(f.keys())
        if not keys:
            raise InvalidArgument("adapter has no weights")
        for key in keys:
            parts = key.split(".")
            try:
                layer = int(parts[parts.index("layers") + 1])
                module = next(p for p in parts if p in shapes)
            except (ValueError, StopIteration, IndexError):
                raise FailedPrecondition(
                    f"adapter key {key!r} targets a module this replica cannot serve "
                    f"(supported: {sorted(shapes)} in decoder layers)"
                ) from None
            if layer >= layers:
                raise FailedPrecondition(
                    f"adapter targets layer {layer} but the base model has {layers} layers: "
                    f"was it trained on another base model?"
                )
            t = f.get_tensor(key)
            fan_in, fan_out = shapes[module]
            want = (r, fan_in) if "lora_A" in key else (fan_out, r)
            if tuple(t.shape) != want:
                raise FailedPrecondition(
                    f"{key} has shape {tuple(t.shape)}, expected {want} for this base model: "
                    f"the adapter was trained on another base model"
                )
            if not torch.isfinite(t).all():
                raise InvalidArgument(f"{key} holds NaN or inf values")
    return cfg
