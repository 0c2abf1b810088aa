"""The memory plan of a colocated PPO host (services/trainer/learner/memplan.py) and the shipped CUDA
config checked against it: the base weights are held once by the trainer, and everything fits
the device with headroom."""

from __future__ import annotations

from pathlib import Path

import pytest

from hotloop import config
from services.rollout.config import RolloutConfig
from services.trainer.config import TrainerConfig
from services.trainer.learner.memplan import GIB, ModelShape, plan, plan_for

ROOT = Path(__file__).resolve().parents[3]
# SmolLM2-135M (config.json of HuggingFaceTB/SmolLM2-135M-Instruct) and Llama-3.1-8B.
SMOLLM2_135M = ModelShape(hidden=576, layers=30, intermediate=1536, vocab=49152, heads=9, kv_heads=3)
LLAMA_8B = ModelShape(hidden=4096, layers=32, intermediate=14336, vocab=128256, heads=32,
                      kv_heads=8, tied_embeddings=False)


def test_parameter_counts_match_the_published_models():
    assert SMOLLM2_135M.params == pytest.approx(134.5e6, rel=0.01)
    assert LLAMA_8B.params == pytest.approx(8.03e9, rel=0.01)


def _shipped():
    tree = config.raw_config(ROOT / "configs" / "gpu-ppo.toml", environ={})
    return (config.load_section(tree, "trainer", TrainerConfig),
            config.load_section(tree, "rollout", RolloutConfig))


@pytest.mark.parametrize("shape, device_gib, micro_batch_tokens", [
    (SMOLLM2_135M, 24, None),  # the shipped config as it is
    # An 8B keeps ~10 MiB of activations per token for the backward: the same config with
    # micro-batches of 1024 tokens (the update is unchanged: gradients accumulate).
    (LLAMA_8B, 80, 1024),
])
def test_the_shipped_cuda_config_fits(shape, device_gib, micro_batch_tokens):
    trainer, rollout = _shipped()
    assert trainer.algorithm == "ppo" and trainer.device in ("auto", "cuda")
    if micro_batch_tokens is not None:
        trainer = trainer.model_copy(update={"micro_batch_tokens": micro_batch_tokens})
    p = plan_for(trainer, shape, device_gib, rollout)
    assert p.fits, p.table()
    base = p.trainer["base weights (once: policy, reference, critic)"]
    assert base == shape.params * 2  # bf16, one copy for the policy, reference and critic


def test_colocation_is_what_makes_an_8b_fit():
    """Without colocation the reference service and a separate critic model would each hold
    another copy of the base: on an 80 GiB GPU the 8B plan no longer fits."""
    trainer, rollout = _shipped()
    p = plan_for(trainer.model_copy(update={"micro_batch_tokens": 1024}), LLAMA_8B, 80, rollout)
    assert p.fits
    extra_copies = 2 * LLAMA_8B.params * 2
    assert p.total + extra_copies > (1 - p.headroom) * p.device_bytes


def test_a_lora_critic_costs_its_adapter_and_a_second_graph():
    kw = dict(device_gib=24, gpu_memory_utilization=0.45, dtype_bytes=2, lora_r=16, critic_r=16,
              micro_batch_tokens=4096, logprob_chunk_tokens=512)
    shared = plan(SMOLLM2_135M, critic_mode="shared", **kw)
    lora = plan(SMOLLM2_135M, critic_mode="lora", **kw)
    assert lora.trainer_total > shared.trainer_total
    assert lora.trainer["critic (value head; its own LoRA in `lora` mode)"] == pytest.approx(
        SMOLLM2_135M.lora_params(16) * 16 + 576 * 16)
    assert "| total |" in lora.table() and lora.total / GIB < 24
