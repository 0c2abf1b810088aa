"""LoraPolicy on the tiny model: micro-batch equivalence, learning, skips, adapters, resume."""

from __future__ import annotations

import json
import math
from dataclasses import replace
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from hotloop.logprobs import collate, completion_logprobs
from services.trainer.learner.checkpoint import latest_checkpoint
from services.trainer.learner.policy import LoraPolicy, Sample


def _perturb_adapter(policy: LoraPolicy, seed: int = 0) -> None:
    """LoRA B starts at zero (so A gets no gradient); give it values, identically per seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in policy.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _samples(policy: LoraPolicy, pairs, advantages, with_ref: bool = True) -> list[Sample]:
    old = policy.logprobs(pairs)
    ref = policy.base_logprobs(pairs) if with_ref else [None] * len(pairs)
    return [
        Sample(p, c, o, a, r) for (p, c), o, a, r in zip(pairs, old, advantages, ref)
    ]


def _params(policy: LoraPolicy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.trainable_parameters()}


def test_shared_prompts_give_the_same_update(make_cfg, grouped_pairs) -> None:
    """GRPO's batch (each prompt G times) over several micro-batches: running each prompt once
    gives the same loss, gradients and update as running it in every row."""
    kw = {"loss": {"kl_beta": 0.1}, "optimizer": {"max_grad_norm": 1e9}, "micro_batch_tokens": 80}
    shared, plain = LoraPolicy(make_cfg(**kw)), LoraPolicy(make_cfg(share_prompts=False, **kw))
    for pol in (shared, plain):
        _perturb_adapter(pol)
    pairs = [(p, c) for p, c in grouped_pairs(3, 4, seed=4) if c]
    adv = [(-1.0) ** i * (1 + i % 3) for i in range(len(pairs))]
    samples = [replace(s, old_logprobs=[x - 0.05 * (i % 2) for x in s.old_logprobs])
               for i, s in enumerate(_samples(plain, pairs, adv))]
    assert _samples(shared, pairs, adv)[0].ref_logprobs == pytest.approx(
        samples[0].ref_logprobs, abs=1e-5)  # scoring shares prompts too
    a, b = plain.train_step(samples), shared.train_step(samples)
    assert b.micro_batches > 1 and a.micro_batches > 1
    assert b.loss == pytest.approx(a.loss, abs=1e-6)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
    for (n, pa), (_, pb) in zip(plain.trainable_parameters(), shared.trainable_parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-5, rtol=1e-4, msg=n)
        torch.testing.assert_close(pb, pa, atol=1e-6, rtol=1e-5, msg=n)


def test_a_micro_batch_of_empty_completions_is_skipped(make_cfg) -> None:
    """Shared-prompt plans sort empty completions last, where they can make a micro-batch of
    their own: it adds nothing to the loss and must not fail the step."""
    policy = LoraPolicy(make_cfg(micro_batch_tokens=60))
    _perturb_adapter(policy)
    prompt = [5, 6, 7, 8]
    pairs = [(prompt, list(range(10, 10 + n))) for n in (20, 18, 17, 16)] + [(prompt, [])] * 2
    samples = _samples(policy, pairs, [1.0, -1.0, 0.5, -0.5, 1.0, -1.0])
    m = policy.train_step(samples)
    assert not m.skipped and m.micro_batches >= 2 and math.isfinite(m.loss)
    assert m.tokens == 71


@pytest.mark.parametrize("aggregation", ["token", "sequence", "constant"])
def test_micro_batches_give_the_full_batch_gradient(make_cfg, random_pairs, aggregation) -> None:
    kw = {
        "loss": {"aggregation": aggregation, "kl_beta": 0.1},
        "optimizer": {"max_grad_norm": 1e9},  # no clipping: compare raw gradients
    }
    whole = LoraPolicy(make_cfg(micro_batch_tokens=4096, **kw))
    split = LoraPolicy(make_cfg(micro_batch_tokens=40, **kw))
    for pol in (whole, split):
        _perturb_adapter(pol)
    pairs = random_pairs(8, seed=5)
    adv = [1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 1.0]
    # Off-policy old logprobs, so ratios are not all 1 and the clip is exercised too.
    samples = [
        replace(s, old_logprobs=[x - 0.1 * (i % 3) for x in s.old_logprobs])
        for i, s in enumerate(_samples(whole, pairs, adv))
    ]
    a, b = whole.train_step(samples), split.train_step(samples)
    assert a.micro_batches == 1 and b.micro_batches > 2
    assert b.loss == pytest.approx(a.loss, abs=1e-6)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    for (n, pa), (_, pb) in zip(whole.trainable_parameters(), split.trainable_parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-5, rtol=1e-5, msg=n)
    for k in ("kl", "clip_frac", "ratio_mean"):
        assert b.extra[k] == pytest.approx(a.extra[k], abs=1e-6)


def test_grpo_steps_raise_the_logprob_of_the_rewarded_completion(make_cfg) -> None:
    policy = LoraPolicy(make_cfg(optimizer={"lr": 1e-2}))
    prompt = [1, 40, 41, 42]
    good, bad = [50, 51, 52, 53], [60, 61, 62, 63]
    pairs = [(prompt, good), (prompt, bad)]
    adv = policy.algorithm.advantages(torch.tensor([[1.0, 0.0]]))[0].tolist()  # [+0.71, -0.71]
    before = [sum(x) for x in policy.logprobs(pairs)]
    for _ in range(5):
        m = policy.train_step(_samples(policy, pairs, adv, with_ref=False))
        assert not m.skipped
    after = [sum(x) for x in policy.logprobs(pairs)]
    assert after[0] > before[0] + 0.5 and after[1] < before[1] - 0.5
    assert policy.step == 5


def test_non_finite_loss_or_gradient_skips_the_update(make_cfg, random_pairs) -> None:
    policy = LoraPolicy(make_cfg())
    _perturb_adapter(policy)
    pairs = random_pairs(2, seed=2)
    good = _samples(policy, pairs, [1.0, -1.0])
    before = _params(policy)

    nan_old = [replace(s, old_logprobs=[math.nan] * len(s.completion_ids)) for s in good]
    m = policy.train_step(nan_old)
    assert m.skipped and m.skip_reason == "non-finite loss" and policy.step == 0

    name, param = next(iter(policy.trainable_parameters()))
    hook = param.register_hook(lambda g: g * math.inf)
    m = policy.train_step(good)
    hook.remove()
    assert m.skipped and m.skip_reason == "non-finite gradient" and policy.step == 0
    for n, p in policy.trainable_parameters():
        assert torch.equal(p, before[n]), n

    m = policy.train_step(good)
    assert not m.skipped and policy.step == 1
    assert not torch.equal(dict(policy.trainable_parameters())[name], before[name])


def test_saved_adapter_reloads_to_the_same_logprobs(
    make_cfg, tiny_model, random_pairs, tmp_path
) -> None:
    policy = LoraPolicy(make_cfg())
    _perturb_adapter(policy)
    out = policy.save_adapter(tmp_path / "v1")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    with pytest.raises(FileExistsError):
        policy.save_adapter(out)

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, out).eval()
    pairs = random_pairs(3, seed=4)
    with torch.no_grad():
        reloaded = completion_logprobs(loaded, collate(pairs)).rows()
    for a, b in zip(policy.logprobs(pairs), reloaded):
        assert a == pytest.approx(b, abs=1e-6)


def test_an_adapter_reads_back_while_another_thread_runs_the_base_with_the_adapter_off(
    make_cfg, tmp_path
) -> None:
    """A reset to a stored version reads it (`read_adapter`) outside the trainer's turn, while
    an update may be computing its reference with the adapter disabled (peft's
    `disable_adapter` turns `requires_grad` off on every adapter tensor for the while). What
    the policy trains is fixed when it is built, not read from those flags: the read found
    "112 tensors this policy does not train" and stopped a shared trainer (demo run d23)."""
    from hotloop.adapters import members, pack

    policy = LoraPolicy(make_cfg())
    _perturb_adapter(policy)
    names = [n for n, _ in policy.trainable_parameters()]
    archive = pack(policy.save_adapter(tmp_path / "v1"))  # as the trainer's store keeps it
    with policy.model.disable_adapter():
        assert not any(p.requires_grad for p in policy.trainable_tensors())  # peft's doing
        assert [n for n, _ in policy.trainable_parameters()] == names
        read = policy.read_adapter(members(archive))
    assert all(torch.equal(a, b) for a, b in zip(read, policy.trainable_tensors()))


def test_an_adapter_saved_with_other_weights_holds_them_and_the_policy_keeps_its_own(
    make_cfg, random_pairs, tmp_path
) -> None:
    """`save_adapter(weights=...)`: what a lineage serving an average publishes."""
    from safetensors.torch import load_file

    policy = LoraPolicy(make_cfg())
    _perturb_adapter(policy, seed=1)
    own = _params(policy)
    pairs = random_pairs(2, seed=5)
    before = policy.logprobs(pairs)
    other = [torch.randn_like(t) for t in policy.trainable_tensors()]
    mine = load_file(str(policy.save_adapter(tmp_path / "own") / "adapter_model.safetensors"))
    theirs = load_file(str(policy.save_adapter(tmp_path / "other", other) / "adapter_model.safetensors"))
    # the files name a parameter as peft saves it: without the adapter's name
    saved = [n.replace(".default", "") for n in own]
    assert sorted(mine) == sorted(theirs) == sorted(saved)
    for name, own_t, other_t in zip(saved, own.values(), other):
        assert torch.equal(mine[name], own_t) and torch.equal(theirs[name], other_t)
    assert all(torch.equal(p, own[n]) for n, p in policy.trainable_parameters())
    assert policy.logprobs(pairs) == before
    with pytest.raises(ValueError, match="tensors for an adapter"):
        policy.save_adapter(tmp_path / "short", other[:-1])
    assert not (tmp_path / "short").exists()


def test_base_logprobs_ignore_the_adapter(make_cfg, tiny_model, random_pairs) -> None:
    policy = LoraPolicy(make_cfg())
    _perturb_adapter(policy)
    pairs = random_pairs(3, seed=6)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = completion_logprobs(plain, collate(pairs)).rows()
    for a, b in zip(policy.base_logprobs(pairs), expected):
        assert a == pytest.approx(b, abs=1e-6)
    assert policy.logprobs(pairs)[0] != pytest.approx(expected[0], abs=1e-4)


def test_resume_reproduces_training_exactly(make_cfg, random_pairs, tmp_path) -> None:
    # LoRA dropout draws from the torch RNG, so restoring RNG state is part of "exactly".
    cfg = make_cfg(lora={"r": 4, "alpha": 8.0, "dropout": 0.1}, loss={"kl_beta": 0.05})
    pairs = random_pairs(4, seed=7)
    adv = [1.0, -1.0, 0.5, -0.5]

    first = LoraPolicy(cfg)
    batch = _samples(first, pairs, adv)
    for _ in range(2):
        first.train_step(batch)
    ckpt = first.save_checkpoint(tmp_path / "ckpt", data_position={"epoch": 0, "index": 8})
    first.train_step(batch)
    expected = _params(first)

    second = LoraPolicy(cfg)
    assert latest_checkpoint(tmp_path / "ckpt") == ckpt
    state = second.restore(ckpt)
    assert state.step == 2 and state.data_position == {"epoch": 0, "index": 8}
    second.train_step(batch)
    assert second.step == 3
    for n, p in _params(second).items():
        assert torch.equal(p, expected[n]), n


def test_a_checkpoint_at_the_same_step_supersedes_the_last(make_cfg, tmp_path) -> None:
    """Steps that update nothing (a GRPO group with one reward for all) leave the policy's step
    where it was and move the data on: the next checkpoint must hold the newer position."""
    policy = LoraPolicy(make_cfg())
    policy.save_checkpoint(tmp_path, data_position={"index": 8})
    again = policy.save_checkpoint(tmp_path, data_position={"index": 16})
    assert latest_checkpoint(tmp_path) == again
    assert json.loads((again / "state.json").read_text())["data_position"] == {"index": 16}
    assert sorted(p.name for p in tmp_path.iterdir()) == [again.name]  # nothing left beside it


def test_latest_checkpoint_ignores_partial_writes(tmp_path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    (tmp_path / "step-00000003").mkdir()
    (tmp_path / "step-00000010").mkdir()
    (tmp_path / ".tmp-step-00000020-123").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000010"


def test_a_stop_request_interrupts_the_step_before_its_update(make_cfg, random_pairs) -> None:
    from services.trainer.learner.policy import Interrupted

    # a token budget of 32 splits the batch into several micro-batches
    policy = LoraPolicy(make_cfg(micro_batch_tokens=32))
    _perturb_adapter(policy)
    samples = _samples(policy, random_pairs(6, seed=3), [1.0, -1.0] * 3)
    before = _params(policy)
    polls = []

    def stop_on_second_poll() -> bool:
        polls.append(1)
        return len(polls) >= 2  # after the first micro-batch's backward

    with pytest.raises(Interrupted):
        policy.train_step(samples, should_stop=stop_on_second_poll)
    assert policy.step == 0 and len(polls) == 2
    for n, p in policy.trainable_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None, n  # no half-accumulated gradient leaks into the next step
    m = policy.train_step(samples, should_stop=lambda: False)
    assert not m.skipped and policy.step == 1


def _layer_outputs_need_grad(policy: LoraPolicy, samples: list[Sample]) -> list[bool]:
    """Whether each decoder layer's output required a gradient in one train step."""
    layers = policy.model.get_base_model().model.layers
    seen: dict[int, bool] = {}

    def record(i: int):
        def hook(module, args, out) -> None:  # None: the output stays as it is
            seen.setdefault(i, (out[0] if isinstance(out, tuple) else out).requires_grad)
        return hook

    hooks = [layer.register_forward_hook(record(i)) for i, layer in enumerate(layers)]
    try:
        policy.train_step(samples)
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in range(len(layers))]


