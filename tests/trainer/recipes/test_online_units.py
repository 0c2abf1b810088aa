"""Online-loop units without services: the truncated importance weight and its REINFORCE loss,
the running baseline, the checks that settle a feedback, and the `[online]` section."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from hotloop.proto.v1 import bus_pb2, common_pb2
from services.trainer.learner.algorithms import (
    EmaBaseline,
    make_online_algorithm,
    tis_reinforce_loss,
    truncated_is_weights,
)
from services.trainer.config import LossSettings, OnlineConfig, TrainerConfig
from services.trainer.recipes.online import bad_traffic, malformed, served_version, stale


def test_importance_weights_are_truncated_from_above_only_and_carry_no_gradient() -> None:
    behaviour = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))  # [1, 4]
    pi = torch.tensor([[0.05, 0.5, 0.6, 4.0]])  # ratios 0.1, 1, 1.2, 8
    logp = torch.log(pi).requires_grad_()
    w = truncated_is_weights(logp, behaviour, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.1, 1.0, 1.2, 2.0]]))
    assert not w.requires_grad
    torch.testing.assert_close(truncated_is_weights(logp, behaviour, cap=1.02)[0, 2], torch.tensor(1.02))
    # an absurd log-ratio does not overflow
    assert torch.isfinite(truncated_is_weights(torch.tensor([[0.0]]), torch.tensor([[-1e4]]), 5.0)).all()


def test_tis_reinforce_gradient_is_minus_weight_times_advantage() -> None:
    logp = torch.log(torch.tensor([[0.2, 0.4, 0.9], [0.3, 0.3, 0.3]])).requires_grad_()  # [2, 3]
    behaviour = torch.log(torch.tensor([[0.1, 0.4, 0.3], [0.3, 0.3, 0.3]]))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -0.5])  # [2]
    loss, m = tis_reinforce_loss(logp, behaviour, None, adv, mask, LossSettings(), is_cap=2.5)
    loss.backward()
    w = torch.tensor([[2.0, 1.0, 2.5], [1.0, 1.0, 0.0]])  # ratios 2, 1, 3 -> capped at 2.5
    expected = -w * adv[:, None] * mask / mask.sum()  # token aggregation: divide by 5 tokens
    torch.testing.assert_close(logp.grad, expected)
    assert m["capped_frac"] == pytest.approx(1 / 5)
    assert m["is_weight_mean"] == pytest.approx((2 + 1 + 2.5 + 1 + 1) / 5)


def test_tis_reinforce_adds_k3_kl_and_needs_reference_when_beta_positive() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = LossSettings(kl_beta=0.1)
    loss, m = tis_reinforce_loss(logp, logp.detach(), ref, torch.zeros(1), mask, cfg, is_cap=2.0)
    d = math.log(0.5)
    assert float(loss.detach()) == pytest.approx(0.1 * (math.exp(d) - d - 1))  # advantage 0: KL only
    assert m["kl"] == pytest.approx(math.exp(d) - d - 1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        tis_reinforce_loss(logp, logp.detach(), None, torch.zeros(1), mask, cfg, is_cap=2.0)


def test_online_algorithm_uses_the_truncated_loss() -> None:
    algo = make_online_algorithm(TrainerConfig(), is_cap=1.5)
    logp = torch.zeros(1, 1, requires_grad=True)
    loss, m = algo.loss(logp, torch.tensor([[-5.0]]), None, torch.ones(1), torch.ones(1, 1, dtype=torch.bool))
    assert m["is_weight_mean"] == pytest.approx(1.5)  # exp(5) capped; PPO's clip has no such key
    assert algo.name == "reinforce_tis"


def test_ema_baseline_takes_advantages_before_it_moves() -> None:
    b = EmaBaseline(decay=0.5)
    scores = torch.tensor([1.0, 0.0])
    torch.testing.assert_close(b.advantages(scores), scores)  # starts at 0
    b.update(scores)
    assert b.value == pytest.approx(0.25)
    torch.testing.assert_close(b.advantages(torch.tensor([1.0])), torch.tensor([0.75]))


def test_leave_one_out_baselines_a_batch_by_its_other_scores() -> None:
    b = EmaBaseline(decay=0.5, value=-0.9, leave_one_out=True)
    scores = torch.tensor([1.0, -1.0, -1.0, -0.5])
    adv = b.advantages(scores)
    # each against the mean of the other three; the running value (-0.9) plays no part
    torch.testing.assert_close(adv, torch.tensor([1.0 + 2.5 / 3, -1.0 + 0.5 / 3, -1.0 + 0.5 / 3, -0.5 + 1.0 / 3]))
    assert float(adv.sum()) == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(b.advantages(torch.tensor([-1.0, -1.0])), torch.zeros(2))  # no signal
    torch.testing.assert_close(b.advantages(torch.tensor([-0.5])), torch.tensor([0.4]))  # one: the value
    b.update(scores)  # the running value still follows, for batches of one
    assert b.value == pytest.approx(0.5 * -0.9 + 0.5 * -1.5 / 4)


def test_negative_advantages_are_weighted_and_positive_ones_kept() -> None:
    b = EmaBaseline(decay=0.5, value=-0.5, negative_weight=0.25)
    # against the running value: +1 -> +1.5 as it is, -1 -> -0.5 weighted to -0.125
    torch.testing.assert_close(b.advantages(torch.tensor([1.0, -1.0])), torch.tensor([1.5, -0.125]))
    loo = EmaBaseline(decay=0.5, leave_one_out=True, negative_weight=0.0)
    torch.testing.assert_close(loo.advantages(torch.tensor([1.0, -1.0, -1.0])),
                               torch.tensor([2.0, 0.0, 0.0]))  # 0: only what beat the others
    assert OnlineConfig().negative_weight == 1.0  # REINFORCE as it is unless asked
    with pytest.raises(ValidationError):
        OnlineConfig(negative_weight=1.5)


def test_serve_average_is_off_unless_asked_and_below_one() -> None:
    assert OnlineConfig().serve_average == 0.0  # each version the adapter as trained
    assert OnlineConfig(serve_average=0.8).serve_average == 0.8
    for bad in (1.0, -0.1):  # at 1 the served weights would never move
        with pytest.raises(ValidationError):
            OnlineConfig(serve_average=bad)


def test_a_lineages_kl_coefficient_is_its_own_and_steers_toward_the_target() -> None:
    from services.trainer.learner.algorithms import AdaptiveKl

    cfg = TrainerConfig(loss=LossSettings(kl_beta=0.1))
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.full((1, 2), -1.0)  # k3 = e^-1 - (-1) - 1 = 0.368 per token
    args = (logp, logp.detach(), ref, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool))
    fixed, _ = make_online_algorithm(cfg, is_cap=2.0).loss(*args)
    steered, m = make_online_algorithm(cfg, is_cap=2.0, kl_beta=0.4).loss(*args)
    assert float(steered.detach()) == pytest.approx(4 * float(fixed.detach())) and m["kl"] == pytest.approx(math.exp(-1))
    assert cfg.loss.kl_beta == 0.1  # the section is not changed for the other lanes
    kl = AdaptiveKl(0.1, target=0.1, horizon=10, floor=0.1)
    kl.update(0.0, samples=10)  # at the base: the floor holds
    assert kl.coef == 0.1
    kl.update(0.4, samples=2)  # 4x over: +20% of the way, times 2 / 10
    assert kl.coef == pytest.approx(0.1 * 1.04)
    for _ in range(40):
        kl.update(0.4, samples=2)
    assert kl.coef > 0.4  # a lineage that keeps drifting is held back harder
    before = kl.coef
    kl.update(0.0, samples=10)  # back at the base: eased off, by at most 20% per horizon
    assert kl.coef == pytest.approx(0.8 * before)


def fb(**kw) -> bus_pb2.FeedbackEvent:
    return bus_pb2.FeedbackEvent(**{"response_id": "r", "score": 1.0, **kw})


@pytest.mark.parametrize("event,needle", [
    (fb(response_id=""), "empty response_id"),
    (bus_pb2.FeedbackEvent(response_id="r"), "score not set"),
    (fb(score=float("nan")), "outside [-1, 1]"),
    (fb(score=1.5), "outside [-1, 1]"),
    (fb(score=-1.01), "outside [-1, 1]"),
])
def test_malformed_feedback_has_a_reason(event, needle) -> None:
    assert needle in malformed(event)


def test_valid_feedback_passes() -> None:
    assert malformed(fb(score=-1.0)) is None and malformed(fb(score=0.0)) is None


def tr(**kw) -> bus_pb2.TrafficEvent:
    base = {"response_id": "r", "prompt_ids": [1, 2], "completion_ids": [3, 4], "logprobs": [-0.1, -2.0]}
    return bus_pb2.TrafficEvent(**{**base, **kw})


def test_bad_traffic_reasons() -> None:
    assert bad_traffic(tr()) is None
    assert "2 completion ids but 1 logprobs" in bad_traffic(tr(logprobs=[-0.1]))
    assert "empty completion" in bad_traffic(tr(completion_ids=[], logprobs=[]))
    assert "empty prompt" in bad_traffic(tr(prompt_ids=[]))
    assert "finite" in bad_traffic(tr(logprobs=[0.5, -1.0]))


def test_staleness_by_oldest_token_version_and_by_age() -> None:
    job = OnlineConfig(max_staleness_versions=2, max_staleness_s=60)
    spans = [common_pb2.VersionSpan(version=3, first_token=0), common_pb2.VersionSpan(version=6, first_token=1)]
    assert served_version(tr(policy_version=3, version_spans=spans)) == 3
    assert served_version(tr(policy_version=4)) == 4
    assert stale(tr(policy_version=4, served_at=100.0), 6, 110.0, job) is None  # 2 behind: kept
    assert stale(tr(policy_version=3, served_at=100.0), 6, 110.0, job) == "stale_version"
    assert stale(tr(policy_version=6, version_spans=spans, served_at=100.0), 6, 110.0, job) == "stale_version"
    assert stale(tr(policy_version=6, served_at=100.0), 6, 161.0, job) == "stale_age"


def test_online_config_documents_every_field_and_enforces_bounds() -> None:
    OnlineConfig()
    assert not [n for n, f in OnlineConfig.model_fields.items() if not f.description]
    for bad in ({"batch_size": 0}, {"is_cap": 0.9}, {"baseline_ema": 1.0}, {"max_queue": 0},
                {"durable": "has.dot"}, {"unknown": 1}, {"max_staleness_s": 0}):
        with pytest.raises(ValidationError):
            OnlineConfig.model_validate(bad)


def test_a_stopping_intake_ends_even_when_its_fetch_swallows_the_cancel() -> None:
    """Python 3.11's wait_for (under nats-py's fetch) can turn a cancellation that lands as its
    timeout fires into a timeout, which the consumer reads as "nothing yet". The intake must
    still end once the loop stops it, not fetch on until the process gives up on it."""
    import asyncio

    from services.trainer.recipes.online import Counters, FeedbackQueue, Intake

    class SwallowingConsumer:  # what the bus's PullConsumer does after a swallowed cancel
        fetches, swallowed = 0, False

        async def fetch(self, batch, timeout_s):
            self.fetches += 1
            try:
                await asyncio.sleep(timeout_s)
            except asyncio.CancelledError:
                if self.swallowed:  # only the first: a failing test must not hang
                    raise
                self.swallowed = True
            return []

    async def main() -> tuple[bool, int]:
        consumer = SwallowingConsumer()
        intake = Intake(consumer, FeedbackQueue(4), {}, set(), Counters(), 2)
        task = asyncio.create_task(intake.run())
        await asyncio.sleep(0.05)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2.0)
        if not done:
            task.cancel()
        return bool(done), consumer.fetches

    ended, fetches = asyncio.run(main())
    assert ended and fetches == 1


def test_a_checkpoint_cancelled_twice_still_sends_every_ack_and_its_step_ends() -> None:
    """A stopping trainer cancels its loop at the signal and again at its cleanup. A save in
    flight (checkpoint, then the acks it covers) must finish through both, and the step must
    return its record before the stop goes on: otherwise some acks have left with no step
    record of the feedback they cover (CI counted 14 of 15 feedback after a SIGTERM)."""
    import asyncio
    from types import SimpleNamespace

    from services.trainer.recipes.online import Online

    async def main() -> tuple[list[int], list[int], bool]:
        release = asyncio.Event()
        acked: list[int] = []

        async def save() -> None:  # the acks go out one await at a time
            for seq in range(3):
                await release.wait()
                acked.append(seq)
                await asyncio.sleep(0)

        async def step() -> tuple[list[int], bool]:
            await Online.save_whole(SimpleNamespace(save=save))
            record = list(acked)  # the step's record, written before the stop goes on
            try:
                await asyncio.sleep(0)  # the runner's next await
            except asyncio.CancelledError:
                return record, True
            return record, False

        task = asyncio.create_task(step())
        await asyncio.sleep(0.01)
        task.cancel()  # the signal
        await asyncio.sleep(0.01)
        task.cancel()  # the cleanup
        await asyncio.sleep(0.01)
        release.set()
        record, stopped = await asyncio.wait_for(task, 5)
        return record, acked, stopped

    record, acked, stopped = asyncio.run(main())
    assert acked == [0, 1, 2] and record == acked and stopped


def test_the_kl_needs_a_reference_service_only_where_it_is_asked(make_cfg):
    from hotloop.config import MeshConfig
    from services.trainer.runner import _check_online_mesh

    no_reference = MeshConfig.model_validate({"nats": {"url": "nats://127.0.0.1:1"},
                                              "endpoints": {"rollout": ["127.0.0.1:2"]}})
    kl = make_cfg(loss={"kl_beta": 0.1})
    with pytest.raises(SystemExit, match="reference = 'service' needs the reference service"):
        _check_online_mesh(no_reference, kl, OnlineConfig())
    _check_online_mesh(no_reference, kl, OnlineConfig(reference="colocated"))  # the trainer's own base
    _check_online_mesh(no_reference, make_cfg(loss={"kl_beta": 0.0}), OnlineConfig())


def test_kl_target_needs_a_starting_kl_beta() -> None:
    from hotloop.config import MeshConfig
    from services.trainer.runner import _check_online_mesh

    mesh = MeshConfig.model_validate({"nats": {"url": "nats://127.0.0.1:1"},
                                      "endpoints": {"rollout": "127.0.0.1:2"}})
    with pytest.raises(SystemExit, match="kl_target steers the KL coefficient"):
        _check_online_mesh(mesh, TrainerConfig(), OnlineConfig(kl_target=0.1))
    _check_online_mesh(mesh, TrainerConfig(loss=LossSettings(kl_beta=0.1)),
                       OnlineConfig(kl_target=0.1, reference="colocated"))
