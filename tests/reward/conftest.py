"""Fixtures of the reward tests: a sandbox at the strongest isolation this host allows."""

from __future__ import annotations

import pytest

from services.reward.config import SandboxConfig
from services.reward.sandbox import IsolationUnavailable, Sandbox

# Small limits keep the hostile cases fast; they are what the containment tests push against.
LIMITS = dict(wall_seconds=3.0, cpu_seconds=2, memory_mb=256, file_size_mb=4, max_processes=16)


@pytest.fixture(scope="session")
def full_sandbox():
    """A `full` sandbox; tests that need it skip (loudly, with the host's reason) elsewhere.

    `test_detection_on_a_capable_host` fails instead of skipping when this host should
    have given `full`, so a broken detection cannot hide behind these skips.
    """
    try:
        sb = Sandbox(SandboxConfig(isolation="full", **LIMITS))
    except IsolationUnavailable as e:
        pytest.skip(f"this host cannot give full isolation: {e}")
    yield sb
    sb.close()


@pytest.fixture(scope="session")
def short_sandbox():
    """Like `full_sandbox` with a 1 s wall clock and CPU limit, for the tests that time out."""
    try:
        sb = Sandbox(SandboxConfig(isolation="full", **{**LIMITS, "wall_seconds": 1.0, "cpu_seconds": 1}))
    except IsolationUnavailable as e:
        pytest.skip(f"this host cannot give full isolation: {e}")
    yield sb
    sb.close()


def build_tiny_rm(out, tokenizer_dir, *, num_labels: int = 1, seed: int = 0, vocab_size: int | None = None,
                  nan_token: int | None = None):
    """A random tiny `LlamaForSequenceClassification` (~100k parameters) saved with the tiny
    model's tokenizer (chat template included). `vocab_size` below the tokenizer's makes a
    model that raises on the ids it lacks; `nan_token` poisons that token's embedding with NaN."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(out)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=vocab_size or len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, num_labels=num_labels,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    ))
    with torch.no_grad():
        # The default head init (std 0.02) gives scores a few 1e-3 apart; a wider one makes
        # "different texts score differently" a real check.
        model.score.weight.normal_(0.0, 1.0)
        if nan_token is not None:
            model.model.embed_tokens.weight[nan_token] = float("nan")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_rm(tiny_model, tmp_path_factory):
    """tiny_rm(**kwargs) -> a saved tiny reward model directory (built once per kwargs)."""
    made: dict = {}

    def make(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in made:
            made[key] = build_tiny_rm(tmp_path_factory.mktemp("tiny-rm"), tiny_model, **kwargs)
        return made[key]

    return make
