"""`hotloop bench rollout`: generation speed against a matmul roofline and HF `generate`,
both measured in the same run.

Owns the rollout benchmark (vLLM with and without a fresh adapter; HF `generate` per prompt
and batched unless `--no-hf`; `roofline_ratio`: the generated tokens' matmul FLOPs per second
against a matmul roofline of the decode shapes, benchmarks/roofline.py), and the prompts and
the random adapter that hot_update.py reuses. Machines here are noisy: every figure is a
median over repeats, and only ratios from one run are comparable.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import report

CODE_PROMPTS = [
    "Write a Python function `add(a, b)` that returns the sum of a and b.",
    "Write a Python function `is_even(n)` that returns True if n is even.",
    "Write a Python function `reverse(s)` that returns the string s reversed.",
    "Write a Python function `maximum(xs)` that returns the largest element of a list.",
    "Write a Python function `count_vowels(s)` that counts the vowels in s.",
    "Write a Python function `factorial(n)` that returns n factorial.",
    "Write a Python function `square_all(xs)` that returns a list of the squares of xs.",
    "Write a Python function `first_word(s)` that returns the first word of s.",
]


def _prompts(k: int) -> list[str]:
    return [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(k)]


def _chat_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


# ---- rollout ---------------------------------------------------------------------------------
# HF baselines are slow (tens of tok/s): each generate call stops after this long, so the
# default benchmark fits its 5-minute budget on a 2-core machine. A rate over 10 s of
# decoding is as good a baseline as one over the full workload.
HF_MAX_S = 10.0


def hf_tokens_per_s(model_dir: Path, prompts: list[str], n: int, max_tokens: int, batched: bool,
                    dtype: str = "float32") -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    gen = dict(do_sample=True, temperature=1.0, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
               num_return_sequences=n, pad_token_id=tok.pad_token_id, max_time=HF_MAX_S)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        groups = [texts] if batched else [[t] for t in texts]
        for g in groups:
            enc = tok(g, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, **gen)
            tokens += (out[:, enc["input_ids"].shape[1]:] != tok.pad_token_id).sum().item()
    return tokens / (time.perf_counter() - t0)


def spread(prompts: list[str], n: int, tenants: list[str]) -> list[tuple[str, list[str], int]]:
    """The workload's Generate calls, (tenant, prompts, n), with its len(prompts) x n samples
    spread evenly over `tenants` ("": one call on the default lineage). At most as many
    tenants as prompts: prompt i goes to tenant i % k with its n samples (prefills as in one
    call); more: prompt i's samples are shared out among tenants i, i + len(prompts), ..."""
    if not tenants:
        return [("", list(prompts), n)]
    k, calls = len(tenants), {}
    for i, prompt in enumerate(prompts):
        mine = tenants[i::len(prompts)] if k > len(prompts) else [tenants[i % k]]
        for j, t in enumerate(mine):
            share = n // len(mine) + (j < n % len(mine))
            if share:
                calls.setdefault((t, share), []).append(prompt)
    return [(t, ps, m) for (t, m), ps in calls.items()]


async def workload_rate(core, prompts: list[str], n: int, max_tokens: int,
                        tenants: list[str] = ()) -> float:
    """Generated tokens/s of the workload on `core` (a started `RolloutCore`): chat prompts,
    n samples of exactly `max_tokens` each at temperature 1, spread over `tenants` (`spread`),
    every call at once."""
    from services.rollout.core import GenerateInput, PromptIn, Sampling

    async def tokens(tenant: str, ps: list[str], m: int) -> int:
        req = GenerateInput([PromptIn(messages=[{"role": "user", "content": p}]) for p in ps],
                            Sampling(n=m, max_tokens=max_tokens, temperature=1.0, ignore_eos=True),
                            tenant=tenant)
        return sum([len(c.token_ids) async for c in core.generate(req)])

    t0 = time.perf_counter()
    got = sum(await asyncio.gather(*(tokens(*call) for call in spread(prompts, n, list(tenants)))))
    return got / (time.perf_counter() - t0)


async def push_local(core, data: bytes, version: int, model_name: str, tenant: str = "") -> None:
    """Push a packed adapter into `core` in this process (no gRPC), as `version` of `tenant`'s
    lineage ("": the default one, made live)."""
    from hotloop import adapters

    async def chunks():
        yield data

    await core.push(adapters.Version(version, adapters.sha256(data), len(data), model_name),
                    chunks(), tenant=tenant)


