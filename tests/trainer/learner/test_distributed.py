"""Data-parallel training on real processes (gloo on the CPU, the tiny model): two ranks give the
one-rank update, checkpoints move between world sizes, skips and stops are agreed, a dead or
hung rank fails the step instead of hanging it."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from services.trainer.config import TrainerConfig
from services.trainer.learner.critic import make_critic
from services.trainer.learner.distributed import (
    RankFailed,
    backend_for,
    make_policy,
    rank_devices,
    shard,
)
from services.trainer.learner.policy import Interrupted, LoraPolicy, Sample

# fp32 on the CPU. The ranks run other micro-batches than one rank (other padding, other
# shared-prompt plans) and add partial sums in another order, so values differ by rounding,
# as they do on one rank between two micro-batch budgets: measured 4e-8 on gradients of up to
# 5e-2, 1e-7 relative on loss and grad norm. A wrong normalizer or a missing shard is off by
# a factor.
GRAD_TOL = 1e-6
REL = 1e-5
# Parameters: AdamW's default eps (1e-8) makes its first step lr * sign(g), so a gradient that
# is ~0 moves by +-lr whichever way rounding tips it (one rank with two micro-batch budgets
# differs by 2e-4 after one step at lr 1e-3). The tests give AdamW eps 1e-3, where the step is
# proportional to small gradients, and compare the parameters to:
PARAM_TOL = 1e-6
# Two ranks on a shared CPU: one thread each.
KW = {"torch_threads": 1, "loss": {"kl_beta": 0.1}, "micro_batch_tokens": 64}

pytestmark = pytest.mark.timeout(240)


def _batch(policy: LoraPolicy, pairs, seed: int = 0, **fields) -> list[Sample]:
    """Uneven samples: odd count, lengths 0-19, ratios away from 1, advantages of both signs."""
    pairs = pairs[:-1] if len(pairs) % 2 == 0 else pairs
    old = policy.logprobs(pairs)
    ref = policy.base_logprobs(pairs)
    return [Sample(p, c, [x - 0.03 * ((i + seed) % 3) for x in o], (-1.0) ** i * (1 + i % 3), r,
                   **{k: v[i] for k, v in fields.items()})
            for i, ((p, c), o, r) in enumerate(zip(pairs, old, ref))]


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    diff = max(float((x - y).detach().abs().max()) for x, y in zip(a, b, strict=True))
    print(f"max |param difference|: {diff:.3g}")
    return diff


def _perturb(tensors: Sequence[torch.Tensor], seed: int = 0) -> None:
    """LoRA B starts at zero (A then gets no gradient): the same values on every policy."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tensors:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _same_metrics(a, b) -> None:
    assert not a.skipped and not b.skipped
    assert (b.tokens, b.sequences, b.step) == (a.tokens, a.sequences, a.step)
    assert b.loss == pytest.approx(a.loss, rel=REL)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=REL)
    assert b.extra.keys() == a.extra.keys()
    for k in a.extra:
        assert b.extra[k] == pytest.approx(a.extra[k], rel=REL, abs=1e-7), k


