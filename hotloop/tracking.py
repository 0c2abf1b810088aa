"""Experiment trackers: a training run's records, also in TensorBoard, MLflow or Weights & Biases.

Owns the `[report]` section (`ReportConfig`: which trackers, and where each writes), the
narrow `Tracker` interface a run writes through (`log_params` once, with the run's effective
configuration; `log_metrics(step, scalars)`; `close`), one implementation per backend,
`open_tracker` (the factory), `Scoped` (a tag prefix: one tenant's lane of a shared run) and
`scalars` (a nested record as flat `group/name` numbers). Does not own what is recorded: the
training loops write their records to metrics.jsonl and mirror them here.

Every tracker of a run sits behind one `Trackers`, whose calls run in order on a thread of its
own: a tracker's write (an MLflow server's HTTP round trip, a retry) never holds the event
loop that trains, serves gRPC and acks feedback.

Failures, decided once for every backend:
- a backend whose package is not installed is a start-up error (`ConfigError`, naming the
  package and the extra that installs it), raised by `open_tracker` before any step; so is a
  backend that cannot start (a tracking server that refuses the run): `open_tracker` raises it;
- a write that fails while the run trains (a disk full, a server gone) is logged once per
  backend, with its error, and the run goes on; later writes to it are still tried (a server
  back up gets the rest of the curve), and `close` says how many failed. A tracker never stops
  training, and a training error is never hidden behind a tracker's.

Heavy imports (torch's TensorBoard writer, mlflow, wandb) happen only when a backend opens.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import BeforeValidator, field_validator

from .config import ConfigError, Section

log = logging.getLogger(__name__)

Backend = Literal["tensorboard", "mlflow", "wandb"]


class TensorBoardReport(Section):
    """`[report.tensorboard]`: where the event files go."""

    log_dir: str = ""
    """Directory of the event files. Empty: `<run dir>/tensorboard`, in the job's run
    directory (`<out_dir>/<run_id>/`), so `tensorboard --logdir <out_dir>` shows every run."""


class MlflowReport(Section):
    """`[report.mlflow]`: the tracking store and the experiment."""

    tracking_uri: str = ""
    """The MLflow tracking store: a server (`http://mlflow:5000`) or a database
    (`sqlite:////abs/path/mlflow.db`, `postgresql://...`). Empty: a SQLite store in the job's
    run directory (`sqlite:///<run dir>/mlflow.db`), no server needed; point several runs at
    one store to compare them."""
    experiment: str = "hotloop"
    """The experiment the run is logged under; created when the store does not have it."""


class WandbReport(Section):
    """`[report.wandb]`: the Weights & Biases project, and whether to upload."""

    project: str = "hotloop"
    """The W&B project of the run."""
    entity: str = ""
    """The W&B team or user; empty: the logged-in user's default."""
    mode: Literal["offline", "online", "disabled"] = "offline"
    """`offline` (default): the run is written under `dir` only, no network and no account
    needed; upload it later with `wandb sync <dir>/wandb/offline-run-*`. `online`: streamed to
    W&B as it trains (needs `wandb login` or WANDB_API_KEY). `disabled`: nothing is written."""
    dir: str = ""
    """Where W&B writes (its `wandb/` folder); empty: the job's run directory."""


def _one_or_many(value: Any) -> Any:
    """`to = "mlflow"` (a file or `--set report.to=mlflow`) is the list of that one."""
    return [value] if isinstance(value, str) else value


