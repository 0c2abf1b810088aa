"""Fixtures for the fault tests: a trainer config on the shared tiny model (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def trainer_cfg(tiny_model):
    """TrainerConfig for the tiny model: fp32, a small LoRA, one torch thread."""
    from services.trainer.config import TrainerConfig

    return TrainerConfig.model_validate({
        "model": str(tiny_model), "dtype": "float32", "lora": {"r": 4, "alpha": 8.0},
        "optimizer": {"lr": 1e-3}, "micro_batch_tokens": 4096,
    })
