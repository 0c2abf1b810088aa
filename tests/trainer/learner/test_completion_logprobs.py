"""hotloop.logprobs: completion-only chunked logprobs against a naive full-logits computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hotloop.logprobs import (
    collate,
    completion_hidden,
    completion_logprobs,
    plan_batches,
    plan_micro_batches,
    prompt_states,
)


@pytest.fixture(scope="module")
def tiny_lm(tiny_model: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def naive(model, prompt: list[int], completion: list[int], temperature: float = 1.0):
    """Full logits over the unpadded sequence, log-softmax, pick the completion tokens."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float() / temperature  # [T, V]
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]  # predicts completion tokens
    lp = logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]
    return lp, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_full_logits(tiny_lm, random_pairs, chunk_tokens, temperature) -> None:
    pairs = random_pairs(6, seed=3) + [([5], [9])]  # one-token prompt and completion
    with torch.no_grad():
        out = completion_logprobs(
            tiny_lm, collate(pairs), chunk_tokens=chunk_tokens, temperature=temperature,
            with_entropy=True,
        )
        for i, (p, c) in enumerate(pairs):
            lp, ent = naive(tiny_lm, p, c, temperature)
            torch.testing.assert_close(out.logprobs[i, : len(c)], lp, atol=1e-5, rtol=0)
            torch.testing.assert_close(out.entropy[i, : len(c)], ent, atol=1e-5, rtol=0)
            assert out.mask[i].sum() == len(c) and (out.logprobs[i, len(c) :] == 0).all()
    assert [len(r) for r in out.rows()] == [len(c) for _, c in pairs]


def test_gradients_flow_through_a_peft_adapter(tiny_model: Path, random_pairs) -> None:
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(std=0.05)  # a non-zero adapter, so "with" and "without" differ
    pairs = random_pairs(3, seed=1)
    out = completion_logprobs(model, collate(pairs))
    with torch.no_grad():
        for i, (p, c) in enumerate(pairs):
            lp, _ = naive(model, p, c)
            torch.testing.assert_close(out.logprobs[i, : len(c)], lp, atol=1e-5, rtol=0)
        with model.disable_adapter():
            off = completion_logprobs(model, collate(pairs)).logprobs
    assert not torch.allclose(off, out.logprobs.detach())
    out.logprobs.sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        collate([([], [1, 2])])


def test_plan_micro_batches_covers_every_index_within_budget() -> None:
    lengths = [5, 30, 12, 12, 7, 100, 1]
    groups = plan_micro_batches(lengths, token_budget=40)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [5] in groups  # over budget: alone
    for g in groups:
        if g != [5]:
            assert len(g) * max(lengths[i] for i in g) <= 40
    assert plan_micro_batches(lengths, 10_000) == [[5, 1, 2, 3, 4, 0, 6]]  # longest first


