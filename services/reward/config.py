"""Configuration of the reward service (section `[reward]`).

Owns the typed knobs of scoring: which scorers exist and which is the default, the sandbox's
limits and required isolation, the sandbox backend and how much runs at once, and the scorer
name space: built-ins, `python:` functions, and the named tables (`rules`, `length_rules`,
`reward_models`, `composites`), where one name means one scorer and composites form no cycle.
Does not own: the shared sections (model, NATS, telemetry) or the loader (`hotloop.config`).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from hotloop.config import Section, ServiceSection
from hotloop.hardware import Dtype

IsolationLevel = Literal["process", "namespaces", "full"]
ISOLATION_ORDER: tuple[IsolationLevel, ...] = ("process", "namespaces", "full")

BUILTIN_SCORERS = ("code_tests",)
PYTHON_SCORER_PREFIX = "python:"


class SandboxConfig(Section):
    """Limits and isolation of one sandboxed run of untrusted code (see `sandbox.py`)."""

    isolation: IsolationLevel = "namespaces"
    """The least isolation the service accepts; it always uses the strongest the host allows
    and refuses to start when that is weaker than this. `process`: rlimits, own session,
    scrubbed environment, isolated interpreter, temp cwd, unprivileged uid when started as
    root. `namespaces`: plus network, pid and mount namespaces (no network, no view of host
    processes, private /tmp, a read-only filesystem of only `visible_paths`). `full`: plus
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
    judge_uid: int = Field(65533, ge=1)
    """Uid the tests run as when the service runs as root; not `sandbox_uid`, so the code
    cannot signal or trace the process that judges it."""
    judge_gid: int = Field(65534, ge=1)
    """Gid the tests run as when the service runs as root."""
    visible_paths: list[str] = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
    """The only host paths a run sees (namespace levels), read-only; the interpreter's own
    prefix is added. Paths that do not exist are skipped; a symlink (a merged-/usr `/lib`)
    stays a symlink. Everything else (home directories, the repository, run directories,
    /etc, /opt) is not there."""
    hidden_paths: list[str] = []
    """Directories inside the visible paths replaced by an empty read-only tmpfs, beside the
    ones always hidden (every site-packages and dist-packages directory of the interpreter,
    and whatever the service imports from outside the standard library)."""
    python: str = ""
    """Interpreter for the runs; empty: the service's own (resolved past any virtualenv)."""
    work_root: str = ""
    """Where per-run directories are made; empty: the system temp directory."""
    output_tail_bytes: int = Field(4096, ge=0, le=1 << 20)
    """How much of the end of a run's stdout and stderr is kept in its result."""

    @field_validator("hidden_paths", "visible_paths")
    @classmethod
    def _absolute(cls, paths: list[str]) -> list[str]:
        for p in paths:
            if not p.startswith("/") or p.rstrip("/") in ("", "/tmp", "/proc", "/dev"):
                raise ValueError(f"path {p!r} must be absolute and not /, /tmp, /proc or /dev")
        return paths

    @model_validator(mode="after")
    def _two_uids(self) -> "SandboxConfig":
        if self.judge_uid == self.sandbox_uid:
            raise ValueError("judge_uid must differ from sandbox_uid: the code must not run as "
                             "the uid of the process that judges it")
        return self


class RegexRule(Section):
    """A rule scorer: `match_reward` when `pattern` is found in the completion, else `miss_reward`."""

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


class LengthRule(Section):
    """A brevity rule: `reward_under` when the completion has at most `max_words` words, else
    `reward_over`. Words are whitespace-separated runs (`str.split()`), code included."""

    max_words: int = Field(ge=0)
    """Most words a completion may have and still get `reward_under`."""
    reward_under: float = Field(1.0, allow_inf_nan=False)
    """Reward of a completion of at most `max_words` words."""
    reward_over: float = Field(0.0, allow_inf_nan=False)
    """Reward of a longer one."""


class RewardModelConfig(Section):
    """A Hugging Face sequence-classification model that scores (prompt, completion) pairs
    (`reward_model.py`). Loaded once at start-up, and only when some enabled scorer uses it."""

    model: str
    """A local Hugging Face directory or a name `hotloop models` provisioned; loaded with
    `AutoModelForSequenceClassification` and its own tokenizer. Never downloaded at start-up."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs. `auto`: the first CUDA device if torch sees one, else the CPU.
    `cuda` on a host without one stops start-up."""
    dtype: Dtype = "auto"
    """Weights and compute dtype. `auto`: bf16 on CUDA or a CPU with AMX-BF16, else fp32
    (`hotloop.hardware.resolve_dtype`, the rule every service follows)."""
    batch_size: int = Field(8, ge=1, le=4096)
    """Most pairs per forward. Requests queued while a forward runs form the next batch, so a
    busy stream fills batches without waiting for stragglers."""
    max_length: int = Field(2048, ge=16, le=1 << 20)
    """Most tokens per pair. Longer pairs lose prompt tokens from the left (the completion,
    whose last token the model scores, is kept); a completion longer than this on its own
    keeps its last `max_length` tokens."""
    label_index: int = Field(0, ge=0)
    """Which output logit is the reward (0 for the usual single-logit reward model); must be
    below the model's `num_labels`, checked at start-up."""
    scale: float = Field(1.0, allow_inf_nan=False)
    """reward = scale * logit + offset. A fixed affine map, not running normalization: a
    reward that drifts with the batch's statistics would move the PPO target under the value
    head, and GRPO/PPO already normalize advantages."""
    offset: float = Field(0.0, allow_inf_nan=False)
    """Added after `scale`."""
    use_chat_template: bool = True
    """Render the pair as [user: prompt, assistant: completion] with the tokenizer's chat
    template, as reward models are trained; a tokenizer without one (or false here) scores
    `prompt + completion` as plain text, with the tokenizer's special tokens."""
    trust_remote_code: bool = False
    """Let transformers run Python code shipped in the model directory (models whose class is
    not in transformers). Only for directories you trust: that code runs in this service."""


