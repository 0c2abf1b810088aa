"""Matmul FLOPs of a Llama-shaped model and a matmul roofline measured in the same run, for the
benchmarks that report a `roofline_ratio` (`bench train-step`, `bench rollout`).

Owns: the shape a FLOP count reads from an HF config (`ModelShape`), the FLOPs of generated
tokens (`decode_flops`), and `matmul_gflops`: the speed of a set of matmul shapes on this
machine, in a dtype, at the current torch thread count, as the FLOP-weighted harmonic mean
(the FLOPs divided by the time they take at the benchmarked speeds). A ratio against it says
how close a workload runs to the speed its FLOPs allow here; a shape the machine runs slowly
is part of what the ratio shows. Does not own a benchmark's own workload or FLOP model
(train_step.step_flops).

The decode FLOP model (`decode_flops`), for hidden H, intermediate I, nh query and nkv
key/value heads of size hd, `layers` layers and vocabulary V, per generated token that
attends over `keys` positions (its prompt and the tokens generated before it):

    linear    = 2 * (layers * P + H * V)     every linear of the body (P weights per layer:
                                             q, k, v, o, gate, up, down) and the output head
    attention = layers * 4 * nh * hd * keys  QK^T and PV against each key, 2 * hd FLOPs each
                                             per query head

Not counted: embeddings (lookups), norms, RoPE, activations, softmax, sampling, and the
prompt's prefill (work the engine does that no generated token is credited with: the ratio
is slightly low when prompts are long against what is generated).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP models read from an HF Llama-style config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_hf_config(cls, c: Any) -> ModelShape:
        heads = c.num_attention_heads
        return cls(
            hidden=c.hidden_size,
            intermediate=c.intermediate_size,
            layers=c.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            vocab=c.vocab_size,
        )

    @classmethod
    def from_model_dir(cls, model_dir: Any) -> ModelShape:
        """From `config.json` without importing transformers."""
        import json
        from pathlib import Path
        from types import SimpleNamespace

        return cls.from_hf_config(SimpleNamespace(**json.loads((Path(model_dir) / "config.json").read_text())))

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of each body linear of one layer: what `all-linear` LoRA adapts."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, \
            self.intermediate
        return [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h),
                ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]


def decode_flops(shape: ModelShape, samples: Iterable[tuple[int, int]]) -> dict[str, float]:
    """FLOPs of generating the tokens of `samples`, each (prompt tokens, generated tokens), by
    part (module docstring) and in total. Generated token i (from 0) of a sample with prompt p
    attends over p + i keys."""
    P = sum(i * o for _, i, o in shape.linears())
    per_token = 2 * (shape.layers * P + shape.hidden * shape.vocab)
    per_key = shape.layers * 4 * shape.heads * shape.head_dim
    out = {"linear": 0.0, "attention": 0.0}
    for p, g in samples:
        out["linear"] += per_token * g
        out["attention"] += per_key * (g * p + g * (g - 1) // 2)
    out["total"] = out["linear"] + out["attention"]
    return out


# ---- the roofline ---------------------------------------------------------------------------


def cpu_mark() -> tuple[float, float, float]:
    """(monotonic s, all CPUs' busy s, this process's CPU s) for `other_cores`."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal ...: busy = all but idle, iowait, steal
    busy = (sum(fields[:8]) - fields[3] - fields[4] - fields[7]) / tick
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.monotonic(), busy, ru.ru_utime + ru.ru_stime


def other_cores(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """Cores' worth of CPU that other processes used between two `cpu_mark`s: a roofline
    measured while they ran is low, and so is what it is compared with."""
    wall = b[0] - a[0]
    return max(0.0, (b[1] - a[1]) - (b[2] - a[2])) / wall if wall > 0 else 0.0


def timed(fn: Callable[[], Any], min_s: float = 0.25, max_reps: int = 50,
          sync: Callable[[], Any] | None = None) -> float:
    """Median seconds of `fn` after one warm-up call, repeated for about `min_s`. `sync`
    waits for the device (CUDA) before each clock read."""
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < 3 or (spent < min_s and len(times) < max_reps):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return statistics.median(times)


@dataclass
class MatmulCase:
    """One matmul shape (m, k, n) run by `fn`, weighted by the FLOPs the workload runs on it."""

    fn: Callable[[], Any]
    m: int
    k: int
    n: int
    flops: float
    what: str = ""


def linear_case(m: int, k: int, n: int, flops: float, dtype: str = "float32", device: str = "cpu",
                what: str = "", seed: int = 0) -> MatmulCase:
    """`F.linear` of [m, k] by a weight stored as nn.Linear stores it, [n, k]."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dt)
    w = torch.randn(n, k, generator=g).to(device=device, dtype=dt)
    return MatmulCase(lambda: F.linear(x, w), m, k, n, flops, what)


def matmul_gflops(cases: Sequence[MatmulCase], device: str = "cpu") -> dict[str, Any]:
    """Benchmark each case; returns the FLOP-weighted harmonic mean GFLOP/s and each shape's."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    results = []
    total_f = total_t = 0.0
    with torch.no_grad():
        for c in cases:
            s = timed(c.fn, sync=sync)
            rate = 2 * c.m * c.k * c.n / s
            results.append({"m": c.m, "k": c.k, "n": c.n, "gflops": rate / 1e9,
                            **({"what": c.what} if c.what else {})})
            total_f, total_t = total_f + c.flops, total_t + c.flops / rate
    return {"gflops": total_f / total_t / 1e9, "shapes": results}


def decode_roofline(shape: ModelShape, rows: int, dtype: str, device: str = "cpu") -> dict[str, Any]:
    """The roofline of decoding: every linear of the body and the head on `rows` sequences at
    once (one engine step of a batch), weighted by the FLOPs each carries per token."""
    work: dict[tuple[int, int], float] = {}
    for _, i, o in shape.linears():
        work[(i, o)] = work.get((i, o), 0.0) + 2.0 * i * o * shape.layers
    cases = [linear_case(rows, k, n, f, dtype, device) for (k, n), f in work.items()]
    cases.append(linear_case(rows, shape.hidden, shape.vocab, 2.0 * shape.hidden * shape.vocab,
                             dtype, device, what="head"))
    return matmul_gflops(cases, device)
