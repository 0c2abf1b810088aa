"""Configuration of the reward service (section `[reward]`).

Owns the typed knobs of scoring: which scorers exist and which is the default, the sandbox's
limits and required isolation, the sandbox backend and how much runs at once.
Does not own: the shared sections (model, NATS, telemetry) or the loader (`hotloop.config`).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hotloop.config import Section

IsolationLevel = Literal["process", "namespaces", "full"]
ISOLATION_ORDER: tuple[IsolationLevel, ...] = ("process", "namespaces", "full")

BUILTIN_SCORERS = ("code_tests",)
PYTHON_SCORER_PREFIX = "python:"


class SandboxConfig(BaseModel):
    """Limits and isolation of one sandboxed run of untrusted code (see `sandbox.py`)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    isolation: IsolationLevel = "namespaces"
    """The least isolation the service accepts; it always uses the strongest the host allows
    and refuses to start when that is weaker than this. `process`: rlimits, own session,
    scrubbed environment, isolated interpreter, temp cwd, unprivileged uid when started as
    root. `namespaces`: plus network, pid and mount namespaces (no network, no view of host
    processes, private /tmp, hidden directories, read-only root filesystem). `full`: plus
    per-run cgroups (pids.max, memory limit) and an unprivileged uid."""
    cpu_seconds: int = Field(10, ge=1, le=3600)
    """CPU time of the run's main process (RLIMIT_CPU); over it the run is a timeout."""
    wall_seconds: float = Field(10.0, gt=0, le=3600)
    """Wall-clock time of the run after start-up; over it everything is killed (timeout)."""
    memory_mb: int = Field(512, ge=64, le=1 << 20)
    """Address space per process (RLIMIT_AS) and, with cgroups, memory of the whole run."""
    file_size_mb: int = Field(16, ge=1, le=1 << 16)
    """Largest file a run may write (RLIMIT_FSIZE); also the size of each private tmpfs."""
    open_files: int = Field(64, ge=16, le=1 << 16)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_processes: int = Field(32, ge=1, le=4096)
    """Processes and threads of one run (pids.max with cgroups; RLIMIT_NPROC of the sandbox
    uid otherwise, which all concurrent runs share)."""
    sandbox_uid: int = Field(65534, ge=1)
    """Uid the code runs as when the service runs as root (65534: nobody)."""
    sandbox_gid: int = Field(65534, ge=1)
    """Gid the code runs as when the service runs as root (65534: nogroup)."""
    hidden_paths: list[str] = ["/root", "/home", "/run", "/mnt", "/media", "/srv"]
    """Directories replaced by an empty read-only tmpfs inside the mount namespace (the
    interpreter's own prefix is put back read-only when it lies below one of them)."""
    python: str = ""
    """Interpreter for the runs; empty: the service's own (resolved past any virtualenv)."""
    work_root: str = ""
    """Where per-run directories are made; empty: the system temp directory."""
    output_tail_bytes: int = Field(4096, ge=0, le=1 << 20)
    """How much of the end of a run's stdout and stderr is kept in its result."""

    @field_validator("hidden_paths")
    @classmethod
    def _absolute(cls, paths: list[str]) -> list[str]:
        for p in paths:
            if not p.startswith("/") or p.rstrip("/") in ("", "/tmp", "/proc", "/dev"):
                raise ValueError(f"hidden path {p!r} must be absolute and not /, /tmp, /proc or /dev")
        return paths


class RegexRule(BaseModel):
    """A rule scorer: `match_reward` when `pattern` is found in the completion, else `miss_reward`."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    pattern: str
    """Python regular expression, searched (not matched) in the completion."""
    match_reward: float = 1.0
    """Reward when the pattern is found."""
    miss_reward: float = 0.0
    """Reward when it is not."""
    dotall: bool = True
    """Let `.` match newlines (re.DOTALL)."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:  # not a ValueError: pydantic would not report it as a field error
            raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {e}") from None
        return pattern


def _default_rules() -> dict[str, RegexRule]:
    # "format": the completion contains a fenced Python block (what every built-in prompt asks for).
    return {"format": RegexRule(pattern=r"```(?:python|py|python3)[ \t]*\n.*?```")}


class RewardConfig(Section):
    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(0, ge=0, le=65535)
    """Port to listen on; 0 picks a free one (written to the port file)."""
    scorers: list[str] = ["code_tests", "format"]
    """Scorers a request may name: `code_tests`, a key of `rules`, or
    `python:<module>:<function>` (imported at start-up). Nothing else can be requested."""
    default_scorer: str = "code_tests"
    """Scorer used when a request leaves `scorer` empty; must be one of `scorers`."""
    rules: dict[str, RegexRule] = Field(default_factory=_default_rules)
    """Named regex rule scorers."""
    sandbox: SandboxConfig = SandboxConfig()
    """How code is run (limits, isolation)."""
    backend: Literal["local", "ray"] = "local"
    """Where sandboxes run: `local` subprocesses of this service, or `ray` actors (a local Ray
    started by the service, each actor running the same sandbox)."""
    concurrency: int = Field(4, ge=1, le=4096)
    """Sandbox runs at once (local: worker threads, each driving one subprocess; ray: actors)."""
    max_in_flight: int = Field(64, ge=1, le=1 << 16)
    """Score requests of one stream being worked on or waiting to be read by the client; the
    stream reads no further ahead (backpressure)."""
    ray_num_cpus: int | None = Field(None, ge=1)
    """CPUs the local Ray may schedule on; empty: `concurrency`."""
    ray_temp_dir: str = ""
    """Ray's session directory; empty: a fresh temporary directory (short, for Ray's sockets)."""

    @model_validator(mode="after")
    def _scorers_known(self) -> "RewardConfig":
        for name in self.scorers:
            if name in BUILTIN_SCORERS or name in self.rules:
                continue
            if name.startswith(PYTHON_SCORER_PREFIX) and len(name.split(":")) == 3 and all(name.split(":")):
                continue
            raise ValueError(
                f"scorer {name!r} is not `code_tests`, a rule ({sorted(self.rules)}) or "
                "`python:<module>:<function>`"
            )
        if self.default_scorer not in self.scorers:
            raise ValueError(f"default_scorer {self.default_scorer!r} is not in scorers {self.scorers}")
        return self