async def _vllm_rates(model_dir: Path, model_name: str, prompts: list[str], n: int, max_tokens: int,
                      repeats: int, mode: str, adapter_dir: Path,
                      tenant_adapters: list[Path] = ()) -> dict[str, float]:
    """tokens/s of one engine before and after a fresh adapter version goes live; with
    `tenant_adapters`, then also with the prompts spread evenly over that many tenants, each
    on its own adapter (`tenants`: one Generate call per tenant, all at once)."""
    from hotloop import adapters
    from services.rollout.config import RolloutConfig
    from services.rollout.core import RolloutCore

    cfg = RolloutConfig(update_mode=mode, max_lora_rank=64, max_new_tokens=max(max_tokens, 16),
                        cpu_reserved_cpus=0, tenant_slots=max(4, len(tenant_adapters)))
    core = RolloutCore(cfg, model_dir, base_model=model_name, max_model_len=1024,
                       storage_dir=Path(tempfile.mkdtemp(prefix="hotloop-bench-")))
    t0 = time.perf_counter()
    await core.start()
    print(f"    engine ({mode}, {core.dtype}) up in {time.perf_counter() - t0:.0f} s", flush=True)

    tenants = [f"tenant-{i}" for i in range(len(tenant_adapters))]

    async def rates(label: str, tenants: list[str] = ()) -> float:
        runs = []
        for i in range(repeats):
            runs.append(await workload_rate(core, prompts, n, max_tokens, tenants))
            print(f"    {label} run {i + 1}/{repeats}: {runs[-1]:.1f} tok/s", flush=True)
        return statistics.median(runs)

    try:
        # warm-up: first-use costs (allocations, oneDNN primitives) are not throughput; a short
        # batch of the same shape is enough and keeps the default run under 5 minutes
        await workload_rate(core, prompts, n, 8)
        base = await rates("base")
        await push_local(core, adapters.pack(adapter_dir), 1, model_name)
        await workload_rate(core, prompts, n, 8)
        with_adapter = await rates("fresh adapter")
        out = {"base": base, "adapter": with_adapter}
        if tenants:
            for t, d in zip(tenants, tenant_adapters):
                await push_local(core, adapters.pack(d), 1, model_name, tenant=t)
            await workload_rate(core, prompts, n, 8, tenants)  # loads the slots
            out["tenants"] = await rates(f"{len(tenants)} tenants", tenants)
    finally:
        await core.stop()
    return out


def make_bench_adapter(model_dir: Path, out: Path, rank: int, seed: int = 0,
                       b_scale: float = 0.01) -> Path:
    """An r=`rank` all-linear LoRA with small random weights, like an early training step."""
    return make_bench_adapters(model_dir, [out], rank, [seed], b_scale)[0]


def make_bench_adapters(model_dir: Path, outs: list[Path], rank: int, seeds: list[int],
                        b_scale: float = 0.01) -> list[Path]:
    """`make_bench_adapter` for each (out, seed), the model loaded once. `b_scale` multiplies
    peft's random B: 0.01 keeps outputs sensible (a trained adapter is a small delta); 1 makes
    each adapter's greedy outputs its own (a test of which adapter served a request)."""
    import math

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(
        r=rank, lora_alpha=2 * rank, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for out, seed in zip(outs, seeds):
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    # what init_lora_weights=False leaves: nn.Linear's own init, A and B alike
                    torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5))
                    if "lora_B" in name:
                        p.mul_(b_scale)
        peft_model.save_pretrained(out)
    return outs


def engine_threads(cfg) -> int:
    """The threads a CPU engine computes with: its bound cores, or (vLLM's `auto`) the cores
    this process may use less those reserved (`[rollout] cpu_reserved_cpus`)."""
    from hotloop.threads import bound_cores

    cores = bound_cores(cfg.cpu_omp_threads_bind)
    if cores is not None:
        return len(cores)
    return max(1, len(os.sched_getaffinity(0)) - cfg.cpu_reserved_cpus)


