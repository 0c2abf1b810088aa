"""Per-token logprobs of completions, computed only where they are needed.

Owns: packing (prompt_ids, completion_ids) pairs into a right-padded batch, planning
micro-batches by a padded-token budget, and `completion_logprobs`, the one function that both
the trainer (policy logprobs, with gradients) and the reference service (frozen base logprobs)
use, so that the two agree by construction.

Why not `model(...).logits`: SmolLM2's vocabulary is 49,152 wide, so full logits over every
position (prompt included) dominate time and memory on a CPU (NOTES.md). Here the transformer
body runs once, the hidden states at the positions that predict completion tokens are gathered,
and the output head plus a float32 log-softmax run over those rows only, in chunks.

Does not own: loading models, optimizers, losses, or any service's request types. This module
imports torch at the top; it is never imported by `hotloop/__init__.py` or the CLI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class CompletionBatch:
    """Right-padded prompt+completion rows. B rows, T = longest prompt+completion,
    Tc = longest completion.

    Right padding with causal attention means no real token ever attends to a pad, so
    position ids are plain `arange(T)` for every row and the pads' outputs are never read.
    Packing several sequences per row would save padding, but HF's SDPA attention does not
    isolate packed sequences (only flash-attention varlen does), so we sort by length instead
    (see `plan_micro_batches`).
    """

    input_ids: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] long, 1 on real tokens
    position_ids: Tensor  # [B, T] long
    prompt_lens: Tensor  # [B] long, >= 1
    completion_ids: Tensor  # [B, Tc] long, 0 on padding
    completion_mask: Tensor  # [B, Tc] bool

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())


@dataclass(frozen=True)
class CompletionLogprobs:
    logprobs: Tensor  # [B, Tc] float32, 0 where ~mask
    mask: Tensor  # [B, Tc] bool
    entropy: Tensor | None = None  # [B, Tc] float32 (detached), 0 where ~mask

    def rows(self) -> list[list[float]]:
        """Unpadded logprobs per row, as plain floats (what crosses a service edge)."""
        lp = self.logprobs.detach().cpu()
        return [lp[i, m].tolist() for i, m in enumerate(self.mask.cpu())]


def collate(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0
) -> CompletionBatch:
    """Build a right-padded batch from (prompt_ids, completion_ids) pairs.

    A prompt must have at least one token: the first completion token is predicted from the
    hidden state of the last prompt token. An empty completion is allowed (an all-False row).
    """
    if not pairs:
        raise ValueError("collate needs at least one (prompt_ids, completion_ids) pair")
    for i, (p, _) in enumerate(pairs):
        if len(p) == 0:
            raise ValueError(f"pair {i} has an empty prompt; at least one token is required")
    lens = [len(p) + len(c) for p, c in pairs]
    B, T, Tc = len(pairs), max(lens), max(len(c) for _, c in pairs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    completion_ids = torch.zeros((B, Tc), dtype=torch.long)
    completion_mask = torch.zeros((B, Tc), dtype=torch.bool)
    for i, (p, c) in enumerate(pairs):
        input_ids[i, : lens[i]] = torch.tensor([*p, *c], dtype=torch.long)
        attention_mask[i, : lens[i]] = 1
        completion_ids[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        completion_mask[i, : len(c)] = True
    return CompletionBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=torch.arange(T, dtype=torch.long).expand(B, T),
        prompt_lens=torch.tensor([len(p) for p, _ in pairs], dtype=torch.long),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
    )


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sequence indices so each group's padded size (rows x longest) fits the budget.

    Sorting by length (longest first) keeps padding small; each group lists indices into
    `lengths`, so callers scatter results back to the original order. A sequence longer than
    the budget gets a group of its own rather than an error: the budget bounds memory for
    normal batches, it is not a validation rule (max lengths are enforced upstream).
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        # Sorted descending: a group's first member is its longest, so padded = rows * first.
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def split_model(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(body, head) of a causal LM, seen through a peft wrapper if there is one.

    peft injects LoRA layers into the wrapped model's own modules, so the body found here
    runs with the adapter (and honours `disable_adapter()`); `all-linear` LoRA never targets
    the output head.
    """
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    body, head = lm.get_decoder(), lm.get_output_embeddings()
    if body is None or head is None:
        raise TypeError(f"{type(lm).__name__} exposes no decoder/output head")
    return body, head