class CompositeConfig(Section):
    """A weighted sum of other scorers, run concurrently on the same sample (`scorers.py`)."""

    parts: dict[str, Annotated[float, Field(allow_inf_nan=False)]] = Field(min_length=1)
    """Scorer name -> weight. Any scorer this config defines (`code_tests`, a rule, a length
    rule, a reward model, `python:<module>:<function>`, another composite), enabled in
    `scorers` or not; no cycles."""


def _default_rules() -> dict[str, RegexRule]:
    # "format": the completion contains a fenced Python block (what every built-in prompt asks for).
    return {"format": RegexRule(pattern=r"```(?:python|py|python3)[ \t]*\n.*?```")}


class RewardConfig(ServiceSection):
    """The `[reward]` section: the scorers a request may name, the sandbox that runs code,
    and how much scoring runs at once."""

    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(0, ge=0, le=65535)
    """Port to listen on; 0 picks a free one (written to the port file)."""
    scorers: list[str] = ["code_tests", "format"]
    """Scorers a request may name: `code_tests`, a key of `rules`, `length_rules`,
    `reward_models` or `composites`, or `python:<module>:<function>` (imported at start-up).
    Nothing else can be requested; a composite's parts are built for it whether listed or not."""
    default_scorer: str = "code_tests"
    """Scorer used when a request leaves `scorer` empty; must be one of `scorers`."""
    rules: dict[str, RegexRule] = Field(default_factory=_default_rules)
    """Named regex rule scorers."""
    length_rules: dict[str, LengthRule] = {}
    """Named brevity rule scorers."""
    reward_models: dict[str, RewardModelConfig] = {}
    """Named reward-model scorers (one loaded model each)."""
    composites: dict[str, CompositeConfig] = {}
    """Named weighted sums of other scorers."""
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
        tables = self._tables()
        seen: dict[str, str] = {}
        for kind, table in tables.items():
            for name in table:
                if name in BUILTIN_SCORERS or name.startswith(PYTHON_SCORER_PREFIX):
                    raise ValueError(f"{kind}.{name}: {name!r} is reserved for a built-in or python: scorer")
                if name in seen:
                    # one name, one scorer: a request for it must not depend on table order
                    raise ValueError(f"scorer name {name!r} is defined in both {seen[name]} and {kind}")
                seen[name] = kind
        for name in self.scorers:
            if not self.defines(name):
                raise ValueError(
                    f"scorer {name!r} is not `code_tests`, a rule, length rule, reward model or "
                    f"composite ({sorted(seen)}) or `python:<module>:<function>`"
                )
        for name, composite in self.composites.items():
            for part in composite.parts:
                if not self.defines(part):
                    raise ValueError(f"composite {name!r}: part {part!r} is not a scorer this config defines")
        for name in self.composites:
            self._no_cycle(name, ())
        if self.default_scorer not in self.scorers:
            raise ValueError(f"default_scorer {self.default_scorer!r} is not in scorers {self.scorers}")
        return self

    def _tables(self) -> dict[str, dict]:
        return {"rules": self.rules, "length_rules": self.length_rules,
                "reward_models": self.reward_models, "composites": self.composites}

    def defines(self, name: str) -> bool:
        """Whether `name` is a scorer of this config (enabled in `scorers` or not)."""
        if name in BUILTIN_SCORERS or any(name in t for t in self._tables().values()):
            return True
        parts = name.split(":")
        return name.startswith(PYTHON_SCORER_PREFIX) and len(parts) == 3 and all(parts)

    def _no_cycle(self, name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise ValueError(f"composites form a cycle: {' -> '.join((*path, name))}")
        if name in self.composites:
            for part in self.composites[name].parts:
                self._no_cycle(part, (*path, name))

    def needed_scorers(self) -> list[str]:
        """Every scorer to build: the enabled ones and, transitively, the parts of enabled
        composites; parts before the composites that use them, each name once."""
        order: list[str] = []

        def visit(name: str) -> None:
            if name in order:
                return
            for part in self.composites[name].parts if name in self.composites else ():
                visit(part)
            order.append(name)

        for name in self.scorers:
            visit(name)
        return order