def test_min_fill_bounds_the_padding_of_each_row() -> None:
    """A group closes before a row shorter than min_fill x its longest, once it holds a
    quarter of the budget; a smaller group keeps taking rows."""
    lengths = [100, 95, 90, 85, 79, 70, 60, 10]
    # 79 < 0.8 x 100 with 4 x 100 >= 250 held: a new group, which stays under 250 to the end
    assert plan_micro_batches(lengths, 1000, min_fill=0.8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan_micro_batches(lengths, 10_000, min_fill=0.8) == [list(range(8))]  # < a quarter
    assert plan_micro_batches(lengths, 1000) == [list(range(8))]  # 8 x 100 fits: one group


def _adapted(tiny_model: Path, top: int | None = None):
    """LoRA on every linear (of the top `top` layers only, when given), with a non-zero B."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    n = base.config.num_hidden_layers
    linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(
        r=4, lora_alpha=8, target_modules=linear,
        layers_to_transform=None if top is None else list(range(n - top, n))))
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(std=0.05)
    return model


def _run_plan(model, pairs, budget: int, share: bool):
    """Logprobs and adapter gradients of sum(logprobs) over a plan, as the trainer runs one."""
    model.zero_grad()
    plan = plan_batches(pairs, budget, share_prompts=share)
    states = None if plan.prompts is None else prompt_states(model, plan.prompts)
    leaves = None if states is None else states.leaves()
    rows: list[list[float]] = [[] for _ in pairs]
    for idx, batch in plan.batches:
        out = completion_logprobs(model, batch, chunk_tokens=5, prompts=leaves)
        out.logprobs.sum().backward()
        for i, r in zip(idx, out.rows()):
            rows[i] = r
    if states is not None:
        states.backward_into(leaves)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return plan, rows, grads


def test_shared_prompts_give_the_same_logprobs_and_gradients(tiny_model, grouped_pairs) -> None:
    """Each distinct prompt run once, its completions attending to its cached states, over
    several micro-batches: the same logprobs and the same adapter gradients (the prompts'
    share included) as every row running its whole prompt."""
    model = _adapted(tiny_model)
    pairs = grouped_pairs(3, 4, seed=2)
    plain, a, ga = _run_plan(model, pairs, 80, share=False)
    shared, b, gb = _run_plan(model, pairs, 80, share=True)
    assert plain.prompts is None and shared.prompts is not None
    assert shared.prompts.input_ids.shape[0] == 4 and len(shared.batches) > 1
    assert [len(r) for r in a] == [len(c) for _, c in pairs] == [len(r) for r in b]
    assert max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r, s)) < 1e-5
    lora_a = [n for n in ga if "lora_A" in n]
    assert sorted(ga) == sorted(gb) and lora_a  # every adapter weight got a gradient both ways
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=1e-5, rtol=1e-4, msg=n)
    # and with the shared states but without their backward, the prompts' share is missing
    model.zero_grad()
    states = prompt_states(model, shared.prompts)
    for _, batch in shared.batches:
        completion_logprobs(model, batch, prompts=states.leaves()).logprobs.sum().backward()
    assert any(not torch.allclose(p.grad, ga[n], atol=1e-5)
               for n, p in model.named_parameters() if p.grad is not None)
    with pytest.raises(ValueError, match="without shared prompts"):
        completion_hidden(model, collate(pairs[:2]), prompts=states)


def test_a_batch_of_one_token_completions_needs_no_completion_forward(tiny_model) -> None:
    model = _adapted(tiny_model)
    pairs = [([7, 8, 9], [4]), ([7, 8, 9], [11]), ([5], [9]), ([5], [])]
    _, a, _ = _run_plan(model, pairs, 4096, share=False)
    _, b, _ = _run_plan(model, pairs, 4096, share=True)
    assert [len(r) for r in b] == [1, 1, 1, 0]
    assert max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r, s)) < 1e-5


def test_plan_batches_shares_repeated_prompts_within_the_budget(grouped_pairs, random_pairs) -> None:
    pairs = grouped_pairs(4, 8, seed=1)
    plan = plan_batches(pairs, 200)
    assert plan.prompts is not None and plan.prompts.input_ids.shape[0] == 5
    planned = sorted(i for idx, _ in plan.batches for i in idx)
    assert planned == [i for i, (_, c) in enumerate(pairs) if c]  # empty completions: none
    assert len(planned) == len(pairs) - 1
    for idx, batch in plan.batches:
        assert plan.prompts.tokens + len(idx) * max(len(pairs[i][1]) for i in idx) <= 200
        for i, row in zip(idx, batch.prompt_index.tolist()):  # each row points at its prompt
            lp = int(plan.prompts.lens[row])
            assert plan.prompts.input_ids[row, :lp].tolist() == pairs[i][0]
    # nothing repeats, sharing is off, or the prompts would take over half the budget: plain
    assert plan_batches(random_pairs(6), 200).prompts is None
    assert plan_batches(pairs, 200, share_prompts=False).prompts is None
    assert plan_batches(pairs, 2 * plan.prompts.tokens - 1).prompts is None
    assert plan_batches([([5], []), ([5], [])], 200).batches == []
    with pytest.raises(ValueError, match="empty prompt"):
        plan_batches([([], [1])], 200)


def test_only_full_attention_models_share_prompts(tiny_lm) -> None:
    """A sliding-window layer's keys are not what a plain cache holds: whole rows there."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hotloop.logprobs import can_share_prompts

    assert can_share_prompts(tiny_lm)
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1)
    full = Qwen2ForCausalLM(Qwen2Config(**small))
    sliding = Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True, sliding_window=8,
                                           max_window_layers=0))
    assert can_share_prompts(full) and not can_share_prompts(sliding)


