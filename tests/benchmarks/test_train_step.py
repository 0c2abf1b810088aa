"""`hotloop bench train-step`: the FLOP model by hand and against what torch runs, and a tiny run
of `main` end to end (JSON keys, positive numbers, a finite ratio)."""

from __future__ import annotations

import json
import math
from argparse import Namespace
from pathlib import Path

import pytest
from transformers import LlamaConfig

from benchmarks.train_step import ModelShape, main, step_flops

# hidden 4, intermediate 8, 2 layers, 2 query heads and 1 kv head of size 2, vocab 10.
TINY = ModelShape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10)


def bench_args(out: Path, model: Path, **kw) -> Namespace:
    """`hotloop bench train-step`'s arguments as the CLI parses them (so a new option cannot
    be missing here): a one-step run on one thread, `kw` over these."""
    from apps.cli import build_parser

    args = build_parser().parse_args([
        "bench", "train-step", "--model", str(model), "--dtype", "float32", "--samples", "3",
        "--prompt-tokens", "4", "--completion-tokens", "6", "--steps", "1", "--threads", "1",
        "--json", str(out)])
    return Namespace(**{**vars(args), **kw})


def test_step_flops_match_a_hand_count() -> None:
    # One sequence of 2 prompt + 3 completion tokens (L = 5), LoRA rank 1.
    # Weights per layer: q 4x4=16, k 4x2=8, v 4x2=8, o 4x4=16, gate/up/down 4x8=32 each -> 144.
    # Base: forward 2*144 per token, backward dX 2*144 more: 4*144*5 tokens*2 layers = 5760.
    # LoRA rank 1 per token costs in+out: q 8, k 6, v 6, o 8, gate/up/down 12 -> 64;
    # forward 2*64, backward 4*64 (dX and dW of A and B): 6*64*5*2 = 3840.
    # Attention: 15 causal (query, key) pairs; QK^T and PV are 2 flops * head_dim 2 * 2 heads
    # per pair each: 2*8*15 = 240 forward, x3 with backward = 720 per layer: 1440.
    # Head: 3 completion tokens, [4] x [4, 10], forward + dX: 2*2*4*10*3 = 480.
    f = step_flops(TINY, lora_r=1, lengths=[(2, 3)])
    assert f == {"base": 5760, "lora": 3840, "attention": 1440, "head": 480, "total": 11520}
    two = step_flops(TINY, lora_r=1, lengths=[(2, 3), (2, 3)])
    assert two["total"] == 2 * f["total"]


def test_model_shape_reads_gqa_and_default_head_dim() -> None:
    c = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=50)
    s = ModelShape.from_hf_config(c)
    assert (s.heads, s.kv_heads, s.head_dim, s.layers, s.vocab) == (8, 2, 8, 3, 50)
    assert dict((n, (i, o)) for n, i, o in s.linears())["k_proj"] == (64, 16)


def test_matmul_flops_match_what_a_train_step_runs(make_cfg) -> None:
    """torch's FlopCounterMode sees the step's mm calls (not CPU attention): they equal the
    formula's base + lora + head, less the dX of layer 0's q/k/v that autograd skips (their
    input needs no gradient), the over-count the module docstring names."""
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.train_step import synthetic_samples
    from services.trainer.learner.policy import LoraPolicy

    r = 4
    policy = LoraPolicy(make_cfg(lora={"r": r, "alpha": 8.0}))
    batch = synthetic_samples(policy, 3, prompt_tokens=5, completion_tokens=7)
    shape = ModelShape.from_hf_config(policy.model.get_base_model().config)
    policy.train_step(batch)  # LoRA B leaves zero, as in every timed step
    with FlopCounterMode(display=False) as counter:
        policy.train_step(batch)
    counted = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
    f = step_flops(shape, r, [(5, 7)] * 3)
    tokens = 3 * 12
    qkv_out = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    skipped = 2 * shape.hidden * qkv_out * tokens + 3 * 2 * r * shape.hidden * tokens
    assert counted == f["base"] + f["lora"] + f["head"] - skipped