class ReportConfig(Section):
    """`[report]`: the experiment trackers a training job's records also go to, beside
    metrics.jsonl (which is always written). Read by `hotloop train grpo|ppo|online` and the
    online trainer service."""

    to: Annotated[list[Backend], BeforeValidator(_one_or_many)] = []
    """Trackers, any of "tensorboard", "mlflow", "wandb" (`pip install 'hotloop[tracking]'`
    installs their packages). Empty: none. A tracker whose package is missing stops the job
    at start, saying which package to install."""
    run_name: str = ""
    """The run's name in the trackers; empty: the job's run id."""
    tensorboard: TensorBoardReport = TensorBoardReport()
    """`[report.tensorboard]`: where the event files go (read when `to` names it)."""
    mlflow: MlflowReport = MlflowReport()
    """`[report.mlflow]`: the tracking store and experiment (read when `to` names it)."""
    wandb: WandbReport = WandbReport()
    """`[report.wandb]`: the project and mode, offline by default (read when `to` names it)."""

    @field_validator("to")
    @classmethod
    def _once_each(cls, to: list[str]) -> list[str]:
        if len(set(to)) != len(to):
            raise ValueError(f"{to}: each tracker at most once")
        return to


class Tracker(Protocol):
    """What a run writes to a tracker. Values are plain floats; keys `group/name`."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The run's effective configuration (nested sections), once, before its steps."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Scalars at `step` (the optimizer step of the record they come from)."""

    def close(self) -> None:
        """Flush and end the run. Nothing is written after it."""


# ---- records as scalars ------------------------------------------------------------------------


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a nested record as `prefix/key/subkey` -> float: ints, floats and bools
    (as 0/1) at any depth; strings, lists and None are left out (they are no curve: the
    per-task results of an evaluation, the sequence numbers of a batch). The top-level `step`
    is the x axis, not a value."""
    out: dict[str, float] = {}

    def walk(node: Mapping[str, Any], at: str) -> None:
        for key, value in node.items():
            name = f"{at}/{key}" if at else str(key)
            if isinstance(value, Mapping):
                walk(value, name)
            elif isinstance(value, (bool, int, float)):
                out[name] = float(value)

    walk({k: v for k, v in record.items() if k != "step"}, prefix)
    return out


def flat_params(params: Mapping[str, Any], sep: str = ".") -> dict[str, str]:
    """A nested configuration as `section.key` -> text (lists and tables below a key as JSON),
    the form of a flat parameter store (MLflow)."""
    out: dict[str, str] = {}

    def walk(node: Mapping[str, Any], at: str) -> None:
        for key, value in node.items():
            name = f"{at}{sep}{key}" if at else str(key)
            if isinstance(value, Mapping) and value:
                walk(value, name)
            else:
                out[name] = value if isinstance(value, str) else json.dumps(value)

    walk(params, "")
    return out


# ---- the backends ------------------------------------------------------------------------------


class TensorBoardTracker:
    """Event files for TensorBoard, written by torch's `SummaryWriter` (torch.utils.tensorboard,
    which needs the `tensorboard` package; its protobuf range includes the mesh's). The
    configuration is a text summary, `config`, shown under TensorBoard's Text tab."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        # flushed every 10 s (the default, 120 s, leaves a live run's curves minutes behind)
        self.writer = SummaryWriter(str(log_dir), flush_secs=10)

    def log_params(self, params: Mapping[str, Any]) -> None:
        text = json.dumps(params, indent=2, default=str)
        # indented four spaces: a code block in the text plugin's markdown
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


_MLFLOW_KEY = re.compile(r"[^\w\-. /:]")  # what MLflow accepts in a metric or parameter name
MLFLOW_MAX_PARAM = 6000  # characters of a parameter's value MLflow stores
MLFLOW_BATCH_PARAMS, MLFLOW_BATCH_METRICS = 100, 1000  # per `log_batch` call