def _same_update(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    """The gradients (rank 0's, after the all-reduce) and the parameters agree."""
    grads = max(float((x.grad - y.grad).abs().max()) for x, y in zip(a, b, strict=True))
    print(f"max |gradient difference|: {grads:.3g}")
    assert grads < GRAD_TOL
    assert _max_diff(a, b) < PARAM_TOL


def _smooth_adam(*optimizers: torch.optim.Optimizer) -> None:
    """eps 1e-3 (see PARAM_TOL); part of the optimizer's state, so replicated and checkpointed."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["eps"] = 1e-3


def test_the_split_keeps_groups_together_and_covers_the_batch(grouped_pairs) -> None:
    samples = [Sample(p, c, [0.0] * len(c), 1.0) for p, c in grouped_pairs(3, 4)]
    parts = shard(samples, 2)
    assert sorted(i for part in parts for i in part) == list(range(len(samples)))
    assert all(parts)
    for part in parts:  # a prompt's samples are on one rank
        others = {tuple(samples[i].prompt_ids) for p in parts if p is not part for i in p}
        assert not {tuple(samples[i].prompt_ids) for i in part} & others
    assert shard(samples, 2) == parts
    # fewer prompts than ranks: samples are spread one by one
    one = [Sample([5, 6], [7] * n, [0.0] * n, 1.0) for n in (3, 4, 5)]
    assert all(shard(one, 2))


def test_the_backend_follows_the_device_and_cuda_needs_a_gpu_per_rank() -> None:
    assert backend_for("cuda") == "nccl" and backend_for("cpu") == "gloo"
    assert rank_devices("cuda", 2, 2) == ["cuda:0", "cuda:1"]
    assert rank_devices("cpu", 3, 0) == ["cpu"] * 3
    with pytest.raises(ValueError, match="data_parallel = 3 with device cuda needs one GPU per "
                                         "rank, but torch sees 2"):
        rank_devices("cuda", 3, 2)
    with pytest.raises(ValueError):
        TrainerConfig(data_parallel=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            make_policy(TrainerConfig(device="cuda", data_parallel=2))


def test_two_ranks_give_the_one_rank_update(make_cfg, grouped_pairs) -> None:
    """GRPO's batch (groups sharing prompts, an odd count, uneven lengths, several
    micro-batches per rank): two steps on two ranks give one rank's parameters and metrics.
    The second step checks that the ranks' replicas stayed equal after the first."""
    solo = LoraPolicy(make_cfg(**KW))
    dp = make_policy(make_cfg(data_parallel=2, **KW))
    try:
        for p in (solo, dp):
            _perturb(p.trainable_tensors())
            _smooth_adam(p.optimizer)
        dp.dp.state_changed()
        pairs = grouped_pairs(3, 4, seed=3)
        batches = [_batch(solo, pairs, seed=k) for k in range(2)]
        assert len(batches[0]) % 2 == 1
        for samples in batches:
            a, b = solo.train_step(samples), dp.train_step(samples)
            _same_metrics(a, b)
            assert b.micro_batches > 2
            _same_update(solo.trainable_tensors(), dp.trainable_tensors())
    finally:
        dp.close()


@pytest.mark.parametrize("mode", ["shared", "lora"])
def test_two_ranks_give_the_one_rank_ppo_update_with_its_critic(make_cfg, random_pairs,
                                                                 mode) -> None:
    kw = {**KW, "algorithm": "ppo", "loss": {}, "critic": {"mode": mode}}
    solo = LoraPolicy(make_cfg(**kw))
    dp = make_policy(make_cfg(data_parallel=2, **kw))
    try:
        critics = []
        for p in (solo, dp):
            critics.append(make_critic(p, p.cfg.critic))
            _perturb(p.trainable_tensors())
            _perturb(critics[-1].params, seed=1)
            _smooth_adam(p.optimizer, critics[-1].optimizer)
        dp.dp.state_changed()
        pairs = [pc for pc in random_pairs(9, seed=5) if pc[1]]
        g = torch.Generator().manual_seed(1)
        rets = [torch.randn(len(c), generator=g).tolist() for _, c in pairs]
        olds = [[0.1 * x for x in r] for r in rets]
        samples = [replace(s, ref_logprobs=None)
                   for s in _batch(solo, pairs, returns=rets, old_values=olds)]
        for _ in range(2):
            a = solo.train_step(samples, critic=critics[0])
            b = dp.train_step(samples, critic=critics[1])
            _same_metrics(a, b)
            _same_update(solo.trainable_tensors(), dp.trainable_tensors())
            _same_update(critics[0].params, critics[1].params)
    finally:
        dp.close()


