"""Fixtures shared by every test package: the tiny model, adapters, a real NATS server."""

from __future__ import annotations

import os
from pathlib import Path

import hotloop  # noqa: F401  (before any test imports grpc: gRPC's fork support off, see there)

import pytest

# Tests share 2 cores with vLLM engines: keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from hotloop.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def make_adapter(model_dir: Path, out: Path, seed: int = 1, r: int = 8, scale: float = 1.0) -> Path:
    """A peft LoRA adapter on all linear layers with non-zero random B (so it changes outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def adapter_factory(tiny_model, tmp_path_factory):
    made: dict = {}

    def factory(seed: int = 1, r: int = 8, scale: float = 1.0) -> Path:
        key = (seed, r, scale)
        if key not in made:
            made[key] = make_adapter(tiny_model, tmp_path_factory.mktemp(f"adapter-{seed}-{r}"), seed, r, scale)
        return made[key]

    return factory


@pytest.fixture
def nats_server(tmp_path):
    from launch.natsserver import NatsServer

    with NatsServer(tmp_path / "nats") as server:
        yield server
