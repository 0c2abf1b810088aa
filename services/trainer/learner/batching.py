"""Training samples and their micro-batches.

Owns: `Sample` (one scored completion as the trainer receives it) and turning a step's samples
into padded micro-batches that fit a token budget, each remembering which samples it holds.
The budget planning and padding themselves are shared with the reference service
(`hotloop.logprobs`). Does not own: loss normalisation across micro-batches (policy.py passes
one whole-batch normalizer to every micro-batch) or where samples come from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hotloop.logprobs import CompletionBatch, PromptSet, plan_batches


@dataclass(frozen=True)
class Sample:
    """One completion with everything the loss needs.

    old_logprobs: the rollout engine's logprob of each sampled completion token.
    advantage: one value for the whole sequence (GRPO, REINFORCE) or one per token.
    ref_logprobs: the reference model's logprob per token; None when the KL term is off.
    returns, old_values: PPO's value targets and the critic's values at rollout time, per
    token; None for critic-free algorithms.
    """

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    old_logprobs: Sequence[float]
    advantage: float | Sequence[float]
    ref_logprobs: Sequence[float] | None = None
    returns: Sequence[float] | None = None
    old_values: Sequence[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.prompt_ids) == 0:
            raise ValueError("a sample needs at least one prompt token")
        if len(self.old_logprobs) != n:
            raise ValueError(f"old_logprobs has {len(self.old_logprobs)} values for {n} tokens")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"ref_logprobs has {len(self.ref_logprobs)} values for {n} tokens")
        for name in ("returns", "old_values"):
            seq = getattr(self, name)
            if seq is not None and len(seq) != n:
                raise ValueError(f"{name} has {len(seq)} values for {n} tokens")
        if (self.returns is None) != (self.old_values is None):
            raise ValueError("returns and old_values come together (PPO) or not at all")
        if not isinstance(self.advantage, (int, float)) and len(self.advantage) != n:
            raise ValueError(f"advantage has {len(self.advantage)} values for {n} tokens")

    @property
    def num_tokens(self) -> int:
        """Prompt + completion: what a forward pass over this sample costs."""
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(frozen=True)
class MicroBatch:
    """Samples `indices` (positions in the step's list), padded to [B, Tc] per token."""

    indices: list[int]
    batch: CompletionBatch
    old_logprobs: Tensor  # [B, Tc] float32
    ref_logprobs: Tensor | None  # [B, Tc] float32
    advantages: Tensor  # [B, Tc] float32 (a sequence-level advantage is repeated per token)
    returns: Tensor | None = None  # [B, Tc] float32, PPO's value targets
    old_values: Tensor | None = None  # [B, Tc] float32, the critic at rollout time

    @property
    def mask(self) -> Tensor:  # [B, Tc] bool
        return self.batch.completion_mask


def _pad(rows: Sequence[Sequence[float]], width: int) -> Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)  # [B, Tc]
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(list(r), dtype=torch.float32)
    return out


def check_samples(samples: Sequence[Sample]) -> None:
    """What a batch must hold as a whole (each `Sample` checks itself): reference logprobs on
    every sample or none, PPO's value targets on every sample or none."""
    with_ref = [s.ref_logprobs is not None for s in samples]
    if any(with_ref) and not all(with_ref):
        raise ValueError("either every sample carries ref_logprobs or none does")
    with_values = [s.returns is not None for s in samples]
    if any(with_values) and not all(with_values):
        raise ValueError("either every sample carries returns and old_values or none does")


def make_micro_batches(
    samples: Sequence[Sample], token_budget: int, pad_id: int = 0, share_prompts: bool = True,
) -> tuple[list[MicroBatch], PromptSet | None]:
    """Split samples into padded micro-batches of at most `token_budget` padded tokens
    (a single sample over the budget gets one of its own), and the prompts they share, which
    the caller runs once (`hotloop.logprobs.plan_batches`; None: each row runs its prompt)."""
    check_samples(samples)
    with_ref = [s.ref_logprobs is not None for s in samples]
    with_values = [s.returns is not None for s in samples]
    out = []
    plan = plan_batches([(s.prompt_ids, s.completion_ids) for s in samples], token_budget,
                        pad_id, share_prompts)
    for idx, batch in plan.batches:
        group = [samples[i] for i in idx]
        width = batch.completion_ids.shape[1]
        advantages = [
            [float(s.advantage)] * len(s.completion_ids)
            if isinstance(s.advantage, (int, float))
            else s.advantage
            for s in group
        ]
        out.append(
            MicroBatch(
                indices=idx,
                batch=batch,
                old_logprobs=_pad([s.old_logprobs for s in group], width),
                ref_logprobs=(
                    _pad([s.ref_logprobs for s in group], width)  # type: ignore[misc]
                    if all(with_ref)
                    else None
                ),
                advantages=_pad(advantages, width),
                returns=_pad([s.returns for s in group], width) if all(with_values) else None,  # type: ignore[misc]
                old_values=(
                    _pad([s.old_values for s in group], width)  # type: ignore[misc]
                    if all(with_values)
                    else None
                ),
            )
        )
    return out, plan.prompts
