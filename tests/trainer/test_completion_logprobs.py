"""hotloop.logprobs: completion-only chunked logprobs against a naive full-logits computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hotloop.logprobs import collate, completion_logprobs, plan_micro_batches


@pytest.fixture(scope="module")
def tiny_lm(tiny_model: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def naive(model, prompt: list[int], completion: list[int], temperature: float = 1.0):
    """Full logits over the unpadded sequence, log-softmax, pick the completion tokens."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float() / temperature  # [T, V]
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]  # predicts completion tokens
    lp = logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]
    return lp, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_full_logits(tiny_lm, random_pairs, chunk_tokens, temperature) -> None:
    pairs = random_pairs(6, seed=3) + [([5], [9])]  # one-token prompt and completion
    with torch.no_grad():
        out = completion_logprobs(
            tiny_lm, collate(pairs), chunk_tokens=chunk_tokens, temperature=temperature,
            with_entropy=True,
        )
        for i, (p, c) in enumerate(pairs):
            lp, ent = naive(tiny_lm, p, c, temperature)
            torch.testing.assert_close(out.logprobs[i, : len(c)], lp, atol=1e-5, rtol=0)
            torch.testing.assert_close(out.entropy[i, : len(c)], ent, atol=1e-5, rtol=0)
            assert out.mask[i].sum() == len(c) and (out.logprobs[i, len(c) :] == 0).all()
    assert [len(r) for r in out.rows()] == [len(c) for _, c in pairs]


def test_gradients_flow_through_a_peft_adapter(tiny_model: Path, random_pairs) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(std=0.05)  # a non-zero adapter, so "with" and "without" differ
    pairs = random_pairs(3, seed=1)
    out = completion_logprobs(model, collate(pairs))
    with torch.no_grad():
        for i, (p, c) in enumerate(pairs):
            lp, _ = naive(model, p, c)
            torch.testing.assert_close(out.logprobs[i, : len(c)], lp, atol=1e-5, rtol=0)
        with model.disable_adapter():
            off = completion_logprobs(model, collate(pairs)).logprobs
    assert not torch.allclose(off, out.logprobs.detach())
    out.logprobs.sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        collate([([], [1, 2])])


def test_plan_micro_batches_covers_every_index_within_budget() -> None:
    lengths = [5, 30, 12, 12, 7, 100, 1]
    groups = plan_micro_batches(lengths, token_budget=40)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [5] in groups  # over budget: alone
    for g in groups:
        if g != [5]:
            assert len(g) * max(lengths[i] for i in g) <= 40
    assert plan_micro_batches(lengths, 10_000) == [[5, 1, 2, 3, 4, 0, 6]]  # longest first
