"""PPO's pieces: the KL-penalised reward, GAE inputs, whitening, explained variance, the
adaptive KL controller, both critics (values, learning, isolation from the policy),
divergence, and the critic's checkpoint with its mismatch check. Tiny model, fp32."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.learner.algorithms import AdaptiveKl, explained_variance, kl_penalised_rewards, whiten
from services.trainer.learner.batching import Sample
from services.trainer.config import PpoSettings


# ---- algorithm units -------------------------------------------------------------------------

def test_kl_penalised_rewards_put_the_score_on_the_last_real_token():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -0.5, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    rewards, kl = kl_penalised_rewards(torch.tensor([1.0, -1.0]), lp, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.5, 0.0, -1.0], [0.5, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 1.1], [-0.05, -1.0, 0.0]]))


def test_whiten_and_explained_variance():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 5.0]])
    w = whiten(x, mask)
    assert float(w[mask].mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(w[mask].pow(2).mean()) == pytest.approx(1.0, abs=1e-4)
    assert float(w[0, 2]) == 0.0  # padding stays 0
    returns = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    const = torch.full_like(returns, 3.0)
    assert explained_variance(const, returns, mask) == pytest.approx(0.0, abs=1e-9)
    assert explained_variance(-returns, returns, mask) < 0
    assert math.isnan(explained_variance(const, const, mask))  # nothing to explain


def test_adaptive_kl_moves_toward_its_target_and_fixed_stays():
    ctl = AdaptiveKl(coef=0.1, target=0.05, horizon=100)
    ctl.update(kl=0.5, samples=10)  # 10x over target: the error is clipped at +20%
    assert ctl.coef == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctl.update(kl=0.0, samples=10)
    assert ctl.coef < 0.1 * (1 + 0.2 * 10 / 100)
    fixed = AdaptiveKl(coef=0.1)
    fixed.update(kl=5.0, samples=1000)
    assert fixed.coef == 0.1


def test_advantages_and_returns_end_to_end():
    from services.trainer.learner.algorithms import ppo_targets

    cfg = PpoSettings(gamma=1.0, lam=1.0, whiten_advantages=False)
    out = ppo_targets(
        [{"score": 1.0, "logprobs": [-1.0, -1.0], "ref": [-1.0, -1.0], "values": [0.0, 0.0]},
         {"score": 0.0, "logprobs": [-1.0], "ref": [-1.0], "values": [0.5]}], kl_coef=0.1, cfg=cfg)
    # lambda = gamma = 1 and no KL: the return of every token is the sequence's score.
    assert out["returns"] == [[1.0, 1.0], [0.0]]
    assert out["advantages"] == [[1.0, 1.0], [-0.5]]
    assert out["kl"] == 0.0


# ---- critics -----------------------------------------------------------------------------------

def _samples(pairs, targets):
    """Samples whose advantage is 0 (no policy gradient) and whose value target per token is
    `targets[i]`: only the critic has something to learn."""
    out = []
    for (p, c), y in zip(pairs, targets):
        out.append(Sample(prompt_ids=p, completion_ids=c, old_logprobs=[0.0] * len(c),
                          advantage=0.0, returns=[y] * len(c), old_values=[0.0] * len(c)))
    return out


def _fit(policy, critic, samples, steps):
    losses = []
    for _ in range(steps):
        m = policy.train_step(samples, critic=critic)
        assert not m.skipped, m.skip_reason
        losses.append(m.extra["value_loss"])
    return losses


@pytest.mark.parametrize("mode", ["shared", "lora"])
def test_critic_learns_values(make_cfg, random_pairs, mode):
    from services.trainer.learner.critic import make_critic
    from services.trainer.learner.policy import LoraPolicy

    cfg = make_cfg(algorithm="ppo", critic={"mode": mode, "lr": 3e-3, "value_clip": 10.0,
                                             "vf_coef": 1.0})
    policy = LoraPolicy(cfg)
    critic = make_critic(policy, cfg.critic)
    pairs = random_pairs(6, seed=1)
    targets = [0.0, 1.0, 0.5, 1.0, 0.0, 0.25]
    before = critic.values(pairs)
    assert [len(v) for v in before] == [len(c) for _, c in pairs]
    assert all(x == 0.0 for row in before for x in row)  # zero-initialised head
    losses = _fit(policy, critic, _samples(pairs, targets), 40)
    assert losses[-1] < 0.3 * losses[0]
    after = critic.values(pairs)
    ret = torch.zeros(6, 20)
    val = torch.zeros(6, 20)
    mask = torch.zeros(6, 20, dtype=torch.bool)
    for i, (row, y) in enumerate(zip(after, targets)):
        val[i, : len(row)] = torch.tensor(row)
        ret[i, : len(row)] = y
        mask[i, : len(row)] = True
    assert explained_variance(val, ret, mask) > 0.3


def test_lora_critic_leaves_the_policy_alone_and_shared_does_not(make_cfg, random_pairs):
    """With zero advantages the policy loss has no gradient: a `lora` critic's fit must not move
    the policy's logprobs, while a `shared` critic trains through the policy's adapter."""
    from services.trainer.learner.critic import make_critic
    from services.trainer.learner.policy import LoraPolicy

    pairs = random_pairs(4, seed=2)
    samples = _samples(pairs, [1.0, 0.0, 1.0, 0.0])
    moved = {}
    for mode in ("lora", "shared"):
        cfg = make_cfg(algorithm="ppo", critic={"mode": mode, "lr": 3e-2, "vf_coef": 1.0})
        policy = LoraPolicy(cfg)
        critic = make_critic(policy, cfg.critic)
        lp0 = policy.logprobs(pairs)
        _fit(policy, critic, samples, 5)
        lp1 = policy.logprobs(pairs)
        moved[mode] = max(abs(a - b) for r0, r1 in zip(lp0, lp1) for a, b in zip(r0, r1))
    assert moved["lora"] < 1e-6
    assert moved["shared"] > 1e-4


def test_value_loss_divergence_skips_the_update(make_cfg, random_pairs):
    from services.trainer.learner.critic import make_critic
    from services.trainer.learner.policy import LoraPolicy

    cfg = make_cfg(algorithm="ppo", critic={"max_value_loss": 10.0})
    policy = LoraPolicy(cfg)
    critic = make_critic(policy, cfg.critic)
    pairs = random_pairs(3, seed=3)
    head0 = critic.head.weight.detach().clone()
    lora0 = [p.detach().clone() for p in policy.trainable_tensors()]
    m = policy.train_step(_samples(pairs, [1e3, -1e3, 1e3]), critic=critic)
    assert m.skipped and "value loss diverged" in m.skip_reason
    assert policy.step == 0
    assert torch.equal(critic.head.weight, head0)
    assert all(torch.equal(a, b) for a, b in zip(policy.trainable_tensors(), lora0))


def test_critic_checkpoint_round_trip_and_mismatch(make_cfg, random_pairs, tmp_path):
    from services.trainer.learner.checkpoint import latest_checkpoint
    from services.trainer.learner.critic import CriticMismatch, make_critic
    from services.trainer.learner.policy import LoraPolicy

    pairs = random_pairs(4, seed=4)
    cfg = make_cfg(algorithm="ppo", critic={"mode": "lora", "lr": 3e-2})
    policy = LoraPolicy(cfg)
    critic = make_critic(policy, cfg.critic)
    _fit(policy, critic, _samples(pairs, [1.0, 0.0, 1.0, 0.5]), 3)
    policy.save_checkpoint(tmp_path / "ck", extras={"critic": critic.save})
    ckpt = latest_checkpoint(tmp_path / "ck")
    # The published adapter and the checkpoint's adapter hold the policy only.
    adapter = policy.save_adapter(tmp_path / "v1")
    assert not (adapter / "critic").exists() and not (ckpt / "adapter" / "critic").exists()

    fresh = LoraPolicy(cfg)
    fresh_critic = make_critic(fresh, cfg.critic)
    fresh.restore(ckpt)
    fresh_critic.load(ckpt / "critic")
    for a, b in zip(critic.values(pairs), fresh_critic.values(pairs)):
        assert a == pytest.approx(b, abs=1e-6)
    for a, b in zip(policy.logprobs(pairs), fresh.logprobs(pairs)):
        assert a == pytest.approx(b, abs=1e-6)

    for other in ({"mode": "shared"}, {"mode": "lora", "r": 8}):
        ocfg = make_cfg(algorithm="ppo", critic=other)
        opolicy = LoraPolicy(ocfg)
        with pytest.raises(CriticMismatch, match="does not match this policy"):
            make_critic(opolicy, ocfg.critic).load(ckpt / "critic")
    with pytest.raises(CriticMismatch, match="holds no critic"):
        make_critic(LoraPolicy(cfg), cfg.critic).load(ckpt / "adapter")