@dataclass(frozen=True)
class CompletionHidden:
    """The body's hidden state at each position that predicts a completion token.

    For token t of row b that is position prompt_len[b] - 1 + t: the state *before* the token,
    which is what both the output head (its logprob) and a value head (V of that state) read.
    """

    hidden: Tensor  # [N, H], N completion tokens in row-major order of `mask`
    rows: Tensor  # [N] long
    cols: Tensor  # [N] long
    mask: Tensor  # [B, Tc] bool

    def scatter(self, values: Tensor) -> Tensor:
        """[N] per-token values -> [B, Tc] float32, 0 where ~mask (keeps the graph)."""
        out = torch.zeros(self.mask.shape, dtype=torch.float32, device=self.mask.device)
        if values.numel() == 0:
            return out
        return out.index_put((self.rows, self.cols), values.float())


def completion_hidden(model: nn.Module, batch: CompletionBatch) -> CompletionHidden:
    """Run the transformer body once and gather the hidden states at the positions that
    predict completion tokens (see `CompletionHidden`). Differentiable under the caller's
    grad / autocast context."""
    body, head = split_model(model)
    device = next(head.parameters()).device
    hidden = body(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
        use_cache=False,
    ).last_hidden_state  # [B, T, H]
    mask = batch.completion_mask.to(device)  # [B, Tc]
    rows, cols = mask.nonzero(as_tuple=True)  # [N], [N]: N completion tokens, row-major
    src = batch.prompt_lens.to(device)[rows] - 1 + cols  # [N]
    return CompletionHidden(hidden=hidden[rows, src], rows=rows, cols=cols, mask=mask)


def completion_logprobs(
    model: nn.Module,
    batch: CompletionBatch,
    *,
    chunk_tokens: int = 512,
    temperature: float = 1.0,
    with_entropy: bool = False,
    hidden: CompletionHidden | None = None,
) -> CompletionLogprobs:
    """log p(c_t | prompt, c_<t) for every completion token, [B, Tc], differentiable.

    Runs under whatever grad / autocast context the caller sets. The head runs on at most
    `chunk_tokens` rows at a time and the log-softmax is in float32 (bf16 logprobs are off by
    ~1e-2, enough to bias an importance ratio). Logits are divided by `temperature` so the
    result describes the distribution the sampler drew from, when it sampled with one.
    Entropy is computed without gradients (it is a metric here, not a loss term).
    `hidden`: the body's gathered states when the caller already ran it (PPO's shared-trunk
    critic reads the same states), so the body runs once.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _, head = split_model(model)
    ch = hidden if hidden is not None else completion_hidden(model, batch)
    h = ch.hidden  # [N, H]
    targets = batch.completion_ids.to(h.device)[ch.rows, ch.cols]  # [N]

    token_lp: list[Tensor] = []
    token_ent: list[Tensor] = []
    for start in range(0, h.shape[0], chunk_tokens):
        logits = head(h[start : start + chunk_tokens]).float()  # [C, V]
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)  # [C, V]
        token_lp.append(logp.gather(-1, targets[start : start + chunk_tokens, None])[:, 0])
        if with_entropy:
            with torch.no_grad():
                token_ent.append(-(logp.exp() * logp).sum(-1))  # [C]

    # index_put keeps the graph: gradients flow back only into the gathered rows.
    out = ch.scatter(torch.cat(token_lp)) if token_lp else ch.scatter(h.new_zeros(0))
    entropy = None
    if with_entropy:
        entropy = ch.scatter(torch.cat(token_ent)) if token_ent else ch.scatter(h.new_zeros(0))
    return CompletionLogprobs(logprobs=out, mask=ch.mask, entropy=entropy)
