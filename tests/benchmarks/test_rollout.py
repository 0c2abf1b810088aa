"""`hotloop bench rollout`'s roofline: the decode FLOP model by hand and against what torch runs
for one generated token, the engine's thread count, and a tiny run of `main` end to end."""

from __future__ import annotations

import json
import math
from argparse import Namespace
from pathlib import Path

import pytest

from benchmarks.roofline import ModelShape, decode_flops, decode_roofline

# hidden 4, intermediate 8, 2 layers, 2 query heads and 1 kv head of size 2, vocab 10.
TINY = ModelShape(hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10)


def test_decode_flops_match_a_hand_count() -> None:
    # Weights per layer: q 16, k 8, v 8, o 16, gate/up/down 32 each -> 144; 2 layers -> 288;
    # the head 4 x 10 = 40. Per generated token: 2 * (288 + 40) = 656.
    # One sample, prompt 2, 3 generated tokens: they attend over 2, 3 and 4 keys -> 9 keys;
    # per key QK^T and PV cost 2 * 2 (head_dim) * 2 heads each -> 16 per layer, 32 in all.
    f = decode_flops(TINY, [(2, 3)])
    assert f == {"linear": 3 * 656, "attention": 32 * 9, "total": 3 * 656 + 32 * 9}
    assert decode_flops(TINY, [(2, 3), (2, 3)])["total"] == 2 * f["total"]
    assert decode_flops(TINY, [(2, 0)])["total"] == 0


def test_decode_flops_match_what_torch_runs_for_one_token() -> None:
    """One decode step of an HF Llama over a KV cache of 5 positions: torch's FlopCounterMode
    sees the linears and the head (aten.mm) and, with eager attention, QK^T and PV (aten.bmm);
    they equal the model's linear and attention parts for the token that step samples (the
    second generated token of a prompt of 5: it attends over 6 keys)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    c = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=50, attn_implementation="eager")
    model = LlamaForCausalLM(c).eval()
    with torch.no_grad():
        prefill = model(torch.randint(0, 50, (1, 5)), use_cache=True)
        with FlopCounterMode(display=False) as counter:
            model(torch.randint(0, 50, (1, 1)), past_key_values=prefill.past_key_values, use_cache=True)
    counts = {str(op): v for op, v in counter.get_flop_counts()["Global"].items()}
    two = decode_flops(ModelShape.from_hf_config(c), [(5, 2)])
    one = decode_flops(ModelShape.from_hf_config(c), [(5, 1)])
    assert counts["aten.mm"] == two["linear"] - one["linear"]
    assert counts["aten.bmm"] == two["attention"] - one["attention"]


def test_model_shape_from_a_model_dir(tiny_model: Path) -> None:
    from transformers import AutoConfig

    assert ModelShape.from_model_dir(tiny_model) == ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_model))


def test_engine_threads_follow_the_binding() -> None:
    import os

    from benchmarks.rollout import engine_threads
    from services.rollout.config import RolloutConfig

    assert engine_threads(RolloutConfig(cpu_omp_threads_bind="0-1")) == 2
    assert engine_threads(RolloutConfig(cpu_omp_threads_bind="3")) == 1
    cores = len(os.sched_getaffinity(0))
    assert engine_threads(RolloutConfig(cpu_reserved_cpus=0)) == cores
    assert engine_threads(RolloutConfig(cpu_reserved_cpus=1)) == max(1, cores - 1)


def test_decode_roofline_weights_every_shape() -> None:
    r = decode_roofline(TINY, rows=3, dtype="float32")
    shapes = {(s["k"], s["n"]) for s in r["shapes"]}
    # q/o (4 -> 4), k/v (4 -> 2), gate/up (4 -> 8), down (8 -> 4), the head (4 -> 10)
    assert shapes == {(4, 4), (4, 2), (4, 8), (8, 4), (4, 10)}
    assert all(s["m"] == 3 for s in r["shapes"])
    # a FLOP-weighted harmonic mean lies between the slowest and the fastest shape
    rates = [s["gflops"] for s in r["shapes"]]
    assert min(rates) <= r["gflops"] <= max(rates)


@pytest.mark.slow
def test_main_reports_the_roofline_ratio_on_the_tiny_model(tiny_model: Path, tmp_path: Path) -> None:
    from benchmarks.rollout import main

    out = tmp_path / "rollout.json"
    args = Namespace(model=str(tiny_model), prompts=2, n=2, max_tokens=8, repeats=1,
                     lora_slot=False, no_hf=True, json=str(out))
    assert main(args) == 0
    r = json.loads(out.read_text())
    for key in ("roofline_ratio", "achieved_gflops", "matmul_gflops", "gflop_per_token"):
        assert r[key] > 0 and math.isfinite(r[key]), key
    assert r["tokens_per_s"]["vllm"] > 0 and "hf_per_prompt" not in r["tokens_per_s"]
    assert r["roofline_rows"] == 4
