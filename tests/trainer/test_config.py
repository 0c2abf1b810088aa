"""Trainer and reference configs: defaults validate, every field is documented, bounds hold."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from services.reference.config import ReferenceConfig
from services.trainer.config import (
    CriticSettings,
    LoraSettings,
    LossSettings,
    OptimizerSettings,
    PpoSettings,
    TrainerConfig,
)
from services.trainer.recipes.grpo import GrpoJobConfig
from services.trainer.recipes.grpo_async import AsyncGrpoJobConfig
from services.trainer.recipes.ppo import PpoJobConfig


@pytest.mark.parametrize(
    "model", [TrainerConfig, LossSettings, OptimizerSettings, LoraSettings, ReferenceConfig,
              CriticSettings, PpoSettings, GrpoJobConfig, AsyncGrpoJobConfig, PpoJobConfig]
)
def test_defaults_validate_and_every_field_has_a_docstring(model: type[BaseModel]) -> None:
    model()
    undocumented = [n for n, f in model.model_fields.items() if not f.description]
    assert not undocumented


@pytest.mark.parametrize(
    "bad",
    [
        {"optimizer": {"lr": 0}},
        {"optimizer": {"betas": (0.9, 1.0)}},
        {"loss": {"clip_eps_low": 1.0}},
        {"loss": {"aggregation": "mean"}},
        {"dtype": "float16"},
        {"micro_batch_tokens": 0},
        {"unknown": 1},
    ],
)
def test_invalid_trainer_configs_are_rejected(bad: dict) -> None:
    with pytest.raises(ValidationError):
        TrainerConfig.model_validate(bad)


def test_reference_backend_is_a_closed_choice() -> None:
    with pytest.raises(ValidationError):
        ReferenceConfig(backend="vllm")  # not until a real backend exists


def test_online_tenants_are_checked_and_exclusive_with_tenant() -> None:
    from services.trainer.config import OnlineConfig

    job = OnlineConfig(tenants=["", "acme"], durable="d")
    assert job.tenants == ["", "acme"] and job.tenant == ""
    lane = job.for_tenant("acme")
    assert (lane.tenant, lane.tenants, lane.consumer_name) == ("acme", [], "d-acme")
    assert OnlineConfig().tenants == []  # default: the single `tenant`, as before
    for bad, needle in ((["acme", "acme"], "more than once"), (["Acme"], "tenant name"),
                        (["a.b"], "tenant name")):
        with pytest.raises(ValidationError, match=needle):
            OnlineConfig(tenants=bad)
    with pytest.raises(ValidationError, match="leave tenant unset"):
        OnlineConfig(tenants=["acme"], tenant="beta")
    # following the registry is a lane per tenant too, with or without config tenants
    assert OnlineConfig(follow_registry=True).lanes and not OnlineConfig(tenant="acme").lanes
    assert OnlineConfig(follow_registry=True).lane_tenants == [""]  # and the default lineage
    assert not OnlineConfig(tenants=[""], follow_registry=True).for_tenant("").follow_registry
    with pytest.raises(ValidationError, match="follow_registry trains a lane per tenant"):
        OnlineConfig(follow_registry=True, tenant="acme")
