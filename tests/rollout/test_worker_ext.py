"""Merged hot LoRA updates in a vLLM CPU engine (services/rollout/worker_ext.py).

Fast tests check the pure parts (adapter parsing, validation, merge math). Slow tests start one
vLLM engine on the tiny random model for the whole module and compare its outputs after a commit
with Hugging Face transformers running the same adapter merged (``merge_and_unload``, fp32).

Tolerance: vLLM runs in bf16, HF in fp32. Per-token logprobs of the same tokens (teacher forced in
HF on vLLM's greedy continuation) must agree within LOGPROB_TOL nats; greedy tokens must agree at
every position where HF's top-1 beats its top-2 by more than 2 * LOGPROB_TOL (closer calls can
flip legitimately between dtypes).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from services.rollout import worker_ext as wx

LOGPROB_TOL = 0.05  # nats, bf16 engine vs fp32 reference
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N_TOKENS = 8
PROMPTS = [[1, 17, 42, 99, 7, 256, 300, 12], [1, 5, 6, 7, 8, 9, 10], [1, 400, 401, 3, 77, 140]]


def make_adapter(
    model_dir: Path,
    out: Path,
    targets: list[str] | str = ALL_LINEAR,
    r: int = 16,
    alpha: float = 32,
    rslora: bool = False,
    b_std: float = 0.05,
    seed: int = 1,
) -> Path:
    """A peft adapter with random A and B ~ N(0, b_std) (b_std=0: an exact zero delta)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                     init_lora_weights=True)  # A random (kaiming), B zero; B set below
    pm = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std) if b_std > 0 else p.zero_()
    pm.save_pretrained(out)
    return out


# --------------------------------------------------------------------------------------------
# Fast: parsing, validation, merge math (no engine)


