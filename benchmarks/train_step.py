"""`hotloop bench train-step`: the LoRA step's tokens/s against a matmul roofline measured in
the same run.

Owns the measurement behind issue 8 §3 ("the LoRA step at the speed its FLOPs allow"): a real
`LoraPolicy.train_step` on synthetic GRPO samples, a FLOP model of that step, a matmul benchmark
on this CPU with the step's own shapes, dtype and thread count, and a profile of where the
non-matmul time goes. Does not own the step itself (policy.py) or any default it measures.

The FLOP model (`step_flops`), for a Llama-shaped decoder with hidden H, intermediate I, nh query
heads and nkv key/value heads of size hd, `layers` layers of which the top `adapted` carry LoRA
of rank r on every linear (`--top-layers`; all by default), vocabulary V, per sequence of p
prompt and c completion tokens, L = p + c:

    P = H*nh*hd + 2*H*nkv*hd + nh*hd*H + 3*H*I    weights per layer (q, k, v, o, gate, up, down)
    S = sum over those 7 linears of (in + out)    what one LoRA rank costs per token
    base      = layers * 2*P*L + adapted * 2*P*L
                                        forward 2*P*L in every layer; backward 2*P*L in the
                                        adapted ones only (nothing below them needs a gradient):
                                        the base is frozen, so only dX = dY W, never dW
    lora      = adapted * 6*r*S*L       forward 2*r*S*L; backward twice that (dX and dW of A and B)
    attention = (layers * 2 + adapted * 4) * nh*hd*L*(L+1)
                                        forward QK^T and PV over the L(L+1)/2 causal pairs,
                                        2*2*nh*hd each; backward (adapted layers) twice that
    head      = 4*H*V*c                 the (tied, frozen) output head runs on completion
                                        positions only (hotloop.logprobs): forward + dX

Summed over the step's sequences. Not counted: embeddings (lookups), RMSNorm, RoPE, SiLU,
residual adds, softmax and log-softmax, the loss, clipping and AdamW (all O(L*H) or O(c*V)
elementwise work, or O(adapter) per step), padding (counted tokens are real tokens), and the
flash-attention backward's recomputation of QK^T (an implementation choice). The formula slightly
over-counts: autograd skips dX of layer 0's q/k/v (their input, the normed embedding, needs no
gradient), under 0.3% of the step for SmolLM2-135M.

The roofline (benchmarks/roofline.py measures it) is a matmul benchmark of exactly the shapes
the step's FLOPs run on: every body linear forward ([M, in] x [in, out]) and its backward dX
([M, out] x [out, in]) with M the padded tokens of the largest micro-batch, and the head
forward and backward on one logprob chunk. `matmul_gflops` is their FLOP-weighted harmonic mean (the step's matmul FLOPs divided by
the time they take at the benchmarked speeds), and

    roofline_ratio = (step_gflop / step_s) / matmul_gflops

so 1.0 would be a step that spends all its time in matmuls as fast as this CPU runs them alone.
LoRA's skinny matmuls and attention are held to the same rate: the aim is the speed the FLOPs
allow, and a shape this CPU runs slowly is part of what the ratio shows.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.common import report
from benchmarks.roofline import MatmulCase, ModelShape, cpu_mark, linear_case, matmul_gflops, other_cores

__all__ = ["ModelShape", "main", "matmul_roofline", "run", "step_flops"]


def step_flops(shape: ModelShape, lora_r: int, lengths: Sequence[tuple[int, int]],
               adapted: int | None = None) -> dict[str, float]:
    """FLOPs of one train step over sequences of (prompt, completion) tokens (module docstring),
    by part and in total. `adapted`: the top layers that carry LoRA (None: all)."""
    P = sum(i * o for _, i, o in shape.linears())
    S = sum(i + o for _, i, o in shape.linears())
    n = shape.layers
    k = n if adapted is None else adapted
    out = {"base": 0.0, "lora": 0.0, "attention": 0.0, "head": 0.0}
    for p, c in lengths:
        L = p + c
        out["base"] += (n + k) * 2 * P * L
        out["lora"] += k * 6 * lora_r * S * L
        out["attention"] += (2 * n + 4 * k) * shape.heads * shape.head_dim * L * (L + 1)
        out["head"] += 4 * shape.hidden * shape.vocab * c
    out["total"] = sum(out.values())
    return out


# ---- the roofline ---------------------------------------------------------------------------


def matmul_roofline(shape: ModelShape, rows: int, tokens: int, head_rows: int,
                    completion_tokens: int, dtype: str, adapted: int | None = None) -> dict[str, Any]:
    """Benchmark the step's matmul shapes (module docstring) in `dtype` on the current torch
    threads. `rows`: M of the body's matmuls (padded tokens of a micro-batch); `tokens` and
    `completion_tokens`: the step's totals, which weight each shape by the FLOPs it carries;
    `adapted`: the layers whose backward runs (None: all)."""
    import torch

    # F.linear is what nn.Linear runs forward; F.linear of dY by W^T, i.e. [M, out] x
    # [out, in] stored as [in, out], the same GEMM as the backward's mm(dY, W) for dX. The
    # backward runs only in the adapted layers.
    work: dict[tuple[int, int], float] = {}
    k = shape.layers if adapted is None else adapted
    for _, i, o in shape.linears():
        f = 2.0 * i * o * tokens
        work[(i, o)] = work.get((i, o), 0.0) + f * shape.layers  # forward
        work[(o, i)] = work.get((o, i), 0.0) + f * k  # backward dX
    cases = [linear_case(rows, kk, n, f, dtype) for (kk, n), f in work.items()]
    head_f = 2.0 * shape.hidden * shape.vocab * completion_tokens
    g = torch.Generator().manual_seed(1)
    dt = getattr(torch, dtype)
    emb = torch.randn(shape.vocab, shape.hidden, generator=g).to(dt)
    h = torch.randn(head_rows, shape.hidden, generator=g).to(dt)
    dlogits = torch.randn(head_rows, shape.vocab, generator=g).to(dt)
    cases.append(MatmulCase(lambda: torch.nn.functional.linear(h, emb), head_rows, shape.hidden,
                            shape.vocab, head_f, "head"))
    cases.append(MatmulCase(lambda: torch.mm(dlogits, emb), head_rows, shape.vocab, shape.hidden,
                            head_f, "head_dx"))
    return matmul_gflops(cases)


# ---- the profile ----------------------------------------------------------------------------

_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear",
           "aten::matmul"}
_COPY = {"aten::copy_", "aten::fill_", "aten::zero_", "aten::cat", "aten::index",
         "aten::index_put_", "aten::_index_put_impl_", "aten::clone", "aten::contiguous",
         "aten::empty", "aten::empty_strided", "aten::zeros", "aten::full", "aten::to",
         "aten::_to_copy", "aten::gather", "aten::scatter", "aten::scatter_add_",
         "aten::index_select", "aten::embedding", "aten::embedding_dense_backward",
         "aten::new_zeros", "aten::resize_", "aten::stack", "aten::nonzero",
         "aten::masked_fill", "aten::masked_fill_", "aten::where"}
_LOG_SOFTMAX = {"aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::log_softmax"}


def _category(name: str, shapes: Sequence[Any], lora_r: int, in_optimizer: bool) -> str:
    if in_optimizer:
        return "optimizer"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name in _MATMUL:
        dims = [d for s in shapes if isinstance(s, (list, tuple)) for d in s]
        return "matmul_lora" if lora_r in dims else "matmul_base_head"
    if name in _LOG_SOFTMAX:
        return "log_softmax"
    if name in _COPY:
        return "copy_index_alloc"
    if name.startswith("aten::"):
        return "elementwise"  # norms, RoPE, SiLU, residuals, peft's scale and add, the loss
    return "python_dispatch"  # autograd nodes' and modules' own (non-aten) time


PROFILE_MAX_SAMPLES = 16
"""The profiled step's samples at most (the first ones: whole groups when the group size
divides it, as the demo's 8 does)."""


