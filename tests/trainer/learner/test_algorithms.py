"""Algorithm units on hand-made tensors: known values, gradients, clipping sides, aggregation."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from services.trainer.learner.algorithms import (
    aggregate,
    gae,
    group_advantages,
    k3_kl,
    loss_normalizer,
    make_algorithm,
    policy_loss,
    value_loss,
)
from services.trainer.config import LossSettings, TrainerConfig


def test_group_advantages_known_values_and_zero_variance_group() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3]])
    adv = group_advantages(rewards)
    # mean 0.5, unbiased std sqrt(1/3): +-0.5 / 0.57735 = +-0.8660
    expected = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv[0], torch.tensor([1, -1, -1, 1.0]) * expected, atol=1e-5, rtol=0)
    assert torch.equal(adv[1], torch.zeros(4))  # exactly zero, not eps-sized
    drgrpo = group_advantages(rewards, scale_by_std=False)
    torch.testing.assert_close(drgrpo[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.equal(drgrpo[1], torch.zeros(4))


def _cfg(**kw) -> LossSettings:
    return LossSettings(**kw)


def test_ratio_one_without_clip_gives_the_reinforce_gradient() -> None:
    torch.manual_seed(0)
    old = torch.randn(3, 5) - 2.0
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.5, -0.5, 2.0])
    logp = old.clone().requires_grad_(True)
    loss, m = policy_loss(logp, old, None, adv, mask, _cfg())
    loss.backward()

    logp2 = old.clone().requires_grad_(True)
    reinforce = -(adv[:, None] * logp2 * mask).sum() / mask.sum()
    reinforce.backward()
    torch.testing.assert_close(logp.grad, logp2.grad)
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac"] == 0.0


@pytest.mark.parametrize(
    ("advantage", "log_ratio", "clipped"),
    [
        (1.0, math.log(1.5), True),  # A > 0: pushing the ratio higher is cut at 1 + eps
        (1.0, math.log(0.5), False),  # A > 0, ratio low: gradient still pulls it up
        (-1.0, math.log(0.5), True),  # A < 0: pushing the ratio lower is cut at 1 - eps
        (-1.0, math.log(1.5), False),  # A < 0, ratio high: gradient still pushes it down
    ],
)
def test_clipping_acts_on_the_right_side(advantage: float, log_ratio: float, clipped: bool) -> None:
    old = torch.zeros(1, 1) - 1.0
    logp = (old + log_ratio).requires_grad_(True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, m = policy_loss(logp, old, None, torch.tensor([advantage]), mask, _cfg())
    loss.backward()
    assert (logp.grad.abs().item() == 0.0) is clipped
    assert m["clip_frac"] == (1.0 if clipped else 0.0)
    if not clipped:  # d/dlogp of -r*A is -r*A
        assert logp.grad.item() == pytest.approx(-math.exp(log_ratio) * advantage)


def test_ratio_cap_bounds_the_negative_advantage_loss() -> None:
    old = torch.full((1, 2), -5.0)
    logp = torch.tensor([[-5.0 + math.log(10.0), -5.0 + math.log(2.0)]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = _cfg(ratio_cap=3.0)
    loss, m = policy_loss(logp, old, None, torch.tensor([-1.0]), mask, cfg)
    loss.backward()
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2)  # token 0 capped at 3, token 1 not
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() != 0.0
    assert m["capped_frac"] == 0.5
    with pytest.raises(ValidationError):
        _cfg(ratio_cap=1.1, clip_eps_high=0.2)


def test_k3_kl_is_nonnegative_and_zero_when_equal() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(64, 16) * 3, torch.randn(64, 16) * 3
    assert (k3_kl(a, b) >= 0).all()
    assert torch.equal(k3_kl(a, a), torch.zeros_like(a))
    # In the loss: gradient of beta * k3 w.r.t. logp is beta * (1 - exp(ref - logp)) / N.
    logp = a.clone().requires_grad_(True)
    mask = torch.ones_like(a, dtype=torch.bool)
    loss, m = policy_loss(logp, a, b, torch.zeros(64), mask, _cfg(kl_beta=0.1))
    loss.backward()
    torch.testing.assert_close(logp.grad, 0.1 * (1 - torch.exp(b - a)) / a.numel())
    assert m["kl"] == pytest.approx(float(k3_kl(a, b).mean()), rel=1e-5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, a, None, torch.zeros(64), mask, _cfg(kl_beta=0.1))


def test_token_and_sequence_aggregation_on_uneven_lengths() -> None:
    per_token = torch.tensor([[1.0, 0.0, 0.0], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    assert aggregate(per_token, mask, "token").item() == pytest.approx((1 + 9) / 4)
    assert aggregate(per_token, mask, "sequence").item() == pytest.approx((1 + 3) / 2)
    assert aggregate(per_token, mask, "constant", norm_tokens=8).item() == pytest.approx((1 + 9) / 16)
    # NaN on padding never leaks into the result.
    assert aggregate(per_token.masked_fill(~mask, math.nan), mask, "token").isfinite()


@pytest.mark.parametrize("how", ["token", "sequence", "constant"])
def test_split_batch_with_a_global_normalizer_sums_to_the_full_loss(how: str) -> None:
    torch.manual_seed(1)
    per_token = torch.randn(4, 6)
    mask = torch.arange(6)[None, :] < torch.tensor([[6], [2], [0], [4]])
    full = aggregate(per_token, mask, how, norm_tokens=6)
    norm = loss_normalizer(mask.sum(1).tolist(), how, norm_tokens=6)
    parts = aggregate(per_token[:2], mask[:2], how, norm) + aggregate(
        per_token[2:], mask[2:], how, norm
    )
    torch.testing.assert_close(parts, full)


@pytest.mark.parametrize("how", ["token", "constant"])
def test_a_lone_answer_moves_its_own_probability_by_its_length_only_under_constant(how: str) -> None:
    """An update of one answer (the online trainer's): the gradient on the answer's
    log-probability, sum_t logp_t, is -A / length under "token" (a short answer moves as far
    per token as a long one, so its whole probability moves further) and -A / norm_tokens
    under "constant", whatever its length."""
    cfg, grads = _cfg(aggregation=how, norm_tokens=8), {}
    for length in (2, 8):
        old = torch.full((1, length), -1.0)
        logp = old.clone().requires_grad_(True)
        loss, _ = policy_loss(logp, old, None, torch.tensor([1.0]), torch.ones(1, length, dtype=torch.bool), cfg)
        loss.backward()
        grads[length] = logp.grad[0, 0].item()  # d loss / d logp_t, the same at every t
    if how == "constant":
        assert grads[2] == grads[8] == pytest.approx(-1 / 8)
    else:
        assert grads[2] == pytest.approx(-1 / 2) and grads[8] == pytest.approx(-1 / 8)


def test_gae_with_gamma_lambda_one_is_returns_to_go_minus_values() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 0.1, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.9, 0.8, 0.7, 0], [0.6, 0.4, 0, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0], [1.0, 0.5, 0, 0]]))
    # lam=0: one-step TD errors.
    adv0, _ = gae(rewards, values, mask, gamma=1.0, lam=0.0)
    torch.testing.assert_close(adv0[0, :3], torch.tensor([0.1, 0.1, 0.7]))


def test_value_loss_clips_large_moves() -> None:
    v = torch.tensor([[2.0]], requires_grad=True)
    zero, mask = torch.tensor([[0.0]]), torch.ones(1, 1, dtype=torch.bool)
    loss = value_loss(v, zero, zero, mask)
    loss.backward()
    assert loss.item() == pytest.approx(2.0)  # max(0.5 * 2^2, 0.5 * 0.2^2)
    assert v.grad.item() == pytest.approx(2.0)


def test_make_algorithm_dispatch() -> None:
    grpo = make_algorithm(TrainerConfig(algorithm="grpo"))
    assert grpo.advantages(torch.tensor([[1.0, 0.0]])).shape == (1, 2)
    rf = make_algorithm(TrainerConfig(algorithm="reinforce", loss={"reinforce_baseline": 0.5}))
    torch.testing.assert_close(rf.advantages(torch.tensor([1.0, 0.0])), torch.tensor([0.5, -0.5]))
    ppo = make_algorithm(TrainerConfig(algorithm="ppo"))
    x = torch.tensor([[0.3, -1.0]])
    torch.testing.assert_close(ppo.advantages(x), x)  # GAE happens in the recipe
    with pytest.raises(ValidationError, match="kl_coef"):
        TrainerConfig(algorithm="ppo", loss={"kl_beta": 0.1})  # PPO's KL is in the reward
    with pytest.raises(ValidationError):
        TrainerConfig(algorithm="unknown")
    with pytest.raises(ValidationError):
        TrainerConfig(lora={"rank": 8})  # misspelled key is an error


def test_k3_as_a_loss_follows_the_other_kl_and_the_full_one_follows_its_own() -> None:
    """Why `kl_estimator = "full"`: over the tokens the policy samples, the gradient of k3 is
    the gradient of KL(reference || policy), not of KL(policy || reference), which k3's value
    estimates; the exact KL's gradient is its own. A policy that puts mass on a token the
    reference almost never writes (an early end of the answer) is pulled back hard by the
    one and hardly by the other."""
    ref = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0, -6.0]), dim=0)  # token 3: ~0.04%
    logits = torch.tensor([2.0, 1.0, 0.0, 0.0], requires_grad=True)  # the policy: token 3 ~9%

    def grad(f) -> torch.Tensor:
        (g,) = torch.autograd.grad(f(torch.log_softmax(logits, dim=0)), logits)
        return g

    p = torch.log_softmax(logits, dim=0).exp().detach()
    # the expectation over the sampled token, exactly: each token weighted by its probability
    k3_loss = grad(lambda lp: (p * k3_kl(lp, ref)).sum())
    reverse = grad(lambda lp: (lp.exp() * (lp - ref)).sum())  # KL(policy || reference), "full"
    forward = grad(lambda lp: (ref.exp() * (ref - lp)).sum())  # KL(reference || policy)
    torch.testing.assert_close(k3_loss, forward)
    assert not torch.allclose(k3_loss, reverse, atol=1e-3)
    # the pull down on the token the reference never writes, each way
    assert -reverse[3] < 0 and -forward[3] < 0
    assert reverse[3] > 4 * forward[3]


def test_the_full_kl_term_is_the_one_given() -> None:
    cfg = LossSettings(kl_beta=0.5, kl_estimator="full")
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    exact = torch.tensor([[0.3, 0.1]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(lp, lp.detach(), None, torch.zeros(1), mask, cfg, kl=exact)
    assert m["kl"] == pytest.approx(0.2)
    loss.backward()
    torch.testing.assert_close(exact.grad, torch.full((1, 2), 0.25))  # beta / tokens
    with pytest.raises(ValueError, match="full"):
        policy_loss(lp, lp.detach(), torch.zeros(1, 2), torch.zeros(1), mask, cfg)