def _tiny_specs() -> dict[str, wx.LinearSpec]:
    # The tiny model: hidden 256, 4 heads of 64, 2 KV heads (GQA), intermediate 512, 4 layers.
    specs = {}
    for i in range(4):
        p = f"model.layers.{i}"
        for s in (
            wx.LinearSpec(f"{p}.self_attn.qkv_proj",
                          tuple(f"{p}.self_attn.{x}_proj" for x in "qkv"), (256, 128, 128), 256),
            wx.LinearSpec(f"{p}.self_attn.o_proj", (f"{p}.self_attn.o_proj",), (256,), 256),
            wx.LinearSpec(f"{p}.mlp.gate_up_proj",
                          (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"), (512, 512), 256),
            wx.LinearSpec(f"{p}.mlp.down_proj", (f"{p}.mlp.down_proj",), (256,), 512),
        ):
            specs[s.vllm_name] = s
    return specs


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, Path]:
    from hotloop.models import build_tiny_model

    root = tmp_path_factory.mktemp("wx-adapters")
    other = build_tiny_model(root / "other-base", hidden=128)
    return {
        "good": make_adapter(tiny_model, root / "good"),
        "partial_rslora": make_adapter(
            tiny_model, root / "partial", targets=["q_proj", "v_proj", "down_proj"],
            r=8, alpha=16, rslora=True, b_std=0.1, seed=2,
        ),
        "zero": make_adapter(tiny_model, root / "zero", b_std=0.0),
        "other_base": make_adapter(other, root / "other"),
    }


def _rewrite(src: Path, dst: Path, cfg_update: dict | None = None, tensor_fn=None) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(cfg_update or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if tensor_fn:
        tensors = tensor_fn(tensors)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_read_adapter_scaling(adapters):
    good = wx.read_peft_adapter(adapters["good"], max_rank=64)
    assert len(good) == 4 * 7
    f = good["model.layers.0.self_attn.k_proj"]
    assert f.a.shape == (16, 256) and f.b.shape == (128, 16)  # GQA: k has 2 heads x 64
    assert f.scale == pytest.approx(32 / 16)
    part = wx.read_peft_adapter(adapters["partial_rslora"], max_rank=64)
    assert set(m.rpartition(".")[2] for m in part) == {"q_proj", "v_proj", "down_proj"}
    assert part["model.layers.1.mlp.down_proj"].scale == pytest.approx(16 / math.sqrt(8))


def test_rank_pattern_and_alpha_pattern(adapters, tmp_path):
    def shrink_q(t):  # layer 0 q_proj gets rank 4
        rows, cols = (slice(0, 4), slice(None)), (slice(None), slice(0, 4))
        for ab, sl in (("lora_A", rows), ("lora_B", cols)):
            k = f"base_model.model.model.layers.0.self_attn.q_proj.{ab}.weight"
            t[k] = t[k][sl].contiguous()
        return t

    d = _rewrite(adapters["good"], tmp_path / "pat",
                 {"rank_pattern": {"layers.0.self_attn.q_proj": 4}, "alpha_pattern": {"o_proj": 8}},
                 shrink_q)
    f = wx.read_peft_adapter(d, max_rank=64)
    assert f["model.layers.0.self_attn.q_proj"].scale == pytest.approx(32 / 4)
    assert f["model.layers.1.self_attn.q_proj"].scale == pytest.approx(32 / 16)
    assert f["model.layers.2.self_attn.o_proj"].scale == pytest.approx(8 / 16)


def test_rejects_bad_adapters(adapters, tmp_path):
    good = adapters["good"]
    with pytest.raises(ValueError, match="exceeds the limit"):
        wx.read_peft_adapter(good, max_rank=8)

    def poison(t):
        k = next(k for k in t if "lora_B" in k)
        t[k][0, 0] = float("nan")
        return t

    with pytest.raises(ValueError, match="non-finite"):
        wx.read_peft_adapter(_rewrite(good, tmp_path / "nan", tensor_fn=poison), 64)

    def add_head(t):
        t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(16, 256)
        t["base_model.model.lm_head.lora_B.weight"] = torch.zeros(448, 16)
        return t

    with pytest.raises(ValueError, match="embeddings / lm_head"):
        wx.read_peft_adapter(_rewrite(good, tmp_path / "head", tensor_fn=add_head), 64)

    def add_full(t):
        t["base_model.model.model.norm.weight"] = torch.ones(256)
        return t

    with pytest.raises(ValueError, match="unexpected tensor"):
        wx.read_peft_adapter(_rewrite(good, tmp_path / "full", tensor_fn=add_full), 64)
    with pytest.raises(ValueError, match="use_dora"):
        wx.read_peft_adapter(_rewrite(good, tmp_path / "dora", {"use_dora": True}), 64)
    with pytest.raises(ValueError, match="not a peft adapter"):
        wx.read_peft_adapter(tmp_path, 64)

    specs = _tiny_specs()
    other = wx.read_peft_adapter(adapters["other_base"], 64)
    with pytest.raises(ValueError, match="do not fit the base weight"):
        wx.plan_merge(other, specs, wx.build_hf_index(specs))
    renamed = {"model.layers.9.self_attn.q_proj": next(iter(other.values()))}
    with pytest.raises(ValueError, match="does not serve"):
        wx.plan_merge(renamed, specs, wx.build_hf_index(specs))


def test_base_weights_and_merge_math(tiny_model, adapters):
    from safetensors.torch import load_file

    specs = _tiny_specs()
    base = wx.load_base_weights(tiny_model, specs, torch.bfloat16)
    ckpt = load_file(str(tiny_model / "model.safetensors"))
    qkv = base["model.layers.2.self_attn.qkv_proj"]
    assert qkv.shape == (512, 256) and qkv.dtype == torch.bfloat16
    # Fused order q, k, v with GQA shard sizes 256, 128, 128.
    assert torch.equal(qkv[256:384], ckpt["model.layers.2.self_attn.k_proj.weight"].bfloat16())

    factors = wx.read_peft_adapter(adapters["partial_rslora"], 64)
    plan = wx.plan_merge(factors, specs, wx.build_hf_index(specs))
    assert set(plan) == {f"model.layers.{i}.{m}" for i in range(4)
                         for m in ("self_attn.qkv_proj", "mlp.down_proj")}
    name = "model.layers.1.self_attn.qkv_proj"
    merged = wx.merge_layer(base[name], specs[name], plan[name])
    q, v = (factors[f"model.layers.1.self_attn.{x}_proj"] for x in "qv")
    ref = ckpt["model.layers.1.self_attn.q_proj.weight"] + q.scale * q.b @ q.a
    # One bf16 rounding of the fp32 result (plus the bf16 cast of base and factors).
    assert (merged[:256].float() - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert torch.equal(merged[256:384], base[name][256:384])  # k untouched
    ref_v = ckpt["model.layers.1.self_attn.v_proj.weight"] + v.scale * v.b @ v.a
    assert torch.allclose(merged[384:].float(), ref_v, atol=2e-2 * ref_v.abs().max())


def test_an_archive_reads_as_its_directory(adapters, tmp_path):
    """What the rollout service stores (adapters.pack's tar) gives the same factors."""
    from hotloop import adapters as archives

    for name in ("good", "partial_rslora"):
        (tmp_path / f"{name}.tar").write_bytes(archives.pack(adapters[name]))
        from_dir = wx.read_peft_adapter(adapters[name], 64)
        from_tar = wx.read_peft_adapter(tmp_path / f"{name}.tar", 64)
        assert from_dir.keys() == from_tar.keys()
        for k, f in from_dir.items():
            g = from_tar[k]
            assert torch.equal(f.a, g.a) and torch.equal(f.b, g.b) and f.scale == g.scale, k
    (tmp_path / "junk.tar").write_bytes(b"x" * 2048)
    with pytest.raises(ValueError, match="not a valid tar"):
        wx.read_peft_adapter(tmp_path / "junk.tar", 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_factored_layer_computes_the_merged_weight(adapters, tiny_model, tmp_path, dtype):
    """x @ (base + delta)^T for every layer, fused ones included, with per-shard scales that
    differ (layer 0's q has rank 4 and its own scale; o_proj its own alpha)."""
    def shrink_q(t):
        for ab, sl in (("lora_A", (slice(0, 4), slice(None))), ("lora_B", (slice(None), slice(0, 4)))):
            k = f"base_model.model.model.layers.0.self_attn.q_proj.{ab}.weight"
            t[k] = t[k][sl].contiguous()
        return t

    d = _rewrite(adapters["good"], tmp_path / "pat",
                 {"rank_pattern": {"layers.0.self_attn.q_proj": 4}, "alpha_pattern": {"o_proj": 8}},
                 shrink_q)
    specs = _tiny_specs()
    base = wx.load_base_weights(tiny_model, specs, dtype)
    plan = wx.plan_merge(wx.read_peft_adapter(d, 64), specs, wx.build_hf_index(specs))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for name, shards in plan.items():
        k = specs[name].in_features
        xs = x[:, :k].to(dtype)
        fn = wx.factored_linear(lambda x_, w_, b_, name=name: x_ @ base[name].T,
                                *wx.factor_layer(specs[name], shards, dtype))
        got = fn(xs, None, None).float()
        merged = wx.merge_layer(base[name].float(), specs[name], shards)
        want = xs.float() @ merged.T
        assert (got - want).abs().max() <= tol * want.abs().max(), name


def test_device_path_merges_in_place(tiny_model, adapters):
    """The non-CPU branch (CUDA), exercised with plain CPU modules that keep a real weight:
    commit writes base + delta into the existing weight storage; reset copies base back."""
    specs = _tiny_specs()
    base = wx.load_base_weights(tiny_model, specs, torch.bfloat16)
    layers = {}
    for name, spec in specs.items():
        lin = torch.nn.Linear(spec.in_features, spec.out_features, bias=False, dtype=torch.bfloat16)
        lin.weight.data.copy_(base[name])
        layers[name] = lin
    st = wx._State(
        model_dir=str(tiny_model), dtype=torch.bfloat16, is_cpu=False, max_rank=64, specs=specs,
        layers=layers, base=base, v0={k: wx._Packed(None, None) for k in specs},
        hf_index=wx.build_hf_index(specs),
    )
    ptrs = {k: m.weight.data_ptr() for k, m in layers.items()}
    prepared = wx._build_prepared(st, 1, str(adapters["partial_rslora"]), "merged")
    assert all(torch.equal(layers[k].weight, base[k]) for k in specs)  # prepare: untouched
    wx._swap_in(st, {**st.v0, **prepared.packed})
    plan = wx.plan_merge(wx.read_peft_adapter(adapters["partial_rslora"], 64), specs, st.hf_index)
    for k, m in layers.items():
        assert m.weight.data_ptr() == ptrs[k]
        want = wx.merge_layer(base[k], specs[k], plan[k]) if k in plan else base[k]
        assert torch.equal(m.weight, want), k
    wx._swap_in(st, st.v0)
    assert all(torch.equal(layers[k].weight, base[k]) for k in specs)


# --------------------------------------------------------------------------------------------
# Slow: one real vLLM CPU engine for the module


@pytest.fixture(scope="module")
def llm(tiny_model):
    from vllm import LLM

    engine = LLM(model=str(tiny_model), dtype="bfloat16", enforce_eager=True, max_model_len=1024,
                 worker_extension_cls="services.rollout.worker_ext.HotloopWorkerExtension",
                 seed=0)
    (summary,) = engine.collective_rpc("hotloop_init", args=(str(tiny_model),))
    assert summary["layers"] == 16 and summary["live_version"] == 0
    assert summary["probe_rel_err"] < 1e-2
    yield engine
    del engine


def _generate(llm) -> tuple[list[list[int]], list[list[float]]]:
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, logprobs=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [
        [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
        for o in outs
    ]
    return toks, lps


def _hf_check(model_dir: Path, adapter: Path | None, toks, lps) -> float:
    """Teacher-force vLLM's tokens through HF (fp32, adapter merged); return max |dlogprob|."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    worst = 0.0
    with torch.no_grad():
        for prompt, t, lp in zip(PROMPTS, toks, lps):
            ids = torch.tensor([prompt + t])
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)[len(prompt) - 1 : -1]
            ref = logp.gather(1, torch.tensor(t)[:, None])[:, 0]
            worst = max(worst, float((ref - torch.tensor(lp)).abs().max()))
            top2 = logp.topk(2, dim=-1)
            clear = (top2.values[:, 0] - top2.values[:, 1]) > 2 * LOGPROB_TOL
            greedy = top2.indices[:, 0]
            assert torch.equal(greedy[clear], torch.tensor(t)[clear]), (prompt, t, greedy.tolist())
    return worst


@pytest.fixture(scope="module")
def base_out(llm):
    return _generate(llm)


@pytest.mark.slow
def test_base_matches_hf(llm, tiny_model, base_out):
    assert _hf_check(tiny_model, None, *base_out) < LOGPROB_TOL


@pytest.mark.slow
def test_prepare_without_commit_changes_nothing(llm, adapters, base_out):
    (res,) = llm.collective_rpc("hotloop_prepare", args=(1, str(adapters["good"])))
    assert res["layers_merged"] == 16 and res["prepare_s"] > 0
    assert _generate(llm) == base_out
    (st,) = llm.collective_rpc("hotloop_status")
    assert st["live_version"] == 0 and st["pending_version"] == 1
    llm.collective_rpc("hotloop_discard")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["merged", "factored"])
@pytest.mark.parametrize("name", ["good", "partial_rslora"])
def test_commit_matches_hf_merged(llm, tiny_model, adapters, base_out, name, mode):
    llm.collective_rpc("hotloop_prepare", args=(7, str(adapters[name])), kwargs={"mode": mode})
    (res,) = llm.collective_rpc("hotloop_commit", args=(7,))
    assert res["version"] == 7 and res["mode"] == mode and res["prefix_caching"] is True
    llm.reset_prefix_cache()  # prompts repeat across tests: old-weight KV must not be reused
    try:
        toks, lps = _generate(llm)
        assert llm.collective_rpc("hotloop_live_version") == [7]
    finally:
        llm.collective_rpc("hotloop_reset")
        llm.reset_prefix_cache()
    worst = _hf_check(tiny_model, adapters[name], toks, lps)
    assert worst < LOGPROB_TOL, worst
    # The delta is far from trivial: outputs moved well beyond the tolerance.
    moved = max(abs(a - b) for x, y in zip(lps, base_out[1]) for a, b in zip(x, y))
    assert toks != base_out[0] or moved > 10 * LOGPROB_TOL


@pytest.mark.slow
def test_reset_restores_base(llm, base_out, adapters):
    llm.collective_rpc("hotloop_prepare", args=(8, str(adapters["good"])))
    llm.collective_rpc("hotloop_commit", args=(8,))
    (res,) = llm.collective_rpc("hotloop_reset")
    assert res["version"] == 0
    llm.reset_prefix_cache()
    assert _generate(llm) == base_out


@pytest.mark.slow
def test_zero_delta_keeps_outputs(llm, adapters, base_out):
    llm.collective_rpc("hotloop_prepare", args=(9, str(adapters["zero"])))
    llm.collective_rpc("hotloop_commit", args=(9,))
    llm.reset_prefix_cache()
    try:
        toks, lps = _generate(llm)
        assert toks == base_out[0]
        # bf16(base + 0) == base, and the same kernels: identical, not merely close.
        assert lps == base_out[1]
    finally:
        llm.collective_rpc("hotloop_reset")


@pytest.mark.slow
def test_background_prepare_then_commit(llm, tiny_model, adapters, base_out):
    (res,) = llm.collective_rpc(
        "hotloop_prepare", args=(10, str(adapters["good"])), kwargs={"background": True}
    )
    assert res["background"] is True
    llm.collective_rpc("hotloop_commit", args=(10,))
    llm.reset_prefix_cache()
    try:
        toks, lps = _generate(llm)
        assert _hf_check(tiny_model, adapters["good"], toks, lps) < LOGPROB_TOL
    finally:
        llm.collective_rpc("hotloop_reset")
        llm.reset_prefix_cache()


@pytest.mark.slow
def test_bad_adapter_raises_and_changes_nothing(llm, adapters, base_out, tmp_path):
    # A live non-base version first, so "unchanged" means "still that version", not just base.
    llm.collective_rpc("hotloop_prepare", args=(11, str(adapters["good"])))
    llm.collective_rpc("hotloop_commit", args=(11,))
    llm.reset_prefix_cache()
    live_out = _generate(llm)
    with pytest.raises(Exception, match="do not fit the base weight"):
        llm.collective_rpc("hotloop_prepare", args=(12, str(adapters["other_base"])))
    with pytest.raises(Exception, match="not a peft adapter"):
        llm.collective_rpc("hotloop_prepare", args=(12, str(tmp_path)))
    with pytest.raises(Exception, match="not prepared"):
        llm.collective_rpc("hotloop_commit", args=(12,))
    # A failing background prepare surfaces at commit.
    llm.collective_rpc(
        "hotloop_prepare", args=(13, str(adapters["other_base"])), kwargs={"background": True}
    )
    with pytest.raises(Exception, match="do not fit the base weight"):
        llm.collective_rpc("hotloop_commit", args=(13,))
    assert llm.collective_rpc("hotloop_live_version") == [11]
    assert _generate(llm) == live_out
    llm.collective_rpc("hotloop_reset")
    llm.reset_prefix_cache()
    assert _generate(llm) == base_out


@pytest.mark.slow
def test_factored_then_merged_same_version(llm, tiny_model, adapters):
    """Go live fast (factored), then replace it with the merged build of the same version."""
    llm.collective_rpc(
        "hotloop_prepare", args=(20, str(adapters["good"])), kwargs={"mode": "factored"}
    )
    llm.collective_rpc("hotloop_commit", args=(20,))
    llm.reset_prefix_cache()
    try:
        fact = _generate(llm)
        llm.collective_rpc(
            "hotloop_prepare", args=(20, str(adapters["good"])), kwargs={"background": True}
        )
        (res,) = llm.collective_rpc("hotloop_commit", args=(20,))
        assert res["mode"] == "merged"
        (st,) = llm.collective_rpc("hotloop_status")
        assert st["live_version"] == 20 and st["live_mode"] == "merged"
        llm.reset_prefix_cache()
        merged = _generate(llm)
    finally:
        llm.collective_rpc("hotloop_reset")
        llm.reset_prefix_cache()
    # Same version, different rounding: the same tokens where margins are clear, close logprobs.
    assert _hf_check(tiny_model, adapters["good"], *fact) < LOGPROB_TOL
    assert _hf_check(tiny_model, adapters["good"], *merged) < LOGPROB_TOL


@pytest.mark.slow
def test_swap_builds_and_commits_an_archive_in_one_call(llm, tiny_model, adapters, base_out, tmp_path):
    """hotloop_swap (the in-flight path, sent right behind a pause): from the stored archive,
    the factored build goes live in one call; a bad archive raises with the live version and
    nothing pending left behind."""
    from hotloop import adapters as archives

    good, bad = tmp_path / "good.tar", tmp_path / "bad.tar"
    good.write_bytes(archives.pack(adapters["good"]))
    bad.write_bytes(archives.pack(adapters["other_base"]))
    (res,) = llm.collective_rpc("hotloop_swap", args=(30, str(good)),
                                kwargs={"mode": "factored", "snapshot": True})
    assert res["version"] == 30 and res["mode"] == "factored" and "tokens_at_commit" in res
    llm.reset_prefix_cache()
    try:
        live_out = _generate(llm)
        assert _hf_check(tiny_model, adapters["good"], *live_out) < LOGPROB_TOL
        with pytest.raises(Exception, match="do not fit the base weight"):
            llm.collective_rpc("hotloop_swap", args=(31, str(bad)), kwargs={"mode": "factored"})
        (st,) = llm.collective_rpc("hotloop_status")
        assert st["live_version"] == 30 and st["pending_version"] is None
        assert _generate(llm) == live_out
    finally:
        llm.collective_rpc("hotloop_reset")
        llm.reset_prefix_cache()