def test_lora_on_the_top_layers_stops_the_backward_there_and_updates_as_full_depth(
        make_cfg, random_pairs) -> None:
    """`top_layers`: only the top layers hold adapter weights, no layer below them records a
    graph (so the backward stops at the lowest adapted layer), and the update is the one a
    backward through every layer gives for the same adapter."""
    kw = {"lora": {"r": 4, "alpha": 8.0, "top_layers": 2}, "optimizer": {"max_grad_norm": 1e9}}
    top, deep = LoraPolicy(make_cfg(**kw)), LoraPolicy(make_cfg(**kw))
    n = top.model.get_base_model().config.num_hidden_layers
    assert n == 4
    names = [name for name, _ in top.trainable_parameters()]
    assert names and all(any(f".layers.{i}." in name for i in (2, 3)) for name in names)
    for pol in (top, deep):
        _perturb_adapter(pol)
    # the reference run: the embeddings' output requires a gradient, so every layer records
    # a graph and the backward runs through all of them
    deep.model.enable_input_require_grads()
    pairs = random_pairs(6, seed=3)
    samples = _samples(top, pairs, [1.0, -0.5, 0.25, -1.0, 0.75, -0.25], with_ref=False)
    assert _layer_outputs_need_grad(top, samples) == [False, False, True, True]
    assert _layer_outputs_need_grad(deep, samples) == [True, True, True, True]
    # each policy took one step above; the same step on the same adapter is the same update
    for (name, a), (_, b) in zip(top.trainable_parameters(), deep.trainable_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6, msg=name)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("top_layers", [2, None])