def test_a_checkpoint_resumes_at_another_world_size(make_cfg, random_pairs, tmp_path) -> None:
    """One rank trains two steps uninterrupted; two ranks checkpoint after the first and one
    rank resumes there; and one rank's first-step checkpoint resumed on two ranks: the same
    second step."""
    pairs = random_pairs(7, seed=2)
    solo = LoraPolicy(make_cfg(**KW))
    _smooth_adam(solo.optimizer)
    first, second = _batch(solo, pairs), _batch(solo, pairs, seed=1)
    solo.train_step(first)
    solo_ckpt = solo.save_checkpoint(tmp_path / "one")
    solo.train_step(second)

    dp = make_policy(make_cfg(data_parallel=2, **KW))
    try:
        _smooth_adam(dp.optimizer)
        dp.train_step(first)
        dp_ckpt = dp.save_checkpoint(tmp_path / "two")
        resumed = LoraPolicy(make_cfg(**KW))
        resumed.restore(dp_ckpt)
        resumed.train_step(second)
        assert resumed.step == solo.step == 2
        _same_update(resumed.trainable_tensors(), solo.trainable_tensors())  # 2 -> 1

        dp.restore(solo_ckpt)
        dp.train_step(second)
        assert dp.step == 2
        _same_update(dp.trainable_tensors(), solo.trainable_tensors())  # 1 -> 2
    finally:
        dp.close()


def test_a_bad_shard_skips_and_a_stop_interrupts_every_rank(make_cfg, random_pairs) -> None:
    """A non-finite loss on rank 1 only skips the step on both ranks; a stop polled on rank 0
    interrupts both; neither hangs, and the next step trains."""
    dp = make_policy(make_cfg(data_parallel=2, **KW))
    try:
        _perturb(dp.trainable_tensors())
        dp.dp.state_changed()
        samples = _batch(dp, random_pairs(9, seed=4))
        on_one = shard(samples, 2)[1][0]
        bad = list(samples)
        bad[on_one] = replace(bad[on_one], old_logprobs=[math.nan] * len(bad[on_one].old_logprobs))
        before = [p.detach().clone() for p in dp.trainable_tensors()]
        m = dp.train_step(bad)
        assert m.skipped and m.skip_reason == "non-finite loss" and dp.step == 0

        polls = iter(range(100))
        with pytest.raises(Interrupted):
            dp.train_step(samples, should_stop=lambda: next(polls) >= 2)  # mid-step
        assert all(torch.equal(a, b) for a, b in zip(before, dp.trainable_tensors()))

        m = dp.train_step(samples)
        assert not m.skipped and dp.step == 1
        assert not all(torch.equal(a, b) for a, b in zip(before, dp.trainable_tensors()))
    finally:
        dp.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_hung_rank_fails_the_step_with_a_clear_error(make_cfg, random_pairs,
                                                               sig) -> None:
    """Rank 1 killed (or stopped) in the middle of a step: the step raises `RankFailed` that
    says so, within the collective timeout, and `close` ends the rank."""
    timeout = 3.0
    dp = make_policy(make_cfg(data_parallel=2, data_parallel_timeout_s=timeout, **KW))
    rank1 = dp.dp.processes[0]
    try:
        samples = _batch(dp, random_pairs(7, seed=1))
        dp.train_step(samples)  # a step that works
        polls = iter(range(100))

        def strike() -> bool:  # on rank 0's second poll, inside the step
            if next(polls) == 1:
                os.kill(rank1.pid, sig)
                if sig == signal.SIGKILL:
                    rank1.wait()
            return False

        t0 = time.monotonic()
        expected = "rank 1 exited with code -9" if sig == signal.SIGKILL else "timeout"
        with pytest.raises(RankFailed, match=expected):
            dp.train_step(samples, should_stop=strike)
        assert time.monotonic() - t0 < timeout + 5
        with pytest.raises(RankFailed, match="failed earlier"):
            dp.train_step(samples)
    finally:
        dp.close()
    assert rank1.poll() is not None
