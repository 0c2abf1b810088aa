"""RewardConfig validation: bad configurations fail at load time, with the reason."""

from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError

from services.reward.config import RegexRule, RewardConfig, SandboxConfig


def test_defaults_are_valid():
    cfg = RewardConfig()
    assert cfg.default_scorer in cfg.scorers
    assert cfg.sandbox.isolation == "namespaces" and cfg.backend == "local"


def test_default_scorer_must_be_enabled():
    with pytest.raises(ValidationError, match="default_scorer"):
        RewardConfig(scorers=["format"], default_scorer="code_tests")


@pytest.mark.parametrize("name", ["codetests", "python:mod", "python::fn", "python:mod:"])
def test_unknown_or_malformed_scorer_names_are_refused(name):
    with pytest.raises(ValidationError, match="is not `code_tests`"):
        RewardConfig(scorers=["code_tests", name])


def test_rules_and_python_scorers_are_accepted():
    cfg = RewardConfig(
        scorers=["code_tests", "short", "python:pkg.mod:fn"],
        rules={"short": RegexRule(pattern=r"^.{0,40}$", match_reward=0.5)},
    )
    assert "short" in cfg.rules and cfg.rules["short"].match_reward == 0.5


def test_bad_regex_is_refused():
    with pytest.raises(ValidationError):
        RegexRule(pattern="(unclosed")


@pytest.mark.parametrize("field,value", [
    ("cpu_seconds", 0), ("wall_seconds", 0), ("memory_mb", 1), ("open_files", 2), ("max_processes", 0),
    ("isolation", "vm"), ("hidden_paths", ["relative/dir"]), ("hidden_paths", ["/tmp"]),
])
def test_sandbox_bounds(field, value):
    with pytest.raises(ValidationError):
        SandboxConfig(**{field: value})


def test_unknown_keys_are_errors():
    with pytest.raises(ValidationError):
        RewardConfig.model_validate({"concurency": 3})
    with pytest.raises(ValidationError):
        RewardConfig.model_validate({"sandbox": {"memory": 3}})


def test_every_field_is_documented():
    for model in (RewardConfig, SandboxConfig, RegexRule):
        source = inspect.getsource(model)
        for name in model.model_fields:
            after = source.split(f"\n    {name}:", 1)[1]
            assert after.split("\n", 2)[1].strip().startswith('"""'), f"{model.__name__}.{name} has no docstring"