def test_a_step_with_its_own_reference_is_the_step_after_base_logprobs(
        make_cfg, grouped_pairs, share, top_layers) -> None:
    """`train_step(..., reference=True)`: the base's logprobs computed in the step (with LoRA
    on the top layers, from a trunk the policy's forward shares) give the update, loss and KL
    that `base_logprobs` and then a step give."""
    kw = {"lora": {"r": 4, "alpha": 8.0, "top_layers": top_layers}, "share_prompts": share,
          "loss": {"kl_beta": 0.2}, "optimizer": {"max_grad_norm": 1e9}, "micro_batch_tokens": 80}
    given, own = LoraPolicy(make_cfg(**kw)), LoraPolicy(make_cfg(**kw))
    assert own.split == (2 if top_layers else None)
    for pol in (given, own):
        _perturb_adapter(pol)
    pairs = [(p, c) for p, c in grouped_pairs(3, 4, seed=4) if c]
    adv = [(-1.0) ** i * (1 + i % 3) for i in range(len(pairs))]
    samples = [replace(s, old_logprobs=[x - 0.05 * (i % 2) for x in s.old_logprobs])
               for i, s in enumerate(_samples(given, pairs, adv))]
    # a wrong reference handed in is replaced, not used
    a = given.train_step(samples)
    b = own.train_step([replace(s, ref_logprobs=[0.0] * len(s.completion_ids)) for s in samples],
                       reference=True)
    assert a.micro_batches > 1 and b.micro_batches == a.micro_batches
    assert a.extra["kl"] > 1e-4  # the KL term is live, so a wrong reference would show
    assert b.loss == pytest.approx(a.loss, abs=1e-6)
    assert b.extra["kl"] == pytest.approx(a.extra["kl"], rel=1e-4)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
    assert b.extra["reference_s"] > 0 and "reference_s" not in a.extra
    for (n, pa), (_, pb) in zip(given.trainable_parameters(), own.trainable_parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-5, rtol=1e-4, msg=n)
        torch.testing.assert_close(pb, pa, atol=1e-6, rtol=1e-5, msg=n)
    body = own.model.get_base_model().model
    assert len(body.layers) == 4 and not isinstance(body.norm, torch.nn.Identity)


