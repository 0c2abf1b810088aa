"""Tenants time-sharing one LoraPolicy (tenancy.py) on the tiny model: a swap moves pointers,
another tenant's steps leave a tenant bit-identical, and interleaving changes nothing."""

from __future__ import annotations

import pytest
import torch

from services.trainer.learner.policy import LoraPolicy, Sample
from services.trainer.learner.tenancy import Adapters


def batch(policy: LoraPolicy, pairs, sign: float) -> list[Sample]:
    old = policy.base_logprobs(pairs)  # the base: what every fresh tenant serves
    return [Sample(p, c, o, sign * (1.0 + i % 2)) for i, ((p, c), o) in enumerate(zip(pairs, old))]


def snapshot(policy: LoraPolicy) -> tuple[list[torch.Tensor], dict[int, dict], int]:
    """Copies of the policy's tensors, optimizer state and step (to compare later)."""
    params = policy.trainable_tensors()
    opt = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
               for k, v in policy.optimizer.state[p].items()}
           for i, p in enumerate(params) if p in policy.optimizer.state}
    return [p.detach().clone() for p in params], opt, policy.step


def assert_identical(a, b) -> None:
    (pa, oa, sa), (pb, ob, sb) = a, b
    assert sa == sb
    assert len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert oa.keys() == ob.keys()
    for i in oa:
        assert oa[i].keys() == ob[i].keys()
        for k in oa[i]:
            assert torch.equal(torch.as_tensor(oa[i][k]), torch.as_tensor(ob[i][k])), (i, k)


def test_interleaved_tenants_train_as_if_alone(make_cfg, random_pairs, tmp_path):
    cfg = make_cfg()
    shared, alone = LoraPolicy(cfg), LoraPolicy(cfg)  # the same seed: the same LoRA init
    d1, d2, d3 = random_pairs(4, seed=1), random_pairs(4, seed=2), random_pairs(4, seed=3)
    adapters = Adapters(shared)
    adapters.add("a")
    adapters.add("b")

    adapters.use("a")
    shared.train_step(batch(shared, d1, 1.0))
    adapters.use("b")
    shared.train_step(batch(shared, d2, -1.0))
    shared.train_step(batch(shared, d2, 1.0))
    b_before = snapshot(shared)
    b_tensors = [p.data.data_ptr() for p in shared.trainable_tensors()]

    adapters.use("a")
    assert shared.step == 1
    # a swap moves pointers: the parameters now hold a's own tensors, not copies into b's
    assert not {p.data.data_ptr() for p in shared.trainable_tensors()} & set(b_tensors)
    shared.train_step(batch(shared, d3, 1.0))
    a_after = snapshot(shared)

    adapters.use("b")
    assert [p.data.data_ptr() for p in shared.trainable_tensors()] == b_tensors
    assert_identical(snapshot(shared), b_before)  # a's steps left b bit-identical

    alone.train_step(batch(alone, d1, 1.0))
    alone.train_step(batch(alone, d3, 1.0))
    assert_identical(a_after, snapshot(alone))  # interleaving changed nothing for a

    # b trains on from where it was, as if alone too
    alone_b = LoraPolicy(cfg)
    for d, s in ((d2, -1.0), (d2, 1.0), (d1, -1.0)):
        alone_b.train_step(batch(alone_b, d, s))
    shared.train_step(batch(shared, d1, -1.0))
    assert_identical(snapshot(shared), snapshot(alone_b))


def test_a_restore_while_swapped_in_is_the_tenants_and_reset_goes_back_to_the_base(
        make_cfg, random_pairs, tmp_path):
    cfg = make_cfg()
    policy = LoraPolicy(cfg)
    initial = [p.detach().clone() for p in policy.trainable_tensors()]
    adapters = Adapters(policy)
    for t in ("a", "b"):
        adapters.add(t)
    d = random_pairs(3, seed=5)
    adapters.use("a")
    policy.train_step(batch(policy, d, 1.0))
    ckpt = policy.save_checkpoint(tmp_path / "a")
    saved = snapshot(policy)
    policy.train_step(batch(policy, d, -1.0))  # past the checkpoint
    adapters.use("b")
    policy.train_step(batch(policy, d, 1.0))
    b_state = snapshot(policy)

    adapters.use("a")
    policy.restore(ckpt)  # into a's tensors; the optimizer's state dicts are new ones
    adapters.use("b")
    assert_identical(snapshot(policy), b_state)
    adapters.use("a")
    assert_identical(snapshot(policy), saved)

    adapters.reset("a")  # the current tenant: the policy is at the init, no optimizer state
    params, opt, step = snapshot(policy)
    assert all(torch.equal(x, y) for x, y in zip(params, initial)) and opt == {}
    assert step == 1  # the step count goes on (checkpoint names keep increasing)
    base = policy.base_logprobs(d)
    assert policy.logprobs(d) == base  # B = 0: a fresh adapter computes the base
    adapters.use("b")
    assert_identical(snapshot(policy), b_state)

    adapters.remove("a")
    with pytest.raises(KeyError):
        adapters.use("a")
    assert adapters.tenants() == ["b"]


def test_each_tenant_decays_its_own_rate_and_a_reset_starts_it_again(make_cfg, random_pairs):
    """`[trainer.optimizer] decay_steps` counts a tenant's own optimizer steps: another
    tenant's steps do not lower it, and a reset (no optimizer state) starts at lr again."""
    policy = LoraPolicy(make_cfg(optimizer={"lr": 1e-3, "decay_steps": 1}))
    adapters = Adapters(policy)
    for t in ("a", "b"):
        adapters.add(t)
    d = random_pairs(2, seed=9)

    def lr(tenant: str) -> float:
        adapters.use(tenant)
        return policy.train_step(batch(policy, d, 1.0)).lr

    assert [lr("a"), lr("a"), lr("a")] == pytest.approx([1e-3, 1e-3 / 2**0.5, 1e-3 / 3**0.5])
    assert lr("b") == pytest.approx(1e-3)
    assert lr("a") == pytest.approx(1e-3 / 2.0)
    adapters.reset("a")
    assert lr("a") == pytest.approx(1e-3)
    assert lr("b") == pytest.approx(1e-3 / 2**0.5)
