"""RewardConfig validation: bad configurations fail at load time, with the reason."""

from __future__ import annotations

import inspect
import textwrap

import pytest
from pydantic import ValidationError

from services.reward.config import (
    CompositeConfig, LengthRule, RegexRule, RewardConfig, RewardModelConfig, SandboxConfig,
)


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
    for model in (RewardConfig, SandboxConfig, RegexRule, LengthRule, RewardModelConfig, CompositeConfig):
        for name in model.model_fields:
            # the class that declares it (metrics_port comes from hotloop.config.ServiceSection)
            owner = next(c for c in model.__mro__ if name in vars(c).get("__annotations__", {}))
            after = inspect.getsource(owner).split(f"\n    {name}:", 1)[1]
            assert after.split("\n", 2)[1].strip().startswith('"""'), f"{model.__name__}.{name} has no docstring"


def mesh(**reward) -> RewardConfig:
    return RewardConfig.model_validate({
        "length_rules": {"brief": {"max_words": 70}},
        "reward_models": {"rm": {"model": "/models/rm"}},
        **reward,
    })


def test_named_scorers_of_every_kind_are_accepted():
    cfg = mesh(scorers=["code_tests", "brief", "rm", "ppo"], default_scorer="ppo",
               composites={"ppo": {"parts": {"code_tests": 1.0, "brief": 0.2, "rm": 0.5}}})
    assert cfg.reward_models["rm"].device == "auto" and cfg.length_rules["brief"].reward_over == 0.0
    assert cfg.needed_scorers() == ["code_tests", "brief", "rm", "ppo"]


def test_needed_scorers_reach_parts_that_requests_cannot_name():
    cfg = mesh(scorers=["outer"], default_scorer="outer", composites={
        "outer": {"parts": {"inner": 1.0, "python:m:f": 1.0}}, "inner": {"parts": {"rm": 1.0, "format": 1.0}}})
    assert cfg.needed_scorers() == ["rm", "format", "inner", "python:m:f", "outer"]


@pytest.mark.parametrize("composites,match", [
    ({"a": {"parts": {"a": 1.0}}}, "cycle: a -> a"),
    ({"a": {"parts": {"b": 1.0}}, "b": {"parts": {"brief": 1.0, "a": 1.0}}}, "cycle: a -> b -> a"),
    ({"a": {"parts": {"missing": 1.0}}}, "part 'missing' is not a scorer"),
    ({"a": {"parts": {"python:mod": 1.0}}}, "part 'python:mod' is not a scorer"),
    ({"a": {"parts": {}}}, "at least 1 item"),
    ({"a": {"parts": {"brief": float("nan")}}}, "finite number"),
])
def test_bad_composites_are_refused(composites, match):
    with pytest.raises(ValidationError, match=match):
        mesh(scorers=["code_tests"], composites=composites)


@pytest.mark.parametrize("reward,match", [
    ({"rules": {"rm": {"pattern": "x"}}}, "'rm' is defined in both rules and reward_models"),
    ({"composites": {"brief": {"parts": {"rm": 1.0}}}}, "'brief' is defined in both length_rules and composites"),
    ({"length_rules": {"code_tests": {"max_words": 1}}}, "reserved"),
    ({"composites": {"python:a:b": {"parts": {"rm": 1.0}}}}, "reserved"),
])
def test_one_name_one_scorer(reward, match):
    with pytest.raises(ValidationError, match=match):
        mesh(**reward)


@pytest.mark.parametrize("field,value", [
    ("batch_size", 0), ("max_length", 8), ("label_index", -1), ("device", "tpu"), ("dtype", "float16"),
    ("scale", float("inf")),
])
def test_reward_model_bounds(field, value):
    with pytest.raises(ValidationError):
        RewardModelConfig(model="m", **{field: value})


def test_the_reward_models_doc_examples_parse():
    import re
    import tomllib
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "reward-models.md").read_text()
    blocks = [textwrap.dedent(b) for b in re.findall(r"```toml\n(.*?)```", doc, re.DOTALL)]
    assert len(blocks) >= 3
    for block in blocks:
        reward = tomllib.loads(block)["reward"]
        if "scorers" in reward:
            cfg = RewardConfig.model_validate(reward)
            assert cfg.default_scorer in cfg.needed_scorers()
        else:  # a fragment: one table
            for rm in reward["reward_models"].values():
                RewardModelConfig.model_validate(rm)