def test_an_adapter_of_the_top_layers_is_what_the_replicas_merge(make_cfg, tmp_path) -> None:
    from services.rollout.updates.common import read_peft_adapter

    policy = LoraPolicy(make_cfg(lora={"r": 4, "alpha": 8.0, "top_layers": 1}))
    factors = read_peft_adapter(policy.save_adapter(tmp_path / "v1"), max_rank=16)
    assert factors and all(".layers.3." in module for module in factors)
    assert len(factors) == 7  # every linear of the one layer: q, k, v, o, gate, up, down


def test_more_top_layers_than_the_model_has_is_a_clear_error(make_cfg) -> None:
    with pytest.raises(ValueError, match="top_layers = 5, but the model has 4 decoder layers"):
        LoraPolicy(make_cfg(lora={"r": 4, "alpha": 8.0, "top_layers": 5}))


@pytest.mark.parametrize("top_layers", [2, None])
def test_the_full_kl_of_a_step_is_the_exact_kl_and_its_gradient(
        make_cfg, grouped_pairs, top_layers) -> None:
    """`kl_estimator = "full"` with the colocated reference: the step's KL is the exact
    KL(policy || base) of every completion token's next-token distribution (computed here
    from two whole forwards, adapter on and off), and with no advantage its update is that
    KL's gradient times kl_beta, over shared prompts and several micro-batches; with LoRA on
    the top layers (the trunk below them shared) and on every layer."""
    kw = {"lora": {"r": 4, "alpha": 8.0, "top_layers": top_layers}, "share_prompts": True,
          "loss": {"kl_beta": 0.3, "kl_estimator": "full"}, "optimizer": {"max_grad_norm": 1e9},
          "micro_batch_tokens": 80}
    pol, check = LoraPolicy(make_cfg(**kw)), LoraPolicy(make_cfg(**kw))
    for p in (pol, check):
        _perturb_adapter(p)
    pairs = [(p, c) for p, c in grouped_pairs(3, 4, seed=5) if c]
    samples = _samples(pol, pairs, [0.0] * len(pairs), with_ref=False)
    with pytest.raises(ValueError, match="colocated reference"):
        pol.train_step(samples)  # no reference of its own: only sampled tokens' logprobs
    with pytest.raises(ValueError, match="data_parallel = 1"):
        make_cfg(**kw, data_parallel=2)  # refused at load, not at the first update
    m = pol.train_step(samples, reference=True)
    assert m.micro_batches > 1

    # the same KL, from whole forwards: sum over the tokens, over the batch's token count
    check.model.train()
    total, tokens = 0.0, 0
    kls = []
    for p, c in pairs:
        ids = torch.tensor([p + c])
        with torch.no_grad(), check.model.disable_adapter():
            ref = torch.log_softmax(check.model(ids).logits[0].float(), dim=-1)
        logp = torch.log_softmax(check.model(ids).logits[0].float(), dim=-1)
        rows = slice(len(p) - 1, len(p) + len(c) - 1)  # the positions that predict c
        kls.append((logp[rows].exp() * (logp[rows] - ref[rows])).sum(-1))
        tokens += len(c)
    total = torch.cat(kls).sum()
    assert m.extra["kl"] == pytest.approx(float(total.detach()) / tokens, rel=1e-4)
    assert m.extra["kl"] > 1e-4
    (0.3 * total / tokens).backward()
    for (n, a), (_, b) in zip(pol.trainable_parameters(), check.trainable_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4, msg=n)


