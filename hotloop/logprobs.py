"""Per-token logprobs of completions, computed only where they are needed.

Owns: packing (prompt_ids, completion_ids) pairs into a right-padded batch, planning
micro-batches by a padded-token budget, running a prompt that several completions share once
(`plan_batches`, `prompt_states`), and `completion_logprobs`, the one function that both the
trainer (policy logprobs, with gradients) and the reference service (frozen base logprobs) use,
so that the two agree by construction.

Why not `model(...).logits`: SmolLM2's vocabulary is 49,152 wide, so full logits over every
position (prompt included) dominate time and memory on a CPU (docs/results.md). Here the transformer
body runs once, the hidden states at the positions that predict completion tokens are gathered,
and the output head plus a float32 log-softmax run over those rows only, in chunks.

Why shared prompts: GRPO and PPO sample G completions of each prompt, so a step's batch holds
each prompt G times. The body runs each distinct prompt once (`prompt_states`, keeping its
keys and values per layer), and the completions of every micro-batch attend to those states
as a KV cache. Exact: a completion token sees the same keys and values either way, and the
gradient reaches the prompt's adapter weights through them (`PromptStates.leaves`, then one
`backward_into`). On the demo's batch (8 prompts of ~81 tokens x 8 completions of ~100) the
body runs on ~40% fewer tokens; the LoRA step and the reference measured 1.6-1.7x faster.
Models with sliding-window or hybrid attention take whole rows (`can_share_prompts`).

Why a shared trunk: LoRA on the top layers only (`[trainer.lora] top_layers`) leaves the
layers below them the base's, so the policy and its colocated reference (the same model, the
adapter off) compute the same states up to the first adapted layer. `trunk_states` runs those
layers once per micro-batch, without a graph; each of the two then runs only the layers above
(`completion_logprobs(..., trunk=)`). Exact, like the shared prompts: the same layers on the
same inputs.

Does not own: loading models, optimizers, losses, or any service's request types. This module
imports torch at the top; it is never imported by `hotloop/__init__.py` or the CLI.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class CompletionBatch:
    """Right-padded prompt+completion rows. B rows, T = longest prompt+completion,
    Tc = longest completion.

    Right padding with causal attention means no real token ever attends to a pad, so
    position ids are plain `arange(T)` for every row and the pads' outputs are never read.
    Packing several sequences per row would save the padding; sorting by length keeps it small
    instead (see `plan_micro_batches`), and shared prompts (`plan_batches`) remove the larger
    waste, a group's prompt run once per sample.
    """

    input_ids: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] long, 1 on real tokens
    position_ids: Tensor  # [B, T] long
    prompt_lens: Tensor  # [B] long, >= 1
    completion_ids: Tensor  # [B, Tc] long, 0 on padding
    completion_mask: Tensor  # [B, Tc] bool
    # Row b's prompt in the plan's `PromptSet` ([B] long), when the plan shares prompts;
    # the full rows above stay valid, so a caller without the prompts' states can still run.
    prompt_index: Tensor | None = None

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())


@dataclass(frozen=True)
class CompletionLogprobs:
    logprobs: Tensor  # [B, Tc] float32, 0 where ~mask
    mask: Tensor  # [B, Tc] bool
    entropy: Tensor | None = None  # [B, Tc] float32 (detached), 0 where ~mask
    # [N, V] float32 (detached): every completion token's whole log-distribution, in the
    # batch's token order (`keep_distributions`); a later pass's `kl_to`
    distributions: Tensor | None = None
    kl: Tensor | None = None  # [B, Tc] float32, 0 where ~mask: KL(this || kl_to) per token

    def rows(self) -> list[list[float]]:
        """Unpadded logprobs per row, as plain floats (what crosses a service edge)."""
        lp = self.logprobs.detach().cpu()
        return [lp[i, m].tolist() for i, m in enumerate(self.mask.cpu())]


def collate(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0,
    prompt_index: Sequence[int] | None = None,
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
        prompt_index=None if prompt_index is None else torch.tensor(list(prompt_index),
                                                                    dtype=torch.long),
    )


def plan_micro_batches(lengths: Sequence[int], token_budget: int,
                       min_fill: float = 0.0) -> list[list[int]]:
    """Group sequence indices so each group's padded size (rows x longest) fits the budget.

    Sorting by length (longest first) keeps padding small; each group lists indices into
    `lengths`, so callers scatter results back to the original order. A sequence longer than
    the budget gets a group of its own rather than an error: the budget bounds memory for
    normal batches, it is not a validation rule (max lengths are enforced upstream).
    `min_fill` > 0 also closes a group, once it holds a quarter of the budget, before a
    sequence shorter than `min_fill` x its longest: each row then wastes less than
    1 - min_fill of its width to padding, at the price of more, smaller groups.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        # Sorted descending: a group's first member is its longest, so padded = rows * first.
        if groups:
            rows, first = len(groups[-1]), lengths[groups[-1][0]]
            fits = (rows + 1) * first <= token_budget
            ragged = lengths[i] < min_fill * first and rows * first >= token_budget // 4
            if fits and not ragged:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