class MlflowTracker:
    """A run in an MLflow tracking store, through `MlflowClient` (no global `mlflow.start_run`
    state: two trackers in one process stay apart). Parameters are the configuration's
    `section.key`s; metrics keep their `group/name` keys."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str,
                 artifact_location: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (found.experiment_id if found is not None else
                         self.client.create_experiment(experiment, artifact_location=artifact_location))
        self.run_id = self.client.create_run(experiment_id, run_name=run_name or None).info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(_MLFLOW_KEY.sub("_", k), v[:MLFLOW_MAX_PARAM])
                 for k, v in flat_params(params).items()]
        for i in range(0, len(items), MLFLOW_BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=items[i:i + MLFLOW_BATCH_PARAMS])

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(_MLFLOW_KEY.sub("_", k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), MLFLOW_BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=items[i:i + MLFLOW_BATCH_METRICS])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


WANDB_STEP = "step"
"""The W&B x axis every metric is plotted against. Not W&B's own `_step`, which must grow
with every call: the tenants' lanes of one run log steps of lineages of their own."""


class WandbTracker:
    """A W&B run (offline by default: files under `dir`, no network). It leaves the process's
    console, git state and system metrics alone: the trainer's output stays its own."""

    def __init__(self, project: str, entity: str, mode: str, directory: Path, run_name: str) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True,
                                  x_disable_machine_info=True, disable_git=True, save_code=False)
        self.run = wandb.init(project=project, entity=entity or None, mode=mode,
                              dir=str(directory), name=run_name or None, reinit="create_new",
                              settings=settings)
        self.run.define_metric(WANDB_STEP)
        self.run.define_metric("*", step_metric=WANDB_STEP)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({**metrics, WANDB_STEP: step})

    def close(self) -> None:
        self.run.finish()


# ---- the factory -------------------------------------------------------------------------------

_NEEDS: dict[str, tuple[tuple[str, str], ...]] = {  # backend -> (module, the package that has it)
    "tensorboard": (("torch", "torch"), ("tensorboard", "tensorboard")),
    "mlflow": (("mlflow", "mlflow-skinny"),),
    "wandb": (("wandb", "wandb"),),
}
_SQL = (("sqlalchemy", "SQLAlchemy"), ("alembic", "alembic"))  # MLflow's database stores
_NOT_SQL = ("http:", "https:", "databricks", "file:")  # stores MLflow reaches without them


def _missing(backend: str, cfg: ReportConfig) -> list[str]:
    needs = _NEEDS[backend]
    if backend == "mlflow" and not cfg.mlflow.tracking_uri.startswith(_NOT_SQL):
        needs += _SQL
    return [package for module, package in needs if importlib.util.find_spec(module) is None]


def default_mlflow_uri(run_dir: Path) -> str:
    """`sqlite:///` and the absolute path of `<run_dir>/mlflow.db` (four slashes in all)."""
    return "sqlite:///" + str((run_dir / "mlflow.db").resolve())


def _build(backend: str, cfg: ReportConfig, run_dir: Path, run_name: str) -> Tracker:
    if backend == "tensorboard":
        return TensorBoardTracker(Path(cfg.tensorboard.log_dir) if cfg.tensorboard.log_dir
                                  else run_dir / "tensorboard")
    if backend == "mlflow":
        uri = cfg.mlflow.tracking_uri
        if not uri:  # the run's own store: its (never used) artifact root beside it, not in the cwd
            run_dir.mkdir(parents=True, exist_ok=True)
            return MlflowTracker(default_mlflow_uri(run_dir), cfg.mlflow.experiment, run_name,
                                 (run_dir / "mlartifacts").resolve().as_uri())
        return MlflowTracker(uri, cfg.mlflow.experiment, run_name)
    w = cfg.wandb
    return WandbTracker(w.project, w.entity, w.mode, Path(w.dir) if w.dir else run_dir, run_name)


def check_installed(cfg: ReportConfig) -> None:
    """A `ConfigError` naming each package a tracker of `cfg.to` needs and this host lacks
    (found without importing it). A job calls it before it connects to anything."""
    missing = {b: m for b in cfg.to if (m := _missing(b, cfg))}
    if missing:
        raise ConfigError([
            f"[report] to: {backend!r} needs {' and '.join(pkgs)}, not installed here: "
            f"pip install 'hotloop[tracking]' (or {' '.join(pkgs)})"
            for backend, pkgs in missing.items()])


