"""PolyakAverage: the running average a lineage serves (`[online] serve_average`)."""

from __future__ import annotations

import pytest
import torch

from services.trainer.learner.averaging import PolyakAverage


def test_the_average_follows_the_trained_tensors_by_its_decay() -> None:
    start = [torch.zeros(2, 3), torch.ones(4)]
    avg = PolyakAverage(0.75, start)
    target = [torch.full((2, 3), 8.0), torch.full((4,), 5.0)]
    for k in range(1, 4):
        avg.update(target)
        # s_k = theta + decay^k (s_0 - theta) for a theta that stays put
        assert torch.allclose(avg.tensors[0], torch.full((2, 3), 8.0 * (1 - 0.75 ** k)))
        assert torch.allclose(avg.tensors[1], torch.full((4,), 5.0 + 0.75 ** k * (1 - 5.0)))
    assert start[0].eq(0).all() and start[1].eq(1).all()  # the start was copied, not moved


def test_decay_zero_is_the_latest_and_a_step_moves_it_by_one_minus_decay() -> None:
    avg = PolyakAverage(0.0, [torch.zeros(3)])
    avg.update([torch.tensor([1.0, 2.0, 3.0])])
    assert avg.tensors[0].tolist() == [1.0, 2.0, 3.0]
    avg = PolyakAverage(0.8, [torch.zeros(1)])
    avg.update([torch.ones(1)])
    assert avg.tensors[0].item() == pytest.approx(0.2)


def test_a_bfloat16_adapter_is_averaged_in_float32() -> None:
    """A fifth of a small step is below bfloat16's resolution near 1: kept, not rounded away."""
    one = torch.ones(8, dtype=torch.bfloat16)
    avg = PolyakAverage(0.8, [one])
    avg.update([one + 2 ** -6])  # 1/64: a step bfloat16 holds; a fifth of it, it does not
    assert avg.tensors[0].dtype == torch.float32
    assert avg.tensors[0][0].item() == pytest.approx(1 + 0.2 * 2 ** -6)


def test_saved_average_loads_back_and_a_checkpoint_without_one_says_so(tmp_path) -> None:
    avg = PolyakAverage(0.5, [torch.zeros(2, 2), torch.zeros(3)])
    avg.update([torch.randn(2, 2), torch.randn(3)])
    avg.save(tmp_path / "average")
    other = PolyakAverage(0.5, [torch.zeros(2, 2), torch.zeros(3)])
    assert other.load(tmp_path / "average")
    assert all(torch.equal(a, b) for a, b in zip(avg.tensors, other.tensors))
    assert not other.load(tmp_path / "none")  # written without averaging, or a reset
    assert all(torch.equal(a, b) for a, b in zip(avg.tensors, other.tensors))


def test_tensors_of_another_layout_are_refused(tmp_path) -> None:
    avg = PolyakAverage(0.5, [torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="2 tensors for an average of 1"):
        avg.update([torch.zeros(2, 2), torch.zeros(1)])
    with pytest.raises(ValueError, match="shape"):
        avg.update([torch.zeros(3)])
    PolyakAverage(0.5, [torch.zeros(5)]).save(tmp_path / "a")
    with pytest.raises(ValueError, match="shape"):
        avg.load(tmp_path / "a")
    with pytest.raises(ValueError, match="decay"):
        PolyakAverage(1.0, [torch.zeros(1)])