def decode_samples(model_dir: Path, prompts: list[str], n: int, max_tokens: int) -> list[tuple[int, int]]:
    """(prompt tokens, generated tokens) of every sample of the workload: each prompt's chat
    template, n samples of exactly `max_tokens` (the benchmark ignores EOS)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [(len(_chat_ids(tok, p)), max_tokens) for p in prompts for _ in range(n)]


def roofline(model_dir: Path, samples: list[tuple[int, int]], tokens_per_s: float, rows: int,
             dtype: str, threads: int) -> dict:
    """Generated tokens' matmul FLOPs per second (benchmarks/roofline.py: every linear and the
    head, plus attention over each token's keys; the prompts' prefill is not counted) against
    a matmul roofline of the decode shapes measured now, at `rows` sequences per engine step,
    in the engine's dtype, on the engine's device and (CPU) thread count."""
    import torch

    from benchmarks.roofline import ModelShape, cpu_mark, decode_flops, decode_roofline, other_cores

    shape = ModelShape.from_model_dir(model_dir)
    flops = decode_flops(shape, samples)
    tokens = sum(g for _, g in samples)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    mark = cpu_mark()
    try:
        roof = decode_roofline(shape, rows, dtype, device)
    finally:
        torch.set_num_threads(before)
    # Multi-threaded GEMMs wait at a barrier for any thread another process has descheduled:
    # beside a busy process the roofline (and the ratio) is off by far more than its share.
    others = other_cores(mark, cpu_mark())
    achieved = tokens_per_s * flops["total"] / tokens / 1e9
    return {"roofline_ratio": achieved / roof["gflops"],
            "achieved_gflops": achieved,
            "matmul_gflops": roof["gflops"],
            "matmul_shapes": roof["shapes"],
            "gflop_per_token": flops["total"] / tokens / 1e9,
            "gflop_per_token_by_part": {k: flops[k] / tokens / 1e9 for k in ("linear", "attention")},
            "flops_counted": "every linear of the body and the output head (2 x weights per "
                             "token) plus attention (QK^T and PV over each token's keys); "
                             "prefill not counted",
            "roofline_rows": rows, "roofline_threads": threads if device == "cpu" else None,
            "roofline_other_cores": others, "roofline_busy": device == "cpu" and others > 0.25,
            "roofline_device": device if device == "cpu" else torch.cuda.get_device_name()}


def bench_rollout(args) -> dict:
    from hotloop import models
    from hotloop.hardware import cpu_capability, resolve_dtype
    from services.rollout.config import RolloutConfig
    from services.rollout.core import resolve_mode

    model_dir = models.resolve(args.model)
    prompts = _prompts(args.prompts)
    # Each path in its best dtype. vLLM: `auto` (bf16 on CUDA and AMX CPUs, where it measured
    # faster; fp32 elsewhere). HF generate: the faster of fp32 and that dtype
    # on a short probe, because at small batches it is bound by per-op overhead, not by matmul
    # throughput (on an AVX512-BF16 CPU without AMX the probe gave fp32 67, bf16 60 tok/s).
    dtype = resolve_dtype("auto")
    cpu = str(cpu_capability())
    skip_hf = getattr(args, "no_hf", False)
    hf_sub = prompts[:1]  # HF per-prompt is slow; one prompt x n gives its rate
    hf_batch = prompts[:2]  # HF batched: 2 x n sequences give its rate within the time budget
    t_start = time.perf_counter()
    print(f"workload: {len(prompts)} prompts x n={args.n} x {args.max_tokens} tokens, chat template, "
          f"temperature 1; medians of {args.repeats} runs"
          + ("" if skip_hf else f" (HF, 1 run each: per-prompt {len(hf_sub)} prompt, batched "
                                f"{len(hf_batch)} prompts)")
          + f"; dtype {dtype}, cpu {cpu}", flush=True)
    hf: dict[str, float] = {}
    hf_dtype = None
    if not skip_hf:
        probes = {dt: hf_tokens_per_s(model_dir, hf_sub, args.n, 8, batched=False, dtype=dt)
                  for dt in dict.fromkeys(["float32", dtype])}
        hf_dtype = max(probes, key=probes.get)
        print(f"  hf dtype probe (8 tokens): "
              f"{', '.join(f'{k} {v:.1f} tok/s' for k, v in probes.items())} -> {hf_dtype}", flush=True)
        hf["hf_per_prompt"] = hf_tokens_per_s(model_dir, hf_sub, args.n, args.max_tokens,
                                              batched=False, dtype=hf_dtype)
        print(f"  hf_per_prompt  {hf['hf_per_prompt']:8.1f} tok/s", flush=True)
        hf["hf_batched"] = hf_tokens_per_s(model_dir, hf_batch, args.n, args.max_tokens,
                                           batched=True, dtype=hf_dtype)
        print(f"  hf_batched     {hf['hf_batched']:8.1f} tok/s", flush=True)
    adapter = make_bench_adapter(model_dir, Path(tempfile.mkdtemp(prefix="hotloop-adapter-")), 16)
    n_tenants = getattr(args, "tenants", 0)
    tenant_adapters = [make_bench_adapter(model_dir, Path(tempfile.mkdtemp(prefix="hotloop-adapter-")),
                                          16, seed=1 + i) for i in range(n_tenants)]

    default_mode = resolve_mode(RolloutConfig())
    rates = {}
    # LoRA slots on the CPU backend: 0.28x base at 8x8x64 (helper measurement), and engine
    # steps over 60 s at 8x8x128 with 64 sequences; opt-in so the default bench finishes.
    modes = [default_mode, "lora"] if args.lora_slot else [default_mode]
    for mode in dict.fromkeys(modes):
        rates[mode] = asyncio.run(_vllm_rates(
            model_dir, args.model, prompts, args.n, args.max_tokens, args.repeats, mode, adapter,
            tenant_adapters if mode == default_mode else []))
        print(f"  vllm ({mode:6s})  base {rates[mode]['base']:8.1f} tok/s, "
              f"fresh adapter {rates[mode]['adapter']:8.1f} tok/s", flush=True)
    vllm = rates[default_mode]["base"]
    vllm_adapter = rates[default_mode]["adapter"]
    tenants = ({"tenants": n_tenants, "batch_tokens_per_s": rates[default_mode]["tenants"],
                "merged_tokens_per_s": vllm_adapter,
                "batch_vs_merged": rates[default_mode]["tenants"] / vllm_adapter}
               if n_tenants else None)
    # After the engines have stopped, so that the matmuls have the cores the engine had.
    rows = len(prompts) * args.n  # sequences in one engine step of the workload
    print(f"  matmul roofline ({dtype}, {rows} rows)...", flush=True)
    roof = roofline(model_dir, decode_samples(model_dir, prompts, args.n, args.max_tokens), vllm,
                    rows, dtype, engine_threads(RolloutConfig(cpu_reserved_cpus=0)))
    result = {
        "workload": {"prompts": len(prompts), "n": args.n, "max_tokens": args.max_tokens,
                     "repeats": args.repeats, "model": args.model},
        "tokens_per_s": {**hf, "vllm": vllm, "vllm_adapter": vllm_adapter,
                         **({"vllm_lora_slot": rates["lora"]["adapter"]} if "lora" in rates else {})},
        **roof,
        **({"tenants": tenants} if tenants else {}),
        "update_mode": default_mode,
        "dtype": dtype,
        "hf_dtype": hf_dtype,
        "cpu": cpu,
        "seconds": time.perf_counter() - t_start,
        "ratios": {**({"vllm_vs_hf_per_prompt": vllm / hf["hf_per_prompt"],
                       "vllm_vs_hf_batched": vllm / hf["hf_batched"]} if hf else {}),
                   "adapter_vs_base": vllm_adapter / vllm,
                   **({"lora_slot_vs_base": rates["lora"]["adapter"] / rates["lora"]["base"]}
                      if "lora" in rates else {})},
    }
    return result


def table(r: dict) -> str:
    """The printed summary: speeds, then the roofline."""
    tps, ratios = r["tokens_per_s"], r["ratios"]
    rows = [
        ("vLLM tokens/s", f"{tps['vllm']:.0f} (fresh adapter {tps['vllm_adapter']:.0f}, "
         f"{ratios['adapter_vs_base']:.2f}x, {r['update_mode']})"),
        *([("vs HF generate", f"{ratios['vllm_vs_hf_per_prompt']:.1f}x per prompt "
            f"({tps['hf_per_prompt']:.0f} tok/s), {ratios['vllm_vs_hf_batched']:.1f}x batched "
            f"({tps['hf_batched']:.0f} tok/s)")] if "hf_per_prompt" in tps else []),
        *([("LoRA slot", f"{ratios['lora_slot_vs_base']:.2f}x base")]
          if "lora_slot_vs_base" in ratios else []),
        *([("tenants", f"{r['tenants']['tenants']} adapters in one batch "
            f"{r['tenants']['batch_tokens_per_s']:.0f} tok/s, "
            f"{r['tenants']['batch_vs_merged']:.2f}x one merged adapter")] if "tenants" in r else []),
        ("FLOPs per token", f"{r['gflop_per_token']:.3f} GFLOP ("
         + ", ".join(f"{k} {v:.3f}" for k, v in r["gflop_per_token_by_part"].items())
         + "; prefill not counted)"),
        ("achieved", f"{r['achieved_gflops']:.1f} GFLOP/s"),
        ("matmul roofline", f"{r['matmul_gflops']:.1f} GFLOP/s ({r['dtype']}, "
         + (f"{r['roofline_threads']} threads, {r['cpu']}" if r["roofline_threads"]
            else r["roofline_device"]) + f", {r['roofline_rows']} rows)"),
        ("roofline ratio", f"{r['roofline_ratio']:.2f}"),
        *([("WARNING", f"other processes used {r['roofline_other_cores']:.2f} cores while the "
            "roofline ran: it and the ratio are not this CPU's")] if r.get("roofline_busy") else []),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(args) -> int:
    """`hotloop bench rollout`."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    result = bench_rollout(args)
    report(result, args.json, table=table(result))
    return 0
