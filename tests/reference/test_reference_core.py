"""ReferenceCore: agreement with the trainer's base logprobs, ordering, validation, streaming.

Tolerances (tiny model, measured on this CPU), reference vs the trainer's adapter-disabled
`base_logprobs`, both on the shared `hotloop.logprobs` code path:
- fp32: within 1e-6 even when the two split the batch differently (padding only changes matmul
  shapes); asserted < 1e-5.
- bf16 (both under autocast), same micro-batch split: bitwise equal.
- bf16, different split: up to ~4e-3 per token. bf16 kernels round differently for different
  row counts / padded lengths, so a sequence's logprobs depend on its batch mates; asserted
  < 2e-2. Still far below a PPO clip of 0.2 on the ratio, and k3 KL of such noise is ~1e-5.
- bf16 vs fp32 of the same model: ~8e-3 per token, which is why the reference must run in the
  trainer's dtype (ReferenceConfig.dtype).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from services.reference.config import ReferenceConfig
from services.reference.core import (
    LogprobsRequest,
    LogprobsResult,
    ReferenceBackend,
    ReferenceCore,
)
from services.trainer.config import TrainerConfig
from services.trainer.learner.policy import LoraPolicy


def _requests(n: int, seed: int = 0) -> list[LogprobsRequest]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = (int(x) for x in torch.randint(1, 16, (2,), generator=g))
        out.append(
            LogprobsRequest(
                id=f"r{i}",
                prompt_ids=torch.randint(3, 400, (p,), generator=g).tolist(),
                completion_ids=torch.randint(3, 400, (c,), generator=g).tolist(),
            )
        )
    return out


@pytest.fixture(scope="module")
def cores(tiny_model: Path) -> dict[tuple[str, int], ReferenceCore]:
    """(dtype, token_budget) -> core. Budget 48 splits the test batches into several
    micro-batches; 4096 matches the trainer's single micro-batch below."""
    return {
        (dt, budget): ReferenceCore(
            ReferenceConfig(model=str(tiny_model), dtype=dt, token_budget=budget)
        )
        for dt in ("float32", "bfloat16")
        for budget in (48, 4096)
    }


def _gap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    return max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r, s))


@pytest.mark.parametrize(
    ("dtype", "budget", "tolerance"),
    [("float32", 48, 1e-5), ("bfloat16", 4096, 0.0), ("bfloat16", 48, 2e-2)],
)
def test_agrees_with_the_trainer_base_logprobs(cores, tiny_model, dtype, budget, tolerance) -> None:
    reqs = _requests(10, seed=1)
    got = cores[dtype, budget].logprobs(reqs)
    assert [r.id for r in got] == [r.id for r in reqs]
    policy = LoraPolicy(
        TrainerConfig(model=str(tiny_model), dtype=dtype, micro_batch_tokens=4096)
    )
    with torch.no_grad():  # a trained (non-zero) adapter must not leak into base logprobs
        for _, p in policy.trainable_parameters():
            p.normal_(std=0.05)
    expected = policy.base_logprobs([(r.prompt_ids, r.completion_ids) for r in reqs])
    assert _gap([r.logprobs for r in got], expected) <= tolerance


def test_shared_prompts_score_as_whole_rows(cores, tiny_model) -> None:
    """A stream batch holds GRPO groups (each prompt G times): running each prompt once gives
    the same logprobs as whole rows, and the trainer's colocated reference still agrees
    exactly in bf16 (the same plan, the same ops)."""
    from tests.trainer.conftest import _grouped_pairs

    pairs = _grouped_pairs(3, 4, seed=3)
    reqs = [LogprobsRequest(f"g{i}", p, c) for i, (p, c) in enumerate(pairs)]
    plain = ReferenceCore(ReferenceConfig(model=str(tiny_model), dtype="float32",
                                          token_budget=48, share_prompts=False))
    got = cores["float32", 48].logprobs(reqs)
    assert _gap([r.logprobs for r in got], [r.logprobs for r in plain.logprobs(reqs)]) <= 1e-5
    assert [len(r.logprobs) for r in got] == [len(c) for _, c in pairs]
    policy = LoraPolicy(TrainerConfig(model=str(tiny_model), dtype="bfloat16",
                                      micro_batch_tokens=4096))
    bf16 = cores["bfloat16", 4096].logprobs(reqs)
    assert _gap([r.logprobs for r in bf16], policy.base_logprobs(pairs)) == 0.0


def test_bf16_differs_from_fp32_by_a_bounded_gap(cores) -> None:
    reqs = _requests(10, seed=2)
    fp32, bf16 = cores["float32", 4096].logprobs(reqs), cores["bfloat16", 4096].logprobs(reqs)
    gap = _gap([r.logprobs for r in fp32], [r.logprobs for r in bf16])
    assert 1e-4 < gap < 0.1, gap


def test_invalid_requests_raise_value_error(cores) -> None:
    core = cores["float32", 48]
    with pytest.raises(ValueError, match="empty prompt"):
        core.logprobs([LogprobsRequest("a", [], [1])])
    with pytest.raises(ValueError, match="outside"):
        core.logprobs([LogprobsRequest("a", [1], [10**6])])
    assert core.logprobs([]) == []
    (empty,) = core.logprobs([LogprobsRequest("e", [1, 2], [])])
    assert empty == LogprobsResult("e", [])


class RecordingBackend(ReferenceBackend):
    """Fake: logprob -k for the k-th completion token; records the batches it was given."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        self.batches.append(len(pairs))
        for p, _ in pairs:
            if not p:
                raise ValueError("empty prompt")
        return [[-float(k) for k in range(len(c))] for _, c in pairs]


def _req(i: int, tokens: int = 4) -> LogprobsRequest:
    return LogprobsRequest(f"r{i}", [1] * (tokens // 2), [2] * (tokens - tokens // 2))


async def test_stream_batches_what_is_waiting_within_the_budget() -> None:
    backend = RecordingBackend()
    core = ReferenceCore(ReferenceConfig(token_budget=16), backend=backend)
    gate = asyncio.Event()

    async def requests():
        for i in range(6):  # 6 x 4 tokens arrive at once: budget 16 -> batches of 4 and 2
            yield _req(i)
        await gate.wait()  # the rest arrives only after the first results are out
        for i in range(6, 8):
            yield _req(i)

    ids = []
    async for result in core.stream(requests()):
        ids.append(result.id)
        assert result.logprobs == [0.0, -1.0]
        gate.set()
    assert ids == [f"r{i}" for i in range(8)]
    assert backend.batches == [4, 2, 2]


async def test_stream_propagates_errors() -> None:
    core = ReferenceCore(ReferenceConfig(), backend=RecordingBackend())

    async def broken():
        yield _req(0)
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError, match="client went away"):
        async for _ in core.stream(broken()):
            pass

    async def invalid():
        yield LogprobsRequest("bad", [], [1])

    with pytest.raises(ValueError, match="empty prompt"):
        async for _ in core.stream(invalid()):
            pass


async def test_stream_with_the_torch_backend_matches_the_batch_call(cores) -> None:
    core = cores["float32", 48]
    reqs = _requests(5, seed=3)

    async def source():
        for r in reqs:
            yield r

    streamed = [r async for r in core.stream(source())]
    batch = core.logprobs(reqs)
    # The stream groups by arrival, the batch call by length: fp32 noise only.
    assert [r.id for r in streamed] == [r.id for r in batch]
    assert _gap([r.logprobs for r in streamed], [r.logprobs for r in batch]) < 1e-5