def open_tracker(cfg: ReportConfig, run_dir: Path, run_name: str,
                 close_timeout_s: float = 60.0) -> Trackers:
    """Every tracker `cfg.to` names for the run in `run_dir` (the job's run directory), named
    `cfg.run_name` or else `run_name`. A missing package is a `ConfigError` naming it
    (`check_installed`), before anything opens; a backend that fails to open raises its error
    (the ones opened before it are closed). With `to` empty, a `Trackers` of none: every call
    is a no-op."""
    check_installed(cfg)
    name = cfg.run_name or run_name
    return Trackers([(b, lambda b=b: _build(b, cfg, run_dir, name)) for b in cfg.to],
                    close_timeout_s)


class Trackers:
    """A run's trackers as one `Tracker`, each call run in order on a daemon thread of their
    own (see the module docstring for the failure policy)."""

    def __init__(self, builders: list[tuple[str, Callable[[], Tracker]]],
                 close_timeout_s: float = 60.0) -> None:
        self.close_timeout_s = close_timeout_s
        self.backends: dict[str, Tracker] = {}
        self.failures: dict[str, int] = {}  # backend -> writes that failed
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if not builders:
            return
        self._thread = threading.Thread(target=self._work, name="trackers", daemon=True)
        self._thread.start()
        try:
            for name, build in builders:  # on the thread: some backends keep per-thread state
                self.backends[name] = self._wait(build, None)
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        return list(self.backends)

    def log_params(self, params: Mapping[str, Any]) -> None:
        for name, backend in self.backends.items():
            self._put(name, backend.log_params, params)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        values = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if values:
            for name, backend in self.backends.items():
                self._put(name, backend.log_metrics, int(step), values)

    def scoped(self, prefix: str) -> Scoped:
        return Scoped(self, prefix)

    def close(self) -> None:
        """Flush every backend and end its run, waiting up to `close_timeout_s` for the
        writes still queued; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        try:
            for name, backend in self.backends.items():
                try:
                    self._wait(backend.close, self.close_timeout_s)
                except concurrent.futures.TimeoutError:
                    log.error("tracker %s: not closed within %.0f s (writes still queued); "
                              "its run may lack the last records", name, self.close_timeout_s)
                    break
                except Exception as e:
                    log.error("tracker %s: closing failed: %r", name, e)
            for name, n in self.failures.items():
                log.warning("tracker %s: %d write(s) failed during the run", name, n)
        finally:
            self._queue.put(None)

    # ---- the thread ----------------------------------------------------------------------
    def _put(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        if not self._closed:
            self._queue.put((name, fn, args, None))

    def _wait(self, fn: Callable[[], Any], timeout: float | None) -> Any:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(("", fn, (), done))
        return done.result(timeout)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            name, fn, args, done = item
            try:
                result = fn(*args)
            except BaseException as e:
                if done is not None:  # the caller waits for it: its error is the caller's
                    done.set_exception(e)
                    continue
                self.failures[name] = self.failures.get(name, 0) + 1
                if self.failures[name] == 1:
                    log.error("tracker %s: a write failed (%r); training goes on, later writes "
                              "are still tried and their failures counted", name, e, exc_info=e)
            else:
                if done is not None:
                    done.set_result(result)


class Scoped:
    """A tracker's view under a tag prefix: `log_metrics` writes `<prefix>/<key>`. One lane
    of a trainer of several tenants logs through one (its tenant's name): the tenants' curves
    are one run's, side by side. Params and close belong to the run, not to a view."""

    def __init__(self, parent: Tracker, prefix: str) -> None:
        self.parent, self.prefix = parent, prefix.strip("/")

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.parent.log_metrics(step, {f"{self.prefix}/{k}": v for k, v in metrics.items()})

    def close(self) -> None:
        pass