def _with_trunk(model, pairs, budget: int, share: bool, split: int | None):
    """Logprobs with the adapter off and on, and the adapter's gradients of sum(on), over a
    plan; with `split`, both forwards run from one trunk per micro-batch."""
    from hotloop.logprobs import prompt_trunk, trunk_states

    model.zero_grad()
    plan = plan_batches(pairs, budget, share_prompts=share)
    ptrunk = None
    if split is not None and plan.prompts is not None:
        with torch.no_grad():
            ptrunk = prompt_trunk(model, plan.prompts, split)
    states = None if plan.prompts is None else prompt_states(model, plan.prompts, ptrunk)
    leaves = None if states is None else states.leaves()
    off: list[list[float]] = [[] for _ in pairs]
    on: list[list[float]] = [[] for _ in pairs]
    for idx, batch in plan.batches:
        trunk = None
        with torch.no_grad():
            if split is not None:
                trunk = trunk_states(model, batch, split, ptrunk)
            with model.disable_adapter():
                base_states = (None if plan.prompts is None
                               else prompt_states(model, plan.prompts, ptrunk))
                lp_off = completion_logprobs(model, batch, prompts=base_states, trunk=trunk)
        out = completion_logprobs(model, batch, chunk_tokens=5, prompts=leaves, trunk=trunk)
        out.logprobs.sum().backward()
        for i, a, b in zip(idx, lp_off.rows(), out.rows()):
            off[i], on[i] = a, b
    if states is not None:
        states.backward_into(leaves)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return plan, off, on, grads


@pytest.mark.parametrize("share", [False, True])
def test_a_shared_trunk_gives_the_same_logprobs_and_gradients(tiny_model, grouped_pairs,
                                                              share) -> None:
    """The layers below the adapter run once, for the base's forward and the policy's: each
    gets the logprobs (and the policy the gradients) of running the whole body itself."""
    model, split = _adapted(tiny_model, top=2), 2
    pairs = grouped_pairs(3, 4, seed=2)
    plan, off_a, on_a, ga = _with_trunk(model, pairs, 80, share, None)
    _, off_b, on_b, gb = _with_trunk(model, pairs, 80, share, split)
    assert (plan.prompts is not None) == share and len(plan.batches) > 1
    assert [len(r) for r in on_b] == [len(c) for _, c in pairs] == [len(r) for r in off_b]
    for a, b in ((off_a, off_b), (on_a, on_b)):
        assert max(abs(x - y) for r, s in zip(a, b) for x, y in zip(r, s)) < 1e-5
    # the adapter changes the answer's logprobs: "off" really is the base
    assert max(abs(x - y) for r, s in zip(off_b, on_b) for x, y in zip(r, s)) > 1e-3
    assert sorted(ga) == sorted(gb) and ga
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=1e-5, rtol=1e-4, msg=n)


def test_a_trunk_is_refused_where_it_does_not_fit(tiny_model, tiny_lm, grouped_pairs) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hotloop.logprobs import can_split, prompt_trunk, trunk_states

    model, split = _adapted(tiny_model, top=2), 2
    assert can_split(model) and can_split(tiny_lm)
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1)
    assert not can_split(Qwen2ForCausalLM(Qwen2Config(
        **small, use_sliding_window=True, sliding_window=8, max_window_layers=0)))
    pairs = grouped_pairs(2, 3, seed=1)
    plan = plan_batches(pairs, 4096)
    batch = plan.batches[0][1]
    with torch.no_grad():
        ptrunk = prompt_trunk(model, plan.prompts, split)
        with pytest.raises(ValueError, match="split at layer 2, not 1"):
            trunk_states(model, batch, 1, ptrunk)
        with pytest.raises(ValueError, match="without shared prompts"):
            trunk_states(model, collate(pairs[:2]), split, ptrunk)
        plain = trunk_states(model, collate(pairs[:2]), split)
        with pytest.raises(ValueError, match="different plans"):
            completion_hidden(model, batch, prompt_states(model, plan.prompts), plain)
        with pytest.raises(ValueError, match=r"layers \[0, 9\) of a body of 4"):
            trunk_states(model, collate(pairs[:2]), 9)
    # the body is whole again after every forward, a refused one too
    assert len(model.get_base_model().model.layers) == 4
    assert not isinstance(model.get_base_model().model.norm, torch.nn.Identity)
