"""The recipes by name: what `hotloop train <name>`, the runner (`services.trainer.runner`)
and the table of config sections (`launch.sections`) need of each, registered by the
recipe's own module.

A recipe module calls `register(Registered(...))` when it is imported; `recipes()` imports
every module of this package once and returns the entries by name. No recipe module imports
torch, vLLM or peft at module level (the learner loads when a recipe runs), so reading the
registry stays light; the CLI still reads it only when `hotloop train` is the command. Nothing
here names a recipe: adding one is its own module (and its test).

Does not own: running a job (the runner), a recipe's loop (its module), the report's layout
(`services.trainer.report`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

# Modules of this package that hold no recipe: the interface and this registry.
_NOT_RECIPES = {"base", "registry"}


@dataclass(frozen=True)
class Registered:
    """One recipe, as the runner, the CLI and the config-section table see it."""

    name: str
    """`hotloop train <name>`, and the config section (`[<name>]`) that holds its settings."""
    help: str
    """Its line in `hotloop train --help`."""
    config: type[BaseModel]
    """The model of its `[<name>]` section: validated with the rest of the file before anything
    starts, and what the runner hands the recipe as its job."""
    kind: Literal["batch", "online"] = "batch"
    """How the runner runs it. "batch": the runner connects the mesh, runs `run(job)` to its
    end and writes the report with `report` (`runner.run_job`). "online": the online loop, until
    its steps are done or it is stopped, a lane per tenant where configured
    (`runner.run_online_job`)."""
    run: Callable[[Any], Callable[..., Any]] | None = None
    """batch: the recipe's coroutine function for a job's section: `run(job)(job, trainer_cfg,
    model_dir, mesh, run_dir, progress, on_step)` returns the run's summary."""
    report: Callable[[dict, Path, str], Path] | None = None
    """batch: writes the run's report from its summary, `(summary, run_dir, config_text)`, and
    returns the report's path."""
    check: Callable[[Any, Any, Any], None] | None = None
    """Refuses a job the mesh cannot run before anything connects, `(job, trainer_cfg,
    endpoints)`, with `SystemExit` saying why (a reference the recipe needs but no endpoint)."""
    run_prefix: str = ""
    """The start of a run id the runner picks when the job names none (then the time)."""
    trainer: Mapping[str, Any] = field(default_factory=dict)
    """`[trainer]` values the recipe sets above every source (PPO: `algorithm = "ppo"`)."""


_REGISTERED: dict[str, Registered] = {}
_imported = False


def register(entry: Registered) -> Registered:
    """Add a recipe; a name already taken is a ValueError (two recipes, one section)."""
    if entry.name in _REGISTERED and _REGISTERED[entry.name] is not entry:
        raise ValueError(f"a recipe named {entry.name!r} is registered already")
    if entry.kind == "batch" and (entry.run is None or entry.report is None):
        raise ValueError(f"recipe {entry.name!r}: a batch recipe needs `run` and `report`")
    _REGISTERED[entry.name] = entry
    return entry


def recipes() -> dict[str, Registered]:
    """Every recipe by name, sorted (registration order follows whichever module a process
    imported first), the package's modules imported on the first call."""
    global _imported
    if not _imported:
        for module in pkgutil.iter_modules([str(Path(__file__).resolve().parent)]):
            if module.name not in _NOT_RECIPES and not module.name.startswith("_"):
                importlib.import_module(f"{__package__}.{module.name}")
        _imported = True
    return dict(sorted(_REGISTERED.items()))


def recipe(name: str) -> Registered:
    """The recipe called `name`; KeyError listing the known ones."""
    known = recipes()
    if name not in known:
        raise KeyError(f"no recipe {name!r}; known: {', '.join(sorted(known))}")
    return known[name]
