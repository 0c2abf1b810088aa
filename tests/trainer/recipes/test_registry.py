"""The recipe registry (`services.trainer.recipes.registry`): each recipe enters itself, and
the runner, the CLI (`hotloop train <name>`) and the config-section table find it there. A
recipe registered here, in the test, is found by all three as the shipped ones are: adding a
recipe is its own module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field

from hotloop.config import ConfigError, MeshConfig, Section
from services.trainer.recipes import registry
from services.trainer.recipes.registry import Registered, recipes, register

ROOT = Path(__file__).resolve().parents[3]


class TinyConfig(Section):
    """`[tiny]`: a recipe's section made up for the test."""

    steps: int = Field(1, ge=1)
    """How many steps the tiny recipe would take."""
    run_id: str = ""
    """The run's name."""
    out_dir: str = "runs"
    """Where its run directory goes."""


class Refused(Exception):
    """Raised by the tiny recipe's check: the runner reached the recipe through its entry."""


def _refuse(job, trainer_cfg, endpoints) -> None:
    raise Refused(f"tiny refuses {job.steps} steps against {list(endpoints.rollout)}")


def _never_runs(job):
    raise AssertionError("the check refuses first")


@pytest.fixture
def tiny(monkeypatch):
    """The registry with a `tiny` recipe added, put back as it was after the test."""
    monkeypatch.setattr(registry, "_REGISTERED", dict(recipes()))
    return register(Registered("tiny", "a recipe made up for the test", TinyConfig, run=_never_runs,
                               report=lambda summary, run_dir, text: run_dir / "report.md",
                               check=_refuse, run_prefix="tiny-", trainer={"num_steps": 7}))


def test_the_shipped_recipes_register_themselves_without_torch():
    code = ("import sys\n"
            "from services.trainer.recipes.registry import recipes\n"
            "from launch.sections import sections\n"
            "r = recipes()\n"
            "print(sorted(r), {n: e.kind for n, e in r.items()})\n"
            "print(all(sections()[n] is e.config for n, e in r.items()))\n"
            "print('HEAVY', [m for m in ('torch', 'vllm', 'peft', 'transformers') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.splitlines()
    assert out[0] == "['grpo', 'online', 'ppo'] {'grpo': 'batch', 'online': 'online', 'ppo': 'batch'}"
    assert out[1] == "True"  # the section table is the registry's
    assert out[2] == "HEAVY []"


def test_a_name_is_registered_once(tiny):
    with pytest.raises(ValueError, match="'tiny' is registered already"):
        register(Registered("tiny", "another", TinyConfig, run=_never_runs, report=tiny.report))
    assert register(tiny) is tiny  # the same entry again (a module imported twice) is no clash
    with pytest.raises(ValueError, match="needs `run` and `report`"):
        register(Registered("half", "a batch recipe without a run", TinyConfig))


def test_a_new_recipe_is_a_train_command(tiny, tmp_path):
    from apps.cli import build_parser, run_module

    args = build_parser().parse_args(["train", "tiny", "--config", "c.toml", "--set", "tiny.steps=2",
                                      "--run-dir", str(tmp_path)])
    assert (args.command, args.algorithm, args.fn) == ("train", "tiny", run_module)
    assert args.set == ["tiny.steps=2"] and args.run_dir == str(tmp_path)
    with pytest.raises(SystemExit):  # an unknown recipe is refused by the parser
        build_parser().parse_args(["train", "tiny2"])


def test_a_new_recipe_has_its_section_checked_with_the_file(tiny, tmp_path):
    from launch.jobs import load_job
    from launch.sections import sections

    assert sections()["tiny"] is TinyConfig
    cfg = tmp_path / "c.toml"
    cfg.write_text("[tiny]\nsteps = 3\n\n[trainer]\nnum_steps = 2\n")
    _, job, trainer_cfg = load_job(str(cfg), ["tiny.run_id=r"], "tiny")
    assert isinstance(job, TinyConfig) and (job.steps, job.run_id) == (3, "r")
    assert trainer_cfg.num_steps == 7  # the recipe's `trainer` values win over the file's
    with pytest.raises(ConfigError, match=r"\[tiny\] steps"):
        load_job(str(cfg), ["tiny.steps=0"], "tiny")


async def test_the_runner_runs_a_new_recipe_through_its_entry(tiny):
    """`run_job` finds the recipe by name and applies its check before connecting anything."""
    from services.trainer.config import TrainerConfig
    from services.trainer.runner import run_job

    mesh_cfg = MeshConfig.model_validate({"endpoints": {"rollout": ["127.0.0.1:1"],
                                                        "reward": ["127.0.0.1:2"]}})
    with pytest.raises(Refused, match=r"tiny refuses 4 steps against \['127.0.0.1:1'\]"):
        await run_job(mesh_cfg, TinyConfig(steps=4), TrainerConfig(), recipe="tiny")
    with pytest.raises(KeyError, match="no recipe 'nope'; known: grpo, online, ppo, tiny"):
        await run_job(mesh_cfg, TinyConfig(), TrainerConfig(), recipe="nope")
    with pytest.raises(ValueError, match="'online' is not a batch job"):
        await run_job(mesh_cfg, TinyConfig(), TrainerConfig(), recipe="online")