def test_main_writes_the_json_on_the_tiny_model(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench" / "train-step.json"
    args = bench_args(out, tiny_model)
    assert main(args) == 0
    r = json.loads(out.read_text())
    for key in ("tokens_per_s", "roofline_ratio", "step_s", "step_gflop", "matmul_gflops"):
        assert r[key] > 0 and math.isfinite(r[key]), key
    assert r["dtype"] == "float32" and r["threads"] == 1 and r["cpu"]
    assert r["tokens_per_s"] == pytest.approx(3 * 10 / r["step_s"])
    shares = r["profile"]["shares"]
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3)
    assert shares["matmul_base_head"] > 0 and shares["matmul_lora"] > 0
    assert r["shared_prompts"] is None and r["group_size"] == 1


def test_group_size_times_shared_and_unshared_prompts(tiny_model: Path, tmp_path: Path) -> None:
    """GRPO's batch shape: the step with shared prompts, then the same batch with every row
    running its prompt, both reported; tokens/s is the shared step's."""
    out = tmp_path / "train-step.json"
    args = bench_args(out, tiny_model, samples=8, prompt_tokens=12, group_size=4,
                      micro_batch_tokens=64)
    assert main(args) == 0
    r = json.loads(out.read_text())
    ab = r["shared_prompts"]
    assert r["group_size"] == 4 and ab["step_s"] > 0 and ab["step_s_unshared"] > 0
    assert ab["speedup"] == pytest.approx(ab["step_s_unshared"] / ab["step_s"])
    assert r["tokens_per_s"] == pytest.approx(8 * 18 / ab["step_s"])
    assert r["micro_batch_tokens"] == 64 and r["micro_batches"] > 1


def test_the_profiled_step_runs_a_bounded_slice_of_the_batch(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler's records grow with the step (the demo's 64 samples ran a 24 GiB host out
    of memory), so it profiles at most PROFILE_MAX_SAMPLES of them; the timed steps run all."""
    from benchmarks import train_step

    monkeypatch.setattr(train_step, "PROFILE_MAX_SAMPLES", 4)
    out = tmp_path / "train-step.json"
    args = bench_args(out, tiny_model, samples=8)
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["samples"] == 8 and r["profile"]["samples"] == 4
    assert r["tokens_per_s"] == pytest.approx(8 * 10 / r["step_s"])


def test_ranks_time_the_step_on_one_and_on_two_ranks(tiny_model: Path, tmp_path: Path) -> None:
    """`--ranks 2`: the same step on one rank and on two, from the same state: both times and
    how far the updates are apart (the gradients to rounding; see `compare_ranks`)."""
    out = tmp_path / "train-step.json"
    args = bench_args(out, tiny_model, samples=5, ranks=2)
    assert main(args) == 0
    dp = json.loads(out.read_text())["data_parallel"]
    assert dp["ranks"] == 2 and dp["step_s_1"] > 0 and dp["step_s_2"] > 0
    assert dp["max_grad_diff"] < 1e-6 < dp["max_grad"]
    assert dp["max_param_diff"] <= 2.1e-4  # each moved at most lr = 1e-4 by its step


def test_colocated_reference_times_two_passes_against_one(tiny_model: Path, tmp_path: Path) -> None:
    """`--colocated-reference --top-layers 2`: base_logprobs then the step, against the step
    scoring the base from the trunk below layer 2 (of the tiny model's 4), alternated."""
    out = tmp_path / "train-step.json"
    args = bench_args(out, tiny_model, steps=2, top_layers=2, colocated_reference=True)
    assert main(args) == 0
    ref = json.loads(out.read_text())["colocated_reference"]
    assert ref["split_layer"] == 2 and len(ref["one_pass_s_all"]) == 2
    assert ref["speedup"] == pytest.approx(ref["two_passes_s"] / ref["one_pass_s"])
    assert min(ref["one_pass_s_all"] + ref["two_passes_s_all"]) > 0