def test_decay_steps_lower_the_rate_with_the_optimizers_steps_and_a_checkpoint_keeps_them(
        make_cfg, random_pairs, tmp_path) -> None:
    """lr / sqrt(1 + k / decay_steps), k the optimizer state's steps: the rate each update
    reports and applies, resumed from a checkpoint; without decay_steps it stays at lr."""
    pairs = random_pairs(2, seed=3)
    policy = LoraPolicy(make_cfg(optimizer={"lr": 1e-3, "decay_steps": 2}))
    _perturb_adapter(policy)
    lrs = [policy.train_step(_samples(policy, pairs, [1.0, -1.0])).lr for _ in range(3)]
    assert lrs == pytest.approx([1e-3, 1e-3 / math.sqrt(1.5), 1e-3 / math.sqrt(2.0)])
    assert policy.optimizer_steps() == 3
    ckpt = policy.save_checkpoint(tmp_path / "ckpt")
    resumed = LoraPolicy(make_cfg(optimizer={"lr": 1e-3, "decay_steps": 2}))
    resumed.restore(ckpt)
    assert resumed.train_step(_samples(resumed, pairs, [1.0, -1.0])).lr == pytest.approx(
        1e-3 / math.sqrt(2.5))

    # The update applied is the decayed one: a fourth step of the first policy equals it.
    expected = policy.train_step(_samples(policy, pairs, [1.0, -1.0]))
    assert expected.lr == pytest.approx(1e-3 / math.sqrt(2.5))
    theirs, ours = _params(resumed), _params(policy)
    assert all(torch.equal(theirs[n], ours[n]) for n in ours)

    constant = LoraPolicy(make_cfg(optimizer={"lr": 1e-3}))
    _perturb_adapter(constant)
    assert [constant.train_step(_samples(constant, pairs, [1.0, -1.0])).lr
            for _ in range(3)] == [1e-3] * 3