COMPLETION_MIN_FILL = 0.8
"""Shared-prompt plans close a micro-batch before a completion shorter than this share of its
longest (once it holds a quarter of the budget): see `plan_micro_batches`."""


@dataclass(frozen=True)
class PromptSet:
    """The distinct prompts of a batch, right-padded: G rows, Lp = the longest."""

    input_ids: Tensor  # [G, Lp] long
    attention_mask: Tensor  # [G, Lp] long, 1 on real tokens
    lens: Tensor  # [G] long

    @property
    def tokens(self) -> int:
        """Padded tokens the body runs on (and keeps, with gradients, for a whole step)."""
        return int(self.input_ids.numel())


@dataclass(frozen=True)
class BatchPlan:
    """Micro-batches over a list of pairs: `batches` holds (indices into the pairs, their
    batch); `prompts` is set when the plan shares prompts (run them with `prompt_states`)."""

    batches: list[tuple[list[int], CompletionBatch]]
    prompts: PromptSet | None = None


def plan_batches(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], token_budget: int, pad_id: int = 0,
    share_prompts: bool = True,
) -> BatchPlan:
    """Micro-batches of at most `token_budget` padded tokens, with each distinct prompt run
    once when some prompt repeats (`share_prompts`).

    Sharing: the prompts' states stay alive (with their graph, when training) while every
    micro-batch runs, so they count against the budget of each one: completions are planned
    by their own lengths within what the prompts leave. Prompts over half the budget (long,
    mostly distinct prompts, where sharing saves little) take the plain plan.
    """
    if not pairs:
        raise ValueError("plan_batches needs at least one (prompt_ids, completion_ids) pair")
    for i, (p, _) in enumerate(pairs):
        if len(p) == 0:
            raise ValueError(f"pair {i} has an empty prompt; at least one token is required")
    # An empty completion has no logprob to compute and nothing to train: it is in no batch
    # (callers' rows start empty), so no micro-batch is ever all padding, without a graph.
    keep = [i for i, (_, c) in enumerate(pairs) if len(c) > 0]
    if not keep:
        return BatchPlan([])
    distinct: dict[tuple[int, ...], int] = {}
    index = {i: distinct.setdefault(tuple(pairs[i][0]), len(distinct)) for i in keep}
    longest = max(len(p) for p in distinct)

    def batches(lengths: list[int], budget: int, **kw) -> list[list[int]]:
        """plan_micro_batches over the kept pairs, as indices into `pairs`."""
        return [[keep[j] for j in idx] for idx in plan_micro_batches(lengths, budget, **kw)]

    if (not share_prompts or len(distinct) == len(keep)
            or len(distinct) * longest > token_budget // 2):
        lengths = [len(pairs[i][0]) + len(pairs[i][1]) for i in keep]
        return BatchPlan([(idx, collate([pairs[i] for i in idx], pad_id=pad_id))
                          for idx in batches(lengths, token_budget)])
    prompts = collate([(p, ()) for p in distinct], pad_id=pad_id)
    prompt_set = PromptSet(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask,
                           lens=prompts.prompt_lens)
    budget = token_budget - prompt_set.tokens
    # Completions alone vary more in length than whole rows do (a group's answers end
    # anywhere up to max_tokens), so padding would eat much of the saving: bound it.
    lengths = [len(pairs[i][1]) for i in keep]
    planned = [(idx, collate([pairs[i] for i in idx], pad_id=pad_id,
                             prompt_index=[index[i] for i in idx]))
               for idx in batches(lengths, budget, min_fill=COMPLETION_MIN_FILL)]
    return BatchPlan(planned, prompt_set)


def score_pairs(
    model: nn.Module,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    token_budget: int,
    pad_id: int = 0,
    share_prompts: bool = True,
    chunk_tokens: int = 512,
    temperature: float = 1.0,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> list[list[float]]:
    """Per-token logprobs of each pair's completion, in the order of `pairs`, planned by
    `plan_batches`: the one scoring loop of the trainer's policy (and its colocated reference)
    and of the reference service. Gradients: the caller's context (these two run it under
    inference mode); `autocast`: the compute-dtype context of every forward."""
    out: list[list[float]] = [[] for _ in pairs]
    plan = plan_batches(pairs, token_budget, pad_id, share_prompts)
    with autocast():
        prompts = None if plan.prompts is None else prompt_states(model, plan.prompts)
    for idx, batch in plan.batches:
        with autocast():
            lp = completion_logprobs(model, batch, chunk_tokens=chunk_tokens,
                                     temperature=temperature, prompts=prompts)
        for i, row in zip(idx, lp.rows()):
            out[i] = row
    return out


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


@dataclass(frozen=True)
class PromptStates:
    """What the body computed for a `PromptSet`: the keys and values of every layer (what a
    completion attends to) and the final hidden state at each prompt's last token (what
    predicts its first completion token)."""

    keys: list[Tensor]  # per layer [G, kv_heads, Lp, head_dim]
    values: list[Tensor]  # per layer [G, kv_heads, Lp, head_dim]
    last: Tensor  # [G, H]
    prompts: PromptSet

    def tensors(self) -> list[Tensor]:
        return [*self.keys, *self.values, self.last]

    def leaves(self) -> PromptStates:
        """Detached copies that collect gradients: the micro-batches' backwards stop here,
        so the prompts' graph is walked once (`backward_into`), not once per micro-batch."""
        def leaf(t: Tensor) -> Tensor:
            return t.detach().requires_grad_(t.requires_grad)
        n = len(self.keys)
        ts = [leaf(t) for t in self.tensors()]
        return PromptStates(keys=ts[:n], values=ts[n:2 * n], last=ts[-1], prompts=self.prompts)

    def backward_into(self, leaves: PromptStates) -> None:
        """Carry the gradients the leaves collected back through the prompts' graph (into the
        adapter weights that produced these states)."""
        pairs = [(t, g.grad) for t, g in zip(self.tensors(), leaves.tensors())
                 if t.requires_grad and g.grad is not None]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


@dataclass(frozen=True)
class PromptTrunk:
    """What the layers below `split` computed for a `PromptSet`: their keys and values (what a
    completion's trunk attends to) and the states entering layer `split` (what the layers
    above run on, `prompt_states(..., trunk=)`)."""

    split: int
    keys: list[Tensor]  # per layer below `split`, [G, kv_heads, Lp, head_dim]
    values: list[Tensor]
    hidden: Tensor  # [G, Lp, H]
    prompts: PromptSet


@dataclass(frozen=True)
class Trunk:
    """The states entering decoder layer `split` for one micro-batch, computed once
    (`trunk_states`) for every forward that shares the layers below it. Plain batches: over
    the full rows, [B, T, H]. Shared prompts: over the completion tokens but the last,
    [B, Tc-1, H] (None when no completion is longer than one token), with the prompts'."""

    split: int
    hidden: Tensor | None
    prompts: PromptTrunk | None = None


# Models whose body runs `inputs_embeds` straight into its first layer and then
# `layers` and `norm` in order, so a range of layers runs on given states (`_layer_range`).
# (Gemma, for one, scales `inputs_embeds` first.)
_TRUNK_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def can_split(model: nn.Module) -> bool:
    """Whether `trunk_states` serves this model: a known body layout, every layer full
    attention (a sliced layer list keeps no per-layer mask types)."""
    body, _ = split_model(model)
    cfg = getattr(body, "config", None)
    return (getattr(cfg, "model_type", None) in _TRUNK_MODEL_TYPES and can_share_prompts(model)
            and isinstance(getattr(body, "layers", None), nn.ModuleList)
            and isinstance(getattr(body, "norm", None), nn.Module))


@contextmanager
def _layer_range(body: nn.Module, start: int, stop: int | None = None) -> Iterator[None]:
    """Inside the block the body runs decoder layers [start, stop) only, with its final norm
    only when the range reaches the top. Not thread-safe: the model is one caller's."""
    layers, norm = body.layers, body.norm
    stop = len(layers) if stop is None else stop
    if not 0 <= start < stop <= len(layers):
        raise ValueError(f"layers [{start}, {stop}) of a body of {len(layers)}")
    if (start, stop) == (0, len(layers)):
        yield
        return
    try:
        body.layers = nn.ModuleList(list(layers)[start:stop])
        if stop < len(layers):
            body.norm = nn.Identity()
        yield
    finally:
        body.layers, body.norm = layers, norm


def _body(body: nn.Module, layers: tuple[int, int | None], *, ids: Tensor | None = None,
          states: Tensor | None = None, **kw: Any) -> Tensor:
    """The body's last hidden state over `layers`, from token ids or the states entering them."""
    with _layer_range(body, *layers):
        return body(input_ids=ids, inputs_embeds=states, **kw).last_hidden_state


def _prompt_cache(keys: Sequence[Tensor], values: Sequence[Tensor], which: Tensor) -> Any:
    """A cache holding, for each row, its prompt's keys and values (rows of `which`)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[(k.index_select(0, which), v.index_select(0, which))
                                        for k, v in zip(keys, values)])


def prompt_trunk(model: nn.Module, prompts: PromptSet, split: int) -> PromptTrunk:
    """Run the layers below `split` once over the distinct prompts (grad: the caller's)."""
    from transformers import DynamicCache

    body, head = split_model(model)
    device = next(head.parameters()).device
    G, Lp = prompts.input_ids.shape
    cache = DynamicCache()
    hidden = _body(body, (0, split), ids=prompts.input_ids.to(device),
                   attention_mask=prompts.attention_mask.to(device),
                   position_ids=torch.arange(Lp, device=device).expand(G, Lp),
                   past_key_values=cache, use_cache=True)
    return PromptTrunk(split=split, keys=[layer.keys for layer in cache.layers[:split]],
                       values=[layer.values for layer in cache.layers[:split]], hidden=hidden,
                       prompts=prompts)


def trunk_states(model: nn.Module, batch: CompletionBatch, split: int,
                 prompts: PromptTrunk | None = None) -> Trunk:
    """Run the layers below `split` for one micro-batch (grad: the caller's; the trunk is the
    base's, so this runs without one). With `prompts` (the batch's plan shared them), over the
    completions only, attending to the prompts' trunk."""
    if prompts is not None and batch.prompt_index is None:
        raise ValueError("a prompt trunk given for a batch planned without shared prompts")
    if prompts is not None and prompts.split != split:
        raise ValueError(f"a prompt trunk split at layer {prompts.split}, not {split}")
    body, head = split_model(model)
    device = next(head.parameters()).device
    if prompts is None:
        return Trunk(split, _body(body, (0, split), ids=batch.input_ids.to(device),
                                  attention_mask=batch.attention_mask.to(device),
                                  position_ids=batch.position_ids.to(device), use_cache=False))
    which = batch.prompt_index.to(device)
    Tc = batch.completion_ids.shape[1]
    if Tc <= 1:
        return Trunk(split, None, prompts)
    mask, positions = _completion_layout(batch, prompts.prompts, which, device)
    hidden = _body(body, (0, split), ids=batch.completion_ids[:, : Tc - 1].to(device),
                   attention_mask=mask, position_ids=positions,
                   past_key_values=_prompt_cache(prompts.keys, prompts.values, which),
                   use_cache=True)
    return Trunk(split, hidden, prompts)


def can_share_prompts(model: nn.Module) -> bool:
    """Whether `prompt_states` serves this model: every layer full (global) attention, whose
    keys and values a plain cache holds. Sliding-window or hybrid models take whole rows."""
    body, _ = split_model(model)
    cfg = getattr(body, "config", None)
    if cfg is None:
        return False
    types = getattr(cfg, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return False
    return not (getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True))


def prompt_states(model: nn.Module, prompts: PromptSet,
                  trunk: PromptTrunk | None = None) -> PromptStates:
    """Run the body once over the distinct prompts (grad / autocast: the caller's); with a
    `trunk` of these prompts, only the layers above it (the keys and values below are the
    trunk's)."""
    from transformers import DynamicCache

    if trunk is not None and trunk.prompts is not prompts:
        raise ValueError("a prompt trunk of other prompts")
    body, head = split_model(model)
    device = next(head.parameters()).device
    G, Lp = prompts.input_ids.shape
    cache = DynamicCache()
    start = 0 if trunk is None else trunk.split
    hidden = _body(  # [G, Lp, H]
        body, (start, None),
        ids=prompts.input_ids.to(device) if trunk is None else None,
        states=None if trunk is None else trunk.hidden,
        attention_mask=prompts.attention_mask.to(device),
        position_ids=torch.arange(Lp, device=device).expand(G, Lp),
        past_key_values=cache,
        use_cache=True,
    )
    last = hidden[torch.arange(G, device=device), prompts.lens.to(device) - 1]  # [G, H]
    below = ([], []) if trunk is None else (trunk.keys, trunk.values)
    return PromptStates(keys=[*below[0], *(layer.keys for layer in cache.layers[start:])],
                        values=[*below[1], *(layer.values for layer in cache.layers[start:])],
                        last=last, prompts=prompts)


def completion_hidden(model: nn.Module, batch: CompletionBatch,
                      prompts: PromptStates | None = None,
                      trunk: Trunk | None = None) -> CompletionHidden:
    """Run the transformer body and gather the hidden states at the positions that predict
    completion tokens (see `CompletionHidden`). Differentiable under the caller's grad /
    autocast context. With `prompts` (the batch's plan shared them), the body runs on the
    completions only, attending to the prompts' states; otherwise on the full rows. With a
    `trunk` of this batch (`trunk_states`), only the layers above it run."""
    if prompts is not None and batch.prompt_index is None:
        raise ValueError("prompt states given for a batch planned without shared prompts")
    if trunk is not None and (trunk.prompts is None) != (prompts is None):
        raise ValueError("a trunk and prompt states of different plans (shared prompts or not)")
    body, head = split_model(model)
    device = next(head.parameters()).device
    mask = batch.completion_mask.to(device)  # [B, Tc]
    rows, cols = mask.nonzero(as_tuple=True)  # [N], [N]: N completion tokens, row-major
    if prompts is None:
        hidden = _body(  # [B, T, H]
            body, (0 if trunk is None else trunk.split, None),
            ids=batch.input_ids.to(device) if trunk is None else None,
            states=None if trunk is None else trunk.hidden,
            attention_mask=batch.attention_mask.to(device),
            position_ids=batch.position_ids.to(device),
            use_cache=False,
        )
        src = batch.prompt_lens.to(device)[rows] - 1 + cols  # [N]
        return CompletionHidden(hidden=hidden[rows, src], rows=rows, cols=cols, mask=mask)
    states = _completion_states(body, batch, prompts, device, trunk)  # [B, Tc, H]
    return CompletionHidden(hidden=states[rows, cols], rows=rows, cols=cols, mask=mask)


def _completion_layout(batch: CompletionBatch, prompts: PromptSet, which: Tensor,
                       device: torch.device) -> tuple[Tensor, Tensor]:
    """The attention mask ([B, Lp + Tc-1]) and positions ([B, Tc-1]) of the completion
    tokens but the last, after their prompts' cached states: every row's cache is its
    prompt's, right-padded to Lp, so the padding is masked out and positions continue from
    each prompt's own length."""
    B, Tc = batch.completion_ids.shape
    prompt_mask = prompts.attention_mask.to(device).index_select(0, which)  # [B, Lp]
    attention_mask = torch.cat(
        [prompt_mask, torch.ones((B, Tc - 1), dtype=prompt_mask.dtype, device=device)], dim=1)
    positions = prompts.lens.to(device).index_select(0, which)[:, None] + torch.arange(
        Tc - 1, device=device)
    return attention_mask, positions


def _completion_states(body: nn.Module, batch: CompletionBatch, prompts: PromptStates,
                       device: torch.device, trunk: Trunk | None = None) -> Tensor:
    """[B, Tc, H]: at column t, the state that predicts completion token t. Column 0 is the
    prompt's last state; column t >= 1 is the body's output at completion token t - 1, which
    attends to its prompt's cached keys and values, then causally to the completion."""
    which = batch.prompt_index.to(device)  # [B]
    first = prompts.last.index_select(0, which)[:, None]  # [B, 1, H]
    Tc = batch.completion_ids.shape[1]
    if Tc <= 1:  # one token each (column 0 only), or only empty completions (no column)
        return first[:, :Tc]
    attention_mask, position_ids = _completion_layout(batch, prompts.prompts, which, device)
    out = _body(  # [B, Tc-1, H]
        body, (0 if trunk is None else trunk.split, None),
        ids=batch.completion_ids[:, : Tc - 1].to(device) if trunk is None else None,
        states=None if trunk is None else trunk.hidden,
        attention_mask=attention_mask,
        position_ids=position_ids,
        # every layer's, those below a trunk too: the mask reads the cache's first layer
        past_key_values=_prompt_cache(prompts.keys, prompts.values, which),
        use_cache=True,
    )
    return torch.cat([first.to(out.dtype), out], dim=1)


def completion_logprobs(
    model: nn.Module,
    batch: CompletionBatch,
    *,
    chunk_tokens: int = 512,
    temperature: float = 1.0,
    with_entropy: bool = False,
    hidden: CompletionHidden | None = None,
    prompts: PromptStates | None = None,
    trunk: Trunk | None = None,
    keep_distributions: bool = False,
    kl_to: Tensor | None = None,
) -> CompletionLogprobs:
    """log p(c_t | prompt, c_<t) for every completion token, [B, Tc], differentiable.

    Runs under whatever grad / autocast context the caller sets. The head runs on at most
    `chunk_tokens` rows at a time and the log-softmax is in float32 (bf16 logprobs are off by
    ~1e-2, enough to bias an importance ratio). Logits are divided by `temperature` so the
    result describes the distribution the sampler drew from, when it sampled with one.
    Entropy is computed without gradients (it is a metric here, not a loss term).
    `hidden`: the body's gathered states when the caller already ran it (PPO's shared-trunk
    critic reads the same states), so the body runs once. `prompts`: the states of the
    batch's shared prompts (see `plan_batches`). `trunk`: the states below the layers that
    differ (`trunk_states`), when another forward of this batch shares them.
    `keep_distributions`: also return every token's whole log-distribution ([N, V], detached:
    the reference's, for the policy's pass). `kl_to`: such distributions of the same batch;
    returns the exact KL(this || kl_to) of each token's next-token distribution, summed over
    the vocabulary, differentiable (`[trainer.loss] kl_estimator = "full"`).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _, head = split_model(model)
    ch = hidden if hidden is not None else completion_hidden(model, batch, prompts, trunk)
    h = ch.hidden  # [N, H]
    targets = batch.completion_ids.to(h.device)[ch.rows, ch.cols]  # [N]
    if kl_to is not None and kl_to.shape[0] != h.shape[0]:
        raise ValueError(f"kl_to has {kl_to.shape[0]} tokens' distributions for {h.shape[0]} tokens")

    token_lp: list[Tensor] = []
    token_ent: list[Tensor] = []
    kept: list[Tensor] = []
    token_kl: list[Tensor] = []
    for start in range(0, h.shape[0], chunk_tokens):
        logits = head(h[start : start + chunk_tokens]).float()  # [C, V]
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)  # [C, V]
        token_lp.append(logp.gather(-1, targets[start : start + chunk_tokens, None])[:, 0])
        if with_entropy:
            with torch.no_grad():
                token_ent.append(-(logp.exp() * logp).sum(-1))  # [C]
        if keep_distributions:
            kept.append(logp.detach())
        if kl_to is not None:
            ref = kl_to[start : start + chunk_tokens].to(logp.device)
            token_kl.append((logp.exp() * (logp - ref)).sum(-1))  # [C]

    # index_put keeps the graph: gradients flow back only into the gathered rows.
    out = ch.scatter(torch.cat(token_lp)) if token_lp else ch.scatter(h.new_zeros(0))
    entropy = kl = None
    if with_entropy:
        entropy = ch.scatter(torch.cat(token_ent)) if token_ent else ch.scatter(h.new_zeros(0))
    if kl_to is not None:
        kl = ch.scatter(torch.cat(token_kl)) if token_kl else ch.scatter(h.new_zeros(0))
    distributions = None
    if keep_distributions:
        distributions = torch.cat(kept) if kept else h.new_zeros(0, 0)
    return CompletionLogprobs(logprobs=out, mask=ch.mask, entropy=entropy,
                              distributions=distributions, kl=kl)
