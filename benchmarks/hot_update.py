"""`hotloop bench hot-update`: push-to-first-token latency of new versions while users'
requests are in flight, per swap of the update mode, on a real gRPC server.

Owns the hot-update benchmark: an engine (`RolloutCore`) behind the rollout's own server,
streaming users, a push of a fresh adapter at a time, and a probe until the new version's
first token reaches anyone; the swap's stages as the replica measured them; tokens/s before
and after the updates. Does not own the swap (services/rollout) or the adapters it pushes
(`benchmarks.rollout.make_bench_adapter`).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import report
from benchmarks.rollout import CODE_PROMPTS, make_bench_adapter


def _quantiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=20) if len(xs) >= 2 else xs * 19
    return {"p50": statistics.median(xs), "p95": q[18], "min": min(xs), "max": max(xs)}


async def _hot_update(args) -> dict:
    """Each swap of the update mode on its own engine (merged: drain and inflight, unless
    `--swap` picks one). The first one's figures are the top-level result; all are under
    `swaps`."""
    from services.rollout.config import RolloutConfig
    from services.rollout.core import resolve_mode

    mode = resolve_mode(RolloutConfig(update_mode=args.mode))
    chosen = getattr(args, "swap", None)
    swaps = [chosen] if chosen else (["inflight", "drain"] if mode == "merged" else [""])
    results = {}
    for swap in swaps:
        results[swap or mode] = await _hot_update_one(args, mode, swap)
    first = results[swaps[0] or mode]
    return {**first, "swaps": results} if len(results) > 1 else first


async def _hot_update_one(args, mode: str, swap: str) -> dict:
    """Push `pushes` versions through a real gRPC server while streaming clients keep requests
    in flight. Push-to-first-token: last chunk sent -> the first token, in any stream or in a
    probe request, that says it came from the new version (version_spans)."""
    import grpc

    from hotloop import adapters, models
    from hotloop.clients import RolloutClient
    from services.rollout.config import RolloutConfig
    from services.rollout.core import GenerateInput, PromptIn, RolloutCore, Sampling
    from services.rollout.server import serve

    model_dir = models.resolve(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="hotloop-hot-"))
    token = "bench"
    cfg = RolloutConfig(update_mode=mode, swap=swap or "auto", max_lora_rank=max(16, args.rank),
                        cpu_reserved_cpus=0)
    core = RolloutCore(cfg, model_dir, base_model=args.model, max_model_len=1024, storage_dir=tmp / "store")
    t0 = time.perf_counter()
    await core.start()
    label = f"{core.mode}{'/' + core.swap if core.swap else ''}"
    print(f"[{label}] engine ({core.dtype}) up in {time.perf_counter() - t0:.0f} s", flush=True)
    server, port, _ = await serve(core, "127.0.0.1:0", token)
    client = RolloutClient(f"127.0.0.1:{port}")
    archives = []
    for i in range(min(args.pushes, 4)):  # distinct adapters, reused round-robin
        d = make_bench_adapter(model_dir, tmp / f"a{i}", args.rank, seed=i)
        archives.append(adapters.pack(d))
    print(f"[{label}] adapter archive: {len(archives[0]) / 1e6:.1f} MB (r={args.rank}, all linear)",
          flush=True)

    async def tokens_per_s() -> float:
        # Same workload before and after the updates: 4 prompts x n=4 x 64 tokens.
        req = GenerateInput([PromptIn(messages=[{"role": "user", "content": p}]) for p in CODE_PROMPTS[:4]],
                            Sampling(n=4, max_tokens=64, temperature=1.0, ignore_eos=True))
        t = time.perf_counter()
        n = sum([len(c.token_ids) async for c in core.generate(req)])
        return n / (time.perf_counter() - t)

    await tokens_per_s()  # warm-up
    base_rate = statistics.median([await tokens_per_s() for _ in range(3)])
    print(f"[{label}] base {base_rate:.1f} tok/s", flush=True)

    stop = asyncio.Event()
    failed = {"n": 0, "errors": []}
    served = {"n": 0, "crossed": 0}
    first_seen: dict[int, float] = {}  # version -> when its first token reached a client

    def seen(spans: list[tuple[int, int]]) -> None:
        now = time.perf_counter()
        for version, _ in spans:
            first_seen.setdefault(version, now)

    async def user_traffic(seed: int) -> None:
        chat = [{"role": "user", "content": CODE_PROMPTS[seed % 8]}]
        while not stop.is_set():
            try:
                async for m in client.stream([chat], n=2, max_tokens=64):
                    seen(m.version_spans)
                    served["crossed"] += m.final and len(m.version_spans) > 1
                served["n"] += 1
            except grpc.aio.AioRpcError as e:
                failed["n"] += 1
                failed["errors"].append(e.details())

    users = [asyncio.create_task(user_traffic(i)) for i in range(3)]
    await asyncio.sleep(1.0)
    latencies, swaps = [], []
    try:
        for i in range(args.pushes):
            v = i + 1
            data = archives[i % len(archives)]
            sent = {}
            info = adapters.Version(v, adapters.sha256(data), len(data), args.model)
            push = asyncio.create_task(client.push_adapter(
                info, data, token, on_sent=lambda: sent.setdefault("t", time.perf_counter())))
            # Probe until the new version has produced a token somewhere: in a user's stream
            # (in flight across the swap, or admitted after it) or in the probe (max_tokens=1).
            while v not in first_seen:
                async for c in client.stream(None, texts=["def f(x):"], max_tokens=1, temperature=0):
                    seen(c.version_spans)
            latencies.append((first_seen[v] - sent["t"]) * 1e3)
            await push
            swap = dict(core.last_swap)
            # The replica runs in this process: its perf_counter marks time the two gaps
            # around its own stages (what was still on the wire when the client had sent it
            # all, and the engine step after the resume that samples the first token).
            if "t_last_byte" in swap:
                swap["receive_tail_ms"] = (swap["t_last_byte"] - sent["t"]) * 1e3
            if "t_live" in swap:
                swap["first_token_ms"] = (first_seen[v] - swap["t_live"]) * 1e3
            worker = swap.get("worker") or {}
            for k in ("read_s", "merge_s", "swap_s"):  # inside the pause, as the worker timed it
                if k in worker:
                    swap[f"worker_{k[:-2]}_ms"] = worker[k] * 1e3
            swaps.append(swap)
            print(f"[{label}] push {v}/{args.pushes}: first token of v{v} after "
                  f"{latencies[-1]:.0f} ms", flush=True)
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.gather(*users)
        after_rate = statistics.median([await tokens_per_s() for _ in range(3)])
        await client.close()
        await server.stop(0)
        await core.stop()

    def med(key: str) -> float | None:
        xs = [s[key] for s in swaps if key in s]
        return statistics.median(xs) if xs else None

    result = {
        "push_to_first_token_ms": _quantiles(latencies),
        "pushes": len(latencies), "failed_requests": failed["n"], "served_requests": served["n"],
        "mode": core.mode, "swap": core.swap, "rank": args.rank, "archive_bytes": len(archives[0]),
        "completions_across_a_swap": served["crossed"],
        # medians of the replica's stages, in the order they run: receive (header to last
        # byte; mostly before the client's last send), the part of it after that send,
        # verify (digest, tar, shapes, finite values), then in flight: pause (the engine step
        # in progress ends), prepare (the factored build and the swap, inside the pause),
        # commit (label and resume), first token (the next step, to the client), and the
        # merged build that replaces the factored one afterwards (finish). drain: prepare is
        # starting the background build, drain and commit (waits for it) follow.
        "swap_ms": {"receive": med("receive_ms"), "receive_tail": med("receive_tail_ms"),
                    "verify": med("verify_ms"), "drain": med("drain_ms"),
                    "pause": med("pause_ms"), "prepare": med("prepare_ms"),
                    "commit": med("commit_ms"), "first_token": med("first_token_ms"),
                    "finish": med("finish_ms")},
        # in flight: what the worker timed of `prepare` (read the archive, build, swap)
        "in_pause_ms": {"read": med("worker_read_ms"), "build": med("worker_merge_ms"),
                        "swap": med("worker_swap_ms")},
        "tokens_per_s": {"base": base_rate, "after_update": after_rate,
                         "after_vs_base": after_rate / base_rate},
        "dtype": core.dtype,
        "errors": failed["errors"][:5],
    }
    p = result["push_to_first_token_ms"]
    print(f"[{label}] push -> first token of the new version: p50 {p['p50']:.1f} ms, "
          f"p95 {p['p95']:.1f} ms over {len(latencies)} pushes; user requests served {served['n']}, "
          f"failed {failed['n']}; tokens/s after the updates {after_rate:.1f} vs base {base_rate:.1f} "
          f"({after_rate / base_rate:.2f}x)", flush=True)
    print(f"[{label}] stages, median ms: " + ", ".join(
        f"{k} {v:.1f}" for k, v in result["swap_ms"].items() if v is not None), flush=True)
    return result


def main(args) -> int:
    """`hotloop bench hot-update`."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    report(asyncio.run(_hot_update(args)), args.json)
    return 0