def profile_step(policy: Any, samples: Sequence[Any], lora_r: int) -> dict[str, Any]:
    """One train step under torch.profiler: self time by category (shares of the profiled
    step), the top ops, and the step's page faults. The profiler slows small ops more than big
    ones, so the shares lean towards the non-matmul side."""
    from torch.profiler import ProfilerActivity, profile

    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        m = policy.train_step(samples)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    events = list(prof.events())

    def under_optimizer(e: Any) -> bool:
        p = e
        while p is not None:
            if p.name.startswith("Optimizer."):
                return True
            p = p.cpu_parent
        return False

    by_cat: dict[str, float] = {}
    by_op: dict[str, float] = {}
    for e in events:
        us = e.self_cpu_time_total
        if us <= 0:
            continue
        cat = _category(e.name, e.input_shapes or [], lora_r, under_optimizer(e))
        by_cat[cat] = by_cat.get(cat, 0.0) + us
        by_op[e.name] = by_op.get(e.name, 0.0) + us
    total = sum(by_cat.values()) or 1.0
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    return {
        "samples": len(samples),
        "step_s_profiled": m.seconds,
        "shares": {k: round(v / total, 4) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_ops": [{"op": k, "share": round(v / total, 4)} for k, v in top],
        "minor_page_faults": faults,
    }


# ---- data parallel ---------------------------------------------------------------------------


def compare_ranks(policy: Any, batch: Sequence[Any], ranks: int, steps: int,
                  say: Callable[[str], None] = print) -> dict[str, Any]:
    """The same step on one rank (`policy`) and on `ranks` ranks (`distributed.make_policy`),
    each from the same checkpoint of `policy`, `steps` times after a warm-up: the step times
    (median) and how far the two updates are apart. The ranks share the one rank's threads
    (each gets threads / ranks), so the times compare the same cores.

    `max_param_diff` is after one AdamW step with the shipped eps (1e-8), whose first step is
    lr * sign(g): a gradient that is ~0 moves by +-lr whichever way rounding tips it, so it
    can reach lr even where the gradients agree to rounding; `max_grad_diff` (against
    `max_grad`, the largest gradient) is what data parallelism itself changes."""
    import tempfile

    import torch

    from services.trainer.learner.distributed import make_policy

    threads = max(1, torch.get_num_threads() // ranks)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = policy.save_checkpoint(Path(tmp))

        def timed(p: Any, label: str) -> list[float]:
            secs = []
            for k in range(steps + 1):
                p.restore(ckpt)
                m = p.train_step(batch)
                say(f"[train-step] {label}, {'warm-up' if k == 0 else f'step {k}/{steps}'}: "
                    f"{m.seconds:.2f} s")
                secs.append(m.seconds)
            return secs[1:]

        one = timed(policy, "1 rank")
        dp = make_policy(policy.cfg.model_copy(update={"data_parallel": ranks,
                                                       "torch_threads": threads}),
                         policy.base_model_path)
        try:
            many = timed(dp, f"{ranks} ranks x {threads} threads")
            pairs = list(zip(policy.trainable_tensors(), dp.trainable_tensors(), strict=True))
            diff = max(float((a - b).detach().abs().max()) for a, b in pairs)
            grad = max(float((a.grad - b.grad).abs().max()) for a, b in pairs)
            top = max(float(a.grad.abs().max()) for a, _ in pairs)
        finally:
            dp.close()
    return {"ranks": ranks, "threads_per_rank": threads, "max_param_diff": diff,
            "max_grad_diff": grad, "max_grad": top, "step_s_1": statistics.median(one),
            f"step_s_{ranks}": statistics.median(many), "step_s_1_all": one,
            f"step_s_{ranks}_all": many,
            "speedup": statistics.median(one) / statistics.median(many)}


def compare_reference(policy: Any, batch: Sequence[Any], steps: int,
                      say: Callable[[str], None]) -> dict[str, Any]:
    """Seconds of the colocated reference and the step, as two passes (`base_logprobs`, then
    `train_step`) and as one (`train_step(reference=True)`), alternating so that drift on a
    noisy host hits both; medians over `steps` each after a warm-up of each. The policy takes
    2 x (steps + 1) more updates (the benchmark's batch; its numbers do not depend on them)."""
    pairs = [(s.prompt_ids, s.completion_ids) for s in batch]

    def two() -> float:
        t0 = time.perf_counter()
        ref = policy.base_logprobs(pairs)
        policy.train_step([replace(s, ref_logprobs=r) for s, r in zip(batch, ref)])
        return time.perf_counter() - t0

    def one() -> float:
        t0 = time.perf_counter()
        policy.train_step(batch, reference=True)
        return time.perf_counter() - t0

    two(), one()  # warm-up
    a, b = [], []
    for k in range(steps):
        a.append(two())
        b.append(one())
        say(f"[train-step] reference {k + 1}/{steps}: two passes {a[-1]:.2f} s, "
            f"one {b[-1]:.2f} s")
    return {"split_layer": policy.split, "two_passes_s": statistics.median(a),
            "one_pass_s": statistics.median(b),
            "speedup": statistics.median(a) / statistics.median(b),
            "two_passes_s_all": a, "one_pass_s_all": b}


# ---- the machine ----------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# ---- the run --------------------------------------------------------------------------------


def synthetic_samples(policy: Any, n: int, prompt_tokens: int, completion_tokens: int,
                      seed: int = 0, group_size: int = 1) -> list[Any]:
    """`n` samples of the given shape: random ids in the vocabulary, each prompt repeated for
    `group_size` samples (GRPO's group), old (and reference) logprobs scored by the policy
    itself, so the importance ratio starts at 1, and random sequence advantages."""
    import torch

    from services.trainer.learner.batching import Sample

    g = torch.Generator().manual_seed(seed)
    vocab = policy.model.get_base_model().config.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_tokens,), generator=g).tolist()
               for _ in range(-(-n // group_size))]
    pairs = [(prompts[i // group_size],
              torch.randint(0, vocab, (completion_tokens,), generator=g).tolist())
             for i in range(n)]
    old = policy.logprobs(pairs)
    adv = torch.randn(n, generator=g).tolist()
    return [Sample(prompt_ids=p, completion_ids=c, old_logprobs=o, advantage=a, ref_logprobs=o)
            for (p, c), o, a in zip(pairs, old, adv)]


def run(model: str, dtype: str = "auto", samples: int = 16, prompt_tokens: int = 64,
        completion_tokens: int = 128, steps: int = 3, threads: int = 0, profile: bool = True,
        group_size: int = 1, micro_batch_tokens: int = 2048, top_layers: int | None = None,
        ranks: int = 1, colocated_reference: bool = False,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the policy, time `steps` train steps after one warm-up (median), benchmark the
    roofline, profile one more step; returns the JSON's fields. CPU only: the roofline is a
    CPU matmul benchmark, so the policy is pinned to the CPU even where CUDA is present.

    `group_size` > 1 repeats each prompt as GRPO does and times the same batch again with
    `share_prompts` off (A/B in one run). The FLOP model counts every row's whole prompt, so
    the roofline ratio is then taken from the unshared steps, and tokens/s from the shared.

    `ranks` > 1 also runs the step on that many data-parallel ranks (`compare_ranks`).

    `colocated_reference` also times the online recipe's colocated reference both ways on the
    same batch (`compare_reference`): `base_logprobs` then the step, against the step that
    scores the base itself, sharing the layers below the adapter (`top_layers`)."""
    import torch

    from hotloop.hardware import cpu_capability
    from hotloop.logprobs import plan_micro_batches
    from services.trainer.config import TrainerConfig
    from services.trainer.learner.policy import LoraPolicy

    # The demo's trainer (configs/demo.toml): LoRA r=16 on all linears, lr 1e-4, KL 0.04,
    # micro-batches of 2048 padded tokens (the default of --micro-batch-tokens); `top_layers`
    # adapts only the top N layers ([trainer.lora] top_layers).
    cfg = TrainerConfig(model=model, dtype=dtype, device="cpu", torch_threads=threads or None,
                        micro_batch_tokens=micro_batch_tokens,
                        lora={"r": 16, "alpha": 32, "top_layers": top_layers},
                        optimizer={"lr": 1e-4}, loss={"kl_beta": 0.04})
    load0 = os.getloadavg()[0]
    policy = LoraPolicy(cfg)  # resolves dtype "auto" and sets the threads before anything runs
    dtype, nthreads = policy.cfg.dtype, torch.get_num_threads()
    shape = ModelShape.from_hf_config(policy.model.get_base_model().config)
    say(f"[train-step] {model}: {shape.layers} layers x {shape.hidden} (LoRA on "
        f"{'all' if top_layers is None else f'the top {top_layers}'}), {dtype}, {nthreads} "
        f"threads; {samples} samples x ({prompt_tokens} prompt + {completion_tokens} completion)")
    batch = synthetic_samples(policy, samples, prompt_tokens, completion_tokens,
                              group_size=group_size)
    lengths = [(len(s.prompt_ids), len(s.completion_ids)) for s in batch]
    flops = step_flops(shape, cfg.lora.r, lengths, top_layers)
    tokens = sum(p + c for p, c in lengths)
    completion = sum(c for _, c in lengths)
    groups = plan_micro_batches([p + c for p, c in lengths], cfg.micro_batch_tokens)
    rows = max(len(grp) * max(sum(lengths[i]) for i in grp) for grp in groups)

    def timed(label: str) -> tuple[Any, list[float], Any, Any]:
        say(f"[train-step] warm-up step{label}...")
        warm = policy.train_step(batch)
        say(f"[train-step]   {warm.seconds:.2f} s ({warm.micro_batches} micro-batches)")
        secs = []
        mark, ru = cpu_mark(), resource.getrusage(resource.RUSAGE_SELF)
        for k in range(steps):
            t0 = time.perf_counter()
            policy.train_step(batch)
            secs.append(time.perf_counter() - t0)
            say(f"[train-step] step {k + 1}/{steps}{label}: {secs[-1]:.2f} s")
        return warm, secs, mark, ru

    shared_ab = None
    if group_size > 1:
        warm, secs, mark0, ru0 = timed(f" (shared prompts, groups of {group_size})")
        mark1, ru1 = cpu_mark(), resource.getrusage(resource.RUSAGE_SELF)
        shared_s = statistics.median(secs)
        shipped = policy.cfg
        policy.cfg = shipped.model_copy(update={"share_prompts": False})
        _, plain, _, _ = timed(" (every row runs its prompt)")
        policy.cfg = shipped
        shared_ab = {"step_s": shared_s, "step_s_unshared": statistics.median(plain),
                     "speedup": statistics.median(plain) / shared_s,
                     "step_s_all": secs, "step_s_unshared_all": plain}
        step_s = statistics.median(plain)  # the FLOP model's step: every row runs its prompt
    else:
        warm, secs, mark0, ru0 = timed("")
        mark1, ru1 = cpu_mark(), resource.getrusage(resource.RUSAGE_SELF)
        step_s = statistics.median(secs)

    # The process's peak through the timed steps (ru_maxrss is in KiB on Linux), before the
    # roofline's large matrices and the profiler: what the step's budget costs in memory.
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    say(f"[train-step] matmul roofline ({dtype}, M={rows}, head chunk "
        f"{min(cfg.logprob_chunk_tokens, completion)})...")
    roof = matmul_roofline(shape, rows, tokens, min(cfg.logprob_chunk_tokens, completion),
                           completion, dtype, top_layers)
    mark2 = cpu_mark()
    say(f"[train-step]   {roof['gflops']:.1f} GFLOP/s")
    prof = None
    if profile:
        # The profiler's records grow with the step: a 64-sample step (the demo's batch) took
        # this 24 GiB host out of memory. A slice of whole groups shows the same op mix.
        part = batch[:PROFILE_MAX_SAMPLES]
        say(f"[train-step] profiled step ({len(part)} of {len(batch)} samples)...")
        prof = profile_step(policy, part, cfg.lora.r)
    reference = None
    if colocated_reference:
        say("[train-step] the colocated reference: base_logprobs, then the step, against the "
            f"step that scores it {'from a shared trunk' if policy.split else '(no trunk: all layers adapted)'}...")
        reference = compare_reference(policy, batch, steps, say)
    data_parallel = None
    if ranks > 1:
        say(f"[train-step] the same step on 1 and on {ranks} data-parallel ranks...")
        data_parallel = compare_ranks(policy, batch, ranks, steps, say)
    step_gflops = flops["total"] / step_s / 1e9
    others = max(other_cores(mark0, mark1), other_cores(mark1, mark2))
    busy = others > 0.25
    if busy:
        say(f"[train-step] WARNING: other processes used {others:.2f} cores meanwhile; "
            "the numbers are low")
    shipped_s = shared_ab["step_s"] if shared_ab else step_s  # the default: prompts shared
    return {
        "tokens_per_s": tokens / shipped_s,
        "tokens_counted": "prompt + completion (real tokens, no padding)",
        "completion_tokens_per_s": completion / shipped_s,
        "roofline_ratio": step_gflops / roof["gflops"],
        "step_s": shipped_s,
        "step_s_all": secs,
        "group_size": group_size,
        "shared_prompts": shared_ab,
        "step_gflop": flops["total"] / 1e9,
        "step_gflop_by_part": {k: v / 1e9 for k, v in flops.items() if k != "total"},
        "step_gflops": step_gflops,
        "matmul_gflops": roof["gflops"],
        "matmul_shapes": roof["shapes"],
        "matmul_only_s": flops["total"] / 1e9 / roof["gflops"],
        "dtype": dtype,
        "cpu": str(cpu_capability()),
        "cpu_model": _cpu_model(),
        "threads": nthreads,
        "model": model,
        "shape": asdict(shape),
        "samples": samples,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "micro_batches": warm.micro_batches,
        # Fresh pages the allocator faults in per step (glibc returns large freed blocks to
        # the OS), and the kernel time they and other syscalls cost.
        "page_faults_per_step": (ru1.ru_minflt - ru0.ru_minflt) / steps,
        "sys_s_per_step": (ru1.ru_stime - ru0.ru_stime) / steps,
        "warmup_s": warm.seconds,
        "micro_batch_tokens": cfg.micro_batch_tokens,
        "peak_rss_gib": peak_rss_gib,
        "lora_r": cfg.lora.r,
        "top_layers": top_layers,
        "profile": prof,
        "data_parallel": data_parallel,
        "colocated_reference": reference,
        "other_cores": others,
        "busy": busy,
        "loadavg_1m": [load0, os.getloadavg()[0]],
    }


def table(r: dict[str, Any]) -> str:
    rows = [
        ("tokens/s (prompt+completion)", f"{r['tokens_per_s']:.0f}"),
        ("step", f"{r['step_s']:.2f} s ({r['micro_batches']} micro-batches of at most "
         f"{r['micro_batch_tokens']} tokens; peak RSS {r['peak_rss_gib']:.1f} GiB)"),
        *([("shared prompts", f"{r['shared_prompts']['speedup']:.2f}x faster than every row "
            f"running its prompt ({r['shared_prompts']['step_s_unshared']:.2f} s; groups of "
            f"{r['group_size']}; roofline below from those steps)")] if r.get("shared_prompts")
          else []),
        ("step FLOPs", f"{r['step_gflop']:.0f} GFLOP ("
         + ", ".join(f"{k} {v:.0f}" for k, v in r["step_gflop_by_part"].items()) + ")"),
        ("achieved", f"{r['step_gflops']:.1f} GFLOP/s"),
        ("matmul roofline", f"{r['matmul_gflops']:.1f} GFLOP/s ({r['dtype']}, "
         f"{r['threads']} threads, {r['cpu']})"),
        ("roofline ratio", f"{r['roofline_ratio']:.2f} (matmul-only step: "
         f"{r['matmul_only_s']:.2f} s)"),
    ]
    if r.get("profile"):
        rows.append(("profile (self time)", ", ".join(
            f"{k} {v:.0%}" for k, v in r["profile"]["shares"].items() if v >= 0.005)))
    if ref := r.get("colocated_reference"):
        rows.append(("colocated reference", f"{ref['speedup']:.2f}x faster in the step "
                     f"({ref['one_pass_s']:.2f} s, trunk below layer {ref['split_layer']}) than "
                     f"base_logprobs then the step ({ref['two_passes_s']:.2f} s)"))
    if dp := r.get("data_parallel"):
        n = dp["ranks"]
        rows.append((f"{n} data-parallel ranks", f"step {dp[f'step_s_{n}']:.2f} s vs "
                     f"{dp['step_s_1']:.2f} s on 1 rank ({dp['threads_per_rank']} threads "
                     f"each); max param diff {dp['max_param_diff']:.2g}, max grad diff "
                     f"{dp['max_grad_diff']:.2g} (of {dp['max_grad']:.2g})"))
    if r["busy"]:
        rows.append(("WARNING", f"other processes used {r['other_cores']:.2f} cores"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(args: Any) -> int:
    from hotloop import models

    result = run(str(models.resolve(args.model)), dtype=args.dtype, samples=args.samples,
                 prompt_tokens=args.prompt_tokens, completion_tokens=args.completion_tokens,
                 steps=args.steps, threads=args.threads, group_size=args.group_size,
                 micro_batch_tokens=args.micro_batch_tokens, top_layers=args.top_layers,
                 ranks=args.ranks, colocated_reference=args.colocated_reference)
    result["model"] = args.model
    report(result, args.json, table=table(result))
    return 0
