"""`hotloop bench online-step`: what one online update costs the trainer, per rated answer, on
each device of this host, in the same run.

Owns the measurement behind the many-tenant loop's bound: on 2 CPU cores the loop under
load is a queue at the trainer, whose one core spends about a second per rated answer
(docs/results.md, "Many tenants (`make demo-tenants`)"; "GPU check" has this benchmark's
figures). An online update is the recipe's `train_step` on the batch of ratings it took (the
colocated reference in it when `kl_beta` > 0), then `save_adapter` of the version it
publishes; this times exactly those two calls of a `LoraPolicy` built from the config's
`[trainer]` section, on synthetic ratings of the given shape, for each batch size and
device. Does not own the update (policy.py, recipes/online.py),
the push (timed by `bench update-loop`) or any default it measures.

Per device and batch size: the median over `--updates` timed updates (after one warm-up) of
`train_ms` and `pack_ms`, their sum `update_ms`, `rating_ms` = update_ms / batch, and
`ratings_per_s` = batch / update_s, the rate of ratings one trainer keeps up with at that
batch size. With both devices measured, `speedup` = cpu update_ms / cuda update_ms per batch.

`--shape` trains a random-weight Llama of a named shape (`hotloop.models.MODEL_SHAPES`) in
place of the config's model (no download: a step's time does not depend on the weights'
values), so a host with no network and no model still measures the update of the model it
would train.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import report, say_as

__all__ = ["main", "run"]

say = say_as("online-step")


def measure(trainer_cfg: Any, is_cap: float, model_dir: Path, device: str, batches: list[int],
            prompt_tokens: int, completion_tokens: int, updates: int, work: Path) -> list[dict]:
    """One policy on `device`; for each batch size one warm-up update, then `updates` timed."""
    import torch

    from benchmarks.train_step import synthetic_samples
    from services.trainer.learner.algorithms import make_online_algorithm
    from services.trainer.learner.policy import LoraPolicy

    # the config's dtype ("auto" in the shipped ones: bf16 on CUDA and AMX CPUs, else fp32)
    policy = LoraPolicy(trainer_cfg.model_copy(update={"device": device}), model_dir)
    # the online recipe's objective (recipes/online.py sets it per update the same way)
    policy.algorithm = make_online_algorithm(policy.cfg, is_cap=is_cap,
                                             kl_beta=policy.cfg.loss.kl_beta)
    reference = policy.cfg.loss.kl_beta > 0  # the recipe's colocated reference
    sync = torch.cuda.synchronize if policy.cfg.device == "cuda" else (lambda: None)
    rows = []
    for n in batches:
        samples = synthetic_samples(policy, n, prompt_tokens, completion_tokens, seed=n)
        train, pack = [], []
        for k in range(updates + 1):
            sync()
            t0 = time.perf_counter()
            m = policy.train_step(samples, reference=reference)
            sync()
            t1 = time.perf_counter()
            policy.save_adapter(work / f"{device}-b{n}-v{k}")
            t2 = time.perf_counter()
            shutil.rmtree(work / f"{device}-b{n}-v{k}")
            if m.skipped:
                raise RuntimeError(f"update skipped on {device}: {m.skip_reason}")
            if k:  # the first is the warm-up (kernels, allocator, caches)
                train.append((t1 - t0) * 1e3)
                pack.append((t2 - t1) * 1e3)
        update_ms = statistics.median([a + b for a, b in zip(train, pack)])
        row = {"device": policy.cfg.device, "dtype": policy.cfg.dtype,
               "threads": torch.get_num_threads(), "batch": n,
               "train_ms": statistics.median(train), "pack_ms": statistics.median(pack),
               "update_ms": update_ms,
               "rating_ms": update_ms / n, "ratings_per_s": n / (update_ms / 1e3),
               "update_ms_all": [round(a + b, 2) for a, b in zip(train, pack)]}
        say(f"{row['device']} {row['dtype']} batch {n}: update {update_ms:.1f} ms "
            f"(train {row['train_ms']:.1f} + pack {row['pack_ms']:.1f}), "
            f"{row['rating_ms']:.1f} ms a rating, {row['ratings_per_s']:.1f} ratings/s")
        rows.append(row)
    del policy
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(config: str | None, devices: list[str], batches: list[int], prompt_tokens: int = 48,
        completion_tokens: int = 96, updates: int = 5, shape: str | None = None,
        cpu_threads: int | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    import torch

    from launch import sections
    from hotloop.models import build_shaped_model, resolve

    if not batches or any(b < 1 for b in batches) or updates < 1:
        raise ValueError("batch sizes and --updates must be at least 1")
    unknown = set(devices) - {"cpu", "cuda"}
    if unknown:
        raise ValueError(f"unknown devices {sorted(unknown)}; known: cpu, cuda")
    if "cuda" in devices and not torch.cuda.is_available():
        raise ValueError("--devices names cuda but this host has no CUDA device")
    loaded = sections.load(config, overrides)
    tc, job = loaded["trainer"], loaded["online"]
    if cpu_threads is not None:
        tc = tc.model_copy(update={"torch_threads": cpu_threads})
    with tempfile.TemporaryDirectory(prefix="hotloop-online-step-") as tmp:
        work = Path(tmp)
        model_dir = build_shaped_model(work, shape) if shape else resolve(tc.model)
        say(f"{shape + ' (random weights)' if shape else tc.model}: LoRA r={tc.lora.r} on "
            f"{'every layer' if tc.lora.top_layers is None else f'the top {tc.lora.top_layers} layers'}, "
            f"kl_beta {tc.loss.kl_beta:g}; ratings of {prompt_tokens} prompt + "
            f"{completion_tokens} answer tokens; batches {batches} on {devices}")
        rows = []
        for device in devices:
            rows += measure(tc, job.is_cap, model_dir, device, batches, prompt_tokens, completion_tokens,
                            updates, work)
    by = {(r["device"], r["batch"]): r for r in rows}
    speedup = {str(b): by[("cpu", b)]["update_ms"] / by[("cuda", b)]["update_ms"]
               for b in batches if ("cpu", b) in by and ("cuda", b) in by}
    return {"model": shape or tc.model, "random_weights": bool(shape),
            "lora": {"r": tc.lora.r, "top_layers": tc.lora.top_layers},
            "kl_beta": tc.loss.kl_beta, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "updates": updates,
            "cuda_device": torch.cuda.get_device_name(0) if "cuda" in devices else None,
            "runs": rows, "speedup": speedup}


def table(result: dict[str, Any]) -> str:
    lines = ["| device | dtype | threads | batch | update ms | train ms | pack ms | ms a rating | ratings/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['device']} | {r['dtype']} | {r['threads']} | {r['batch']} | "
                     f"{r['update_ms']:.1f} | {r['train_ms']:.1f} | {r['pack_ms']:.1f} | "
                     f"{r['rating_ms']:.1f} | {r['ratings_per_s']:.1f} |")
    if result["speedup"]:
        lines.append("\ncuda against cpu (update ms, same run): " + ", ".join(
            f"batch {b}: {s:.1f}x" for b, s in result["speedup"].items()))
    return "\n".join(lines)


def main(args) -> int:
    import torch

    devices = [d.strip() for d in (args.devices or "").split(",") if d.strip()] or \
        (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
        result = run(args.config, devices, batches, args.prompt_tokens, args.completion_tokens,
                     args.updates, args.shape, args.cpu_threads, args.set)
    except ValueError as e:
        print(f"hotloop bench online-step: {e}", flush=True)
        return 2
    report(result, args.json, table=table(result), markdown=True, say=say)
    return 0
