"""Fixtures for trainer tests: small configs on the shared tiny model (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.trainer.config import TrainerConfig


@pytest.fixture
def make_cfg(tiny_model: Path):
    """TrainerConfig for the tiny model: fp32 (exact comparisons), small LoRA, overrides."""

    def make(**overrides) -> TrainerConfig:
        base = {
            "model": str(tiny_model),
            "dtype": "float32",
            "lora": {"r": 4, "alpha": 8.0},
            "optimizer": {"lr": 1e-3},
            "micro_batch_tokens": 4096,
        }
        base.update(overrides)
        return TrainerConfig.model_validate(base)

    return make


def _random_pairs(n: int, seed: int = 0, vocab: int = 400) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        p = int(torch.randint(1, 12, (1,), generator=g))
        c = int(torch.randint(1, 20, (1,), generator=g))
        pairs.append(
            (
                torch.randint(3, vocab, (p,), generator=g).tolist(),
                torch.randint(3, vocab, (c,), generator=g).tolist(),
            )
        )
    return pairs


def _grouped_pairs(groups: int, size: int, seed: int = 0,
                   vocab: int = 400) -> list[tuple[list[int], list[int]]]:
    """`groups` prompts with `size` completions each (GRPO's batch shape), interleaved so a
    group's rows are not adjacent; plus a one-token prompt with a one-token and an empty
    completion (a batch whose completions are all length 1 has no completion forward)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 12, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(groups)]
    pairs = [(prompts[k], torch.randint(3, vocab, (int(torch.randint(1, 20, (1,), generator=g)),),
                                        generator=g).tolist())
             for _ in range(size) for k in range(groups)]
    return pairs + [([5], [9]), ([5], [])]


@pytest.fixture
def grouped_pairs():
    """grouped_pairs(groups, size, seed=0): prompts repeated as in a GRPO batch."""
    return _grouped_pairs


@pytest.fixture
def random_pairs():
    """random_pairs(n, seed=0): n (prompt, completion) pairs of uneven lengths, ids in [3, 400)."""
    return _random_pairs
