"""Typed configuration: one TOML file, environment overrides, CLI overrides.

Owns: the sections every process shares (model, NATS, telemetry, security, run directory,
service endpoints) and the loader that layers sources. Each service defines its own section
model next to its code (`services/<name>/config.py`) and loads it with `load_section`.

Precedence, lowest first: field defaults < TOML file < environment < `--set key=value`.
Environment keys are `HOTLOOP__<SECTION>__<FIELD>` (double underscores separate levels),
e.g. `HOTLOOP__ROLLOUT__PORT=50051`. CLI overrides use dotted paths: `--set rollout.port=50051`.
Values are parsed as JSON when they parse (numbers, booleans, lists), else taken as strings.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

ENV_PREFIX = "HOTLOOP__"


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class ServiceSection(Section):
    """Base of a service process's own section: what every service's runner reads from it."""

    metrics_port: int = Field(0, ge=-1, le=65535)
    """Port of the process's Prometheus endpoint (`GET /metrics` on the section's `host`);
    0 picks a free one (the port file says which, as `metrics_port`); -1 serves none."""


class ModelConfig(Section):
    name: str = "smollm2-135m-instruct"
    """Base model: a known name (`hotloop models list`), a local HF directory, or a hub id."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Weights dtype of the rollout engine. `auto`: bf16 where the hardware computes it
    fast (CUDA, AMX-BF16 CPUs; measured), else fp32 (`hotloop.hardware`)."""
    max_model_len: int = Field(2048, ge=64, le=131072)
    """Longest prompt + completion, in tokens, that any service accepts."""


class NatsConfig(Section):
    url: str = ""
    """NATS server URL. Empty: no bus (services run, nothing is announced)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """Give up connecting after this long (bounded retry with backoff inside)."""


class TelemetryConfig(Section):
    exporter: Literal["none", "jsonl", "otlp", "memory"] = "none"
    """Where spans go: a JSON-lines file (local runs), an OTLP endpoint, memory (tests), or nowhere."""
    jsonl_path: str = ""
    """File for the `jsonl` exporter; empty: `<run_dir>/traces/<service>.jsonl`."""
    otlp_endpoint: str = "http://127.0.0.1:4317"
    """OTLP/gRPC endpoint for the `otlp` exporter."""


class SecurityConfig(Section):
    admin_token: str = ""
    """Bearer token required on admin RPCs (PushAdapter). Empty: admin RPCs are refused."""
    user_tokens: list[str] = []
    """API keys the gateway accepts for user traffic, each `key` or `id:key`. The id (given, or
    `key-` + the first 8 hex digits of the key's sha256) is what traffic and feedback record,
    never the key. With no keys here nor in `user_tokens_file`, the gateway refuses to start."""
    user_tokens_file: str = ""
    """A file of further API keys, one per line as above (blank lines and `#` comments are
    skipped). `hotloop up` generates one in the run directory (mode 0600)."""


class Endpoints(Section):
    """Where each service listens, as host:port. `hotloop up` fills these in."""

    rollout: list[str] = []
    """Rollout replicas; the trainer pushes every version to each of them."""
    reward: str = ""
    reference: str = ""
    trainer: str = ""
    gateway: str = ""


class MeshConfig(Section):
    """The sections every process reads."""

    model: ModelConfig = ModelConfig()
    nats: NatsConfig = NatsConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    security: SecurityConfig = SecurityConfig()
    endpoints: Endpoints = Endpoints()
    run_dir: str = ".hotloop/run"
    """Logs, traces, port files and the NATS store of a local run live here."""


S = TypeVar("S", bound=BaseModel)


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ValueError(f"cannot set {dotted!r}: {p!r} is not a section")
    node[parts[-1]] = value


def raw_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    environ: dict[str, str] | None = None,
) -> dict:
    """Merge the file, the environment and the overrides into one nested dict."""
    tree: dict = {}
    if path:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"config file {p} does not exist")
        with open(p, "rb") as f:
            tree = tomllib.load(f)
    env = os.environ if environ is None else environ
    for key, raw in sorted(env.items()):
        if key.startswith(ENV_PREFIX):
            _set_path(tree, key[len(ENV_PREFIX) :].lower().replace("__", "."), _parse_value(raw))
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        k, v = item.split("=", 1)
        _set_path(tree, k.strip(), _parse_value(v))
    return tree


def load_mesh(tree: dict) -> MeshConfig:
    shared = {k: v for k, v in tree.items() if k in MeshConfig.model_fields}
    return MeshConfig.model_validate(shared)


def load_section(tree: dict, name: str, model: type[S]) -> S:
    return model.model_validate(tree.get(name, {}))


def load(
    section: str,
    model: type[S],
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
) -> tuple[MeshConfig, S]:
    """Load the shared sections and one service's section from all sources."""
    tree = raw_config(path, overrides)
    return load_mesh(tree), load_section(tree, section, model)
