"""`hotloop bench tenants`: many tenants' adapters on one engine while users stream and every
tenant's lineage gets new versions, against one merged adapter in the same run.

Owns the tenants benchmark: one engine (`RolloutCore`) behind the rollout's own gRPC server
(port 0), `[rollout] tenant_slots` fixed by `--tenant-slots`, and for each tenant count
(`--tenant-counts`, in one run, each with tenants of its own):
- users: `--users` simulated users streaming chat requests round-robin over the tenants while
  each tenant gets a new version every `--push-every-s` (real pushes into its lineage,
  `AdapterHeader.tenant`); per request the time to first token and tokens/s after it, per push
  the loop: push start -> the first token a user of that tenant receives from that version
  (`Completion.tenant` and its version span);
- `wrong_adapter_answers`, never trusting the label alone: every answer's tenant and version
  against what its tenant had live between the request's send (pushes answered by then) and
  its first token (pushes started by then), and once per run a greedy probe per tenant, all at
  once beside the users, against the same version run alone (the outputs of a request served
  another adapter differ: the adapters are strong random ones, and the report says whether the
  tenants' probes differed from each other at all);
- `batch_tokens_per_s`: `bench rollout`'s workload with its samples spread evenly over the
  tenants' adapters (`benchmarks.rollout.workload_rate`);
- slot loads, evictions, waits, refusals and resident bytes from the slots' own counters
  (`SlotMetrics.stats()`, read in this process; the same numbers the rollout's /metrics serves).
`merged_tokens_per_s`: one merged adapter (the default lineage) on the same workload, same
engine, measured right before each tenant count's batch (a run's `batch_vs_merged` divides by
its own: on a shared machine the load of a minute earlier is another machine). Does not own the workload, its rate or the adapters (benchmarks/rollout.py), the slots
(services/rollout/tenants.py), or the report's tail (benchmarks/common.py). A shared machine
makes every figure noisy: compare the ratios of one run, not runs.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import report, say_as
from benchmarks.rollout import CODE_PROMPTS, _prompts, make_bench_adapters, workload_rate

RANK = 16
# peft's random B unscaled (the tests' tenant adapters): each adapter's greedy answers are its
# own, so an answer from another tenant's adapter shows in its tokens.
B_SCALE = 1.0
PROBE = [{"role": "user", "content": "Write a Python function `fib(n)`."}]
PROBE_TOKENS = 16
# A greedy pick this close to the runner-up may flip with the batch's shape (the sums'
# order differs): a probe that parts from its reference there is a tie, not a wrong adapter.
TIE_LOGPROB = 0.02
TOKEN = "bench"
AIMS = {"ttft_p99_vs_1_tenant": ("<=", 1.5), "batch_vs_merged": (">=", 0.6)}

say = say_as("tenants")


def percentile(xs: list[float], p: float) -> float | None:
    """The p-th percentile, linear between the closest ranks; None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def parse_counts(text: str) -> list[int]:
    """`--tenant-counts`: comma-separated positive integers, e.g. `1,4,16`."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--tenant-counts {text!r}: give comma-separated integers, e.g. 1,4,16") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--tenant-counts {text!r}: every count must be 1 or more")
    return counts


def check_args(args) -> list[str]:
    """What is wrong with the options (empty: nothing)."""
    bad = []
    for name in ("users", "tenant_slots", "max_tokens", "prompts", "n", "batch_max_tokens",
                 "repeats"):
        if getattr(args, name) < 1:
            bad.append(f"--{name.replace('_', '-')} must be 1 or more")
    for name in ("duration_s", "push_every_s", "slot_wait_s"):
        if not getattr(args, name) > 0:
            bad.append(f"--{name.replace('_', '-')} must be above 0")
    if args.duration_s < 2 * args.push_every_s:
        bad.append("--duration-s must be at least twice --push-every-s (a round of new versions "
                   "starts every --push-every-s from the first)")
    return bad


def probe_verdict(mixed, alone) -> str:
    """A greedy probe run beside other tenants (`mixed`) against the same tenant version run
    alone: "same", "tie" (they part where the greedy pick was a near tie), or "wrong"."""
    a, b = list(mixed.token_ids), list(alone.token_ids)
    if a == b:
        return "same"
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i >= min(len(a), len(b)):
        return "wrong"  # one stopped early where the other did not
    top = {tid: lp for tid, lp, _ in mixed.top_logprobs[i]} if i < len(mixed.top_logprobs) else {}
    if a[i] in top and b[i] in top and abs(top[a[i]] - top[b[i]]) <= TIE_LOGPROB:
        return "tie"
    return "wrong"


class Users:
    """Users streaming round-robin over `tenants` and a pusher giving each tenant a new version
    every `push_every_s`; what they saw, and every answer checked against what was live."""

    def __init__(self, client, tenants: list[str], archives: list[tuple[bytes, str]],
                 model: str, max_tokens: int):
        self.client, self.tenants, self.archives = client, tenants, archives
        self.model, self.max_tokens = model, max_tokens
        self.version = {t: 0 for t in tenants}  # the newest version pushed (or being pushed)
        self.answered = {t: 0 for t in tenants}  # the newest version whose push was answered
        self.starts: dict[str, list[tuple[int, float]]] = {t: [] for t in tenants}
        self.pushes: list[tuple[str, int, float]] = []  # in the measured phase
        self.first_seen: dict[tuple[str, int], float] = {}
        self.requests: list[dict] = []
        self.failed: Counter = Counter()
        self.wrong: list[str] = []
        self.stop = asyncio.Event()
        self._next = itertools.count()

    async def push(self, i: int) -> float:
        """Push tenant i's next version; returns when the push started."""
        from hotloop.adapters import Version

        t = self.tenants[i]
        v = self.version[t] = self.version[t] + 1
        # tenant i's version v: adapter (i + v) mod a pool larger than the tenants, so tenants
        # on the same version number never share content
        data, sha = self.archives[(i + v) % len(self.archives)]
        t0 = time.perf_counter()
        self.starts[t].append((v, t0))
        await self.client.push_adapter(Version(v, sha, len(data), self.model), data, TOKEN,
                                       tenant=t)
        self.answered[t] = v
        return t0

    async def user(self) -> None:
        import grpc

        while not self.stop.is_set():
            j = next(self._next)
            t = self.tenants[j % len(self.tenants)]
            chat = [{"role": "user", "content": CODE_PROMPTS[j % len(CODE_PROMPTS)]}]
            lo, sent = self.answered[t], time.perf_counter()
            first, tokens, labels = None, 0, set()
            try:
                async for m in self.client.stream([chat], max_tokens=self.max_tokens, tenant=t):
                    now = time.perf_counter()
                    labels.add((m.tenant, m.policy_version, tuple(m.version_spans)))
                    if first is None and m.token_ids:
                        first = now
                        self.first_seen.setdefault((m.tenant, m.policy_version), now)
                    tokens += len(m.token_ids)
            except grpc.aio.AioRpcError as e:
                self.failed[e.code().name] += 1
                continue
            end = time.perf_counter()
            if first is None:
                self.failed["no_tokens"] += 1
                continue
            hi = max(v for v, t0 in self.starts[t] if t0 <= first)
            (tenant, v, spans), *more = sorted(labels)
            if more or tenant != t or spans != ((v, 0),) or not lo <= v <= hi:
                self.wrong.append(f"request to {t} (live v{lo}..v{hi}) answered as "
                                  f"{sorted(labels)}")
            self.requests.append({"tenant": t, "version": v, "ttft_s": first - sent,
                                  "tokens": tokens, "decode_s": end - first})

    async def pusher(self, duration_s: float, every_s: float) -> None:
        """Tenant i's r-th new version at r * every_s + i * every_s / k from now (staggered),
        in whole rounds (every tenant ends on the same version number) that end within
        `duration_s`."""
        t0, k = time.perf_counter(), len(self.tenants)
        for r in itertools.count(1):
            if (r + 1) * every_s > duration_s * (1 + 1e-9):
                return
            for i, t in enumerate(self.tenants):
                at = t0 + r * every_s + i * every_s / k
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                started = await self.push(i)
                self.pushes.append((t, self.version[t], started))

    def all_latest_seen(self) -> bool:
        return all((t, v) in self.first_seen for t, v in self.version.items())

    async def probe(self, t: str):
        """tenant t's latest version, greedy, with the runner-up's logprob at each token."""
        (c,) = await self.client.generate([PROBE], n=1, max_tokens=PROBE_TOKENS, temperature=0,
                                          tenant=t, pin_version=self.version[t], top_logprobs=2,
                                          return_prompt_ids=False)
        if c.tenant != t or c.policy_version != self.version[t]:
            self.wrong.append(f"probe of {t} v{self.version[t]} answered as {c.tenant} "
                              f"v{c.policy_version}")
        return c


async def _run(core, client, k: int, archives, args) -> dict:
    """One tenant count: v1 for each tenant, users and pushes for `duration_s` (then until each
    tenant's latest version reached a user, bounded), probes beside the users and alone, and the
    batch workload over the tenants."""
    tenants = [f"k{k}-{i}" for i in range(k)]
    before = core.updater.slots.stats()
    t_run = time.perf_counter()
    u = Users(client, tenants, archives, args.model, args.max_tokens)
    for i in range(k):
        await u.push(i)
    say(f"{k} tenant(s): {args.users} users for {args.duration_s:g} s, a new version per "
        f"tenant every {args.push_every_s:g} s")
    users = [asyncio.create_task(u.user()) for _ in range(args.users)]
    try:
        pusher = asyncio.create_task(u.pusher(args.duration_s, args.push_every_s))
        t0 = time.perf_counter()
        while not pusher.done() or time.perf_counter() < t0 + args.duration_s:
            if pusher.done():  # the last round ended: the users go on until duration_s
                await asyncio.sleep(min(10.0, t0 + args.duration_s - time.perf_counter()))
            else:
                await asyncio.wait([pusher], timeout=10.0)
            say(f"  {k} tenant(s): {time.perf_counter() - t0:.0f} s, {len(u.requests)} answers, "
                f"{len(u.pushes)} pushes, {sum(u.failed.values())} failed")
        pusher.result()
        # the last versions' loops: until a user of each tenant got its latest (bounded)
        tail = time.perf_counter() + max(10.0, 2 * args.push_every_s)
        while not u.all_latest_seen() and time.perf_counter() < tail:
            await asyncio.sleep(0.1)
        mixed = await asyncio.gather(*(u.probe(t) for t in tenants))  # beside the users
    finally:
        u.stop.set()
        ended = await asyncio.gather(*users, return_exceptions=True)
    crashed = [e for e in ended if isinstance(e, Exception)]
    if crashed:
        raise crashed[0]  # a user's error that is not a refused call (those are counted)
    users_s = time.perf_counter() - t0
    alone = [await u.probe(t) for t in tenants]
    verdicts = Counter(probe_verdict(m, a) for m, a in zip(mixed, alone))
    distinct = len({tuple(a.token_ids) for a in alone})
    say(f"  {k} tenant(s): users done ({len(u.requests)} answers, {len(u.wrong)} wrong); "
        f"probes {dict(verdicts)}; batch workload, one merged adapter then the tenants'...")
    prompts = _prompts(args.prompts)
    merged = statistics.median([await workload_rate(core, prompts, args.n, args.batch_max_tokens)
                                for _ in range(args.repeats)])
    await workload_rate(core, prompts, args.n, 8, tenants)  # warm: loads the slots
    batch = statistics.median([await workload_rate(core, prompts, args.n, args.batch_max_tokens,
                                                   tenants)
                               for _ in range(args.repeats)])
    after = core.updater.slots.stats()
    loads = after["loads"] - before["loads"]
    load_s = after["load_s"][-loads:] if loads else []
    loops = [(u.first_seen[t, v] - ts) * 1e3 for t, v, ts in u.pushes if (t, v) in u.first_seen]
    ttft = [r["ttft_s"] * 1e3 for r in u.requests]
    rates = [(r["tokens"] - 1) / r["decode_s"] for r in u.requests
             if r["tokens"] > 1 and r["decode_s"] > 0]
    wrong = len(u.wrong) + verdicts["wrong"]
    run = {
        "tenants": k,
        "user_ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "user_tokens_per_s": statistics.median(rates) if rates else None,
        "loop_ms": {"p50": percentile(loops, 50), "p95": percentile(loops, 95)},
        "adapter_load_ms": {"p50": percentile([x * 1e3 for x in load_s], 50)},
        "evictions": after["evictions"] - before["evictions"],
        "wrong_adapter_answers": wrong,
        "batch_tokens_per_s": batch,
        "merged_tokens_per_s": merged,
        "batch_vs_merged": batch / merged,
        "resident_adapter_mib": after["resident_bytes"] / 2**20,
        # the detail behind them
        "user_requests": len(u.requests),
        "failed_requests": dict(u.failed),
        "pushes": len(u.pushes),
        "loops_seen": len(loops),  # a version replaced before any user of its tenant came
        "adapter_loads": loads,
        "slot_waits": after["waits"] - before["waits"],
        "slot_refusals": after["refusals"] - before["refusals"],
        "probes": dict(verdicts),
        "probe_answers_distinct": distinct,  # of k: below k, a swap of those two would not show
        "wrong_examples": u.wrong[:5],
        "users_phase_s": users_s,
        "seconds": time.perf_counter() - t_run,
    }
    say(f"  {k} tenant(s): TTFT p50 {_ms(run['user_ttft_ms']['p50'])} p99 "
        f"{_ms(run['user_ttft_ms']['p99'])}, loop p50 {_ms(run['loop_ms']['p50'])}, "
        f"{loads} loads, {run['evictions']} evictions, batch {batch:.0f} tok/s against merged "
        f"{merged:.0f}")
    return run


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} ms"


async def _bench(args) -> dict:
    from hotloop import adapters, models
    from hotloop.clients import RolloutClient
    from hotloop.hardware import cpu_capability
    from services.rollout.config import RolloutConfig
    from services.rollout.core import RolloutCore
    from services.rollout.server import serve

    counts = parse_counts(args.tenant_counts)
    model_dir = models.resolve(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="hotloop-tenants-"))
    prompts = _prompts(args.prompts)
    cfg = RolloutConfig(max_lora_rank=RANK, cpu_reserved_cpus=0, tenant_slots=args.tenant_slots,
                        tenant_slot_wait_s=args.slot_wait_s, max_n=max(64, args.n),
                        max_new_tokens=max(args.max_tokens, args.batch_max_tokens, PROBE_TOKENS))
    core = RolloutCore(cfg, model_dir, base_model=args.model, max_model_len=1024,
                       storage_dir=tmp / "store")
    # a pool of distinct adapters larger than the most tenants, and one for the merged run
    pool = max(counts) + 1
    dirs = [tmp / f"adapter-{i}" for i in range(pool + 1)]
    t_start = time.perf_counter()
    say(f"making {len(dirs)} random r={RANK} adapters while the engine starts...")
    made = asyncio.create_task(asyncio.to_thread(
        make_bench_adapters, model_dir, dirs, RANK, list(range(len(dirs))), B_SCALE))
    try:
        await core.start()
        await made
    except BaseException:
        made.cancel()
        await core.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    archives = [(data, adapters.sha256(data)) for data in map(adapters.pack, dirs)]
    say(f"engine ({core.mode}, {core.dtype}) and adapters ready in "
        f"{time.perf_counter() - t_start:.0f} s; archive {len(archives[0][0]) / 1e6:.1f} MB")
    server, port, _ = await serve(core, "127.0.0.1:0", TOKEN)
    client = RolloutClient(f"127.0.0.1:{port}")
    try:
        # the default lineage: one merged adapter live throughout, as beside real tenants
        data, sha = archives[pool]
        await client.push_adapter(adapters.Version(1, sha, len(data), args.model), data, TOKEN)
        await workload_rate(core, prompts, args.n, 8)  # warm-up
        runs = [await _run(core, client, k, archives[:pool], args) for k in counts]
    finally:
        await client.close()
        await server.stop(0)
        await core.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    one = next((r for r in runs if r["tenants"] == 1), None)
    for r in runs:
        p99, base = r["user_ttft_ms"]["p99"], one and one["user_ttft_ms"]["p99"]
        r["ttft_p99_vs_1_tenant"] = p99 / base if p99 is not None and base else None
    import vllm

    return {
        "runs": runs,
        "merged_tokens_per_s": statistics.median([r["merged_tokens_per_s"] for r in runs]),
        "aims": {k: f"{op} {v}" for k, (op, v) in AIMS.items()},
        "config": {"model": args.model, "tenant_counts": counts, "tenant_slots": args.tenant_slots,
                   "tenant_slot_wait_s": args.slot_wait_s, "users": args.users,
                   "duration_s": args.duration_s, "push_every_s": args.push_every_s,
                   "user_max_tokens": args.max_tokens, "rank": RANK,
                   "workload": {"prompts": len(prompts), "n": args.n,
                                "max_tokens": args.batch_max_tokens, "repeats": args.repeats},
                   "update_mode": core.mode, "swap": core.swap},
        "machine": {"cpu": str(cpu_capability()), "cores": len(os.sched_getaffinity(0)),
                    "dtype": core.dtype, "engine": f"vllm {vllm.__version__}",
                    "load_avg": os.getloadavg()},
        "note": "a shared machine: figures are noisy; compare the ratios of one run",
        "seconds": time.perf_counter() - t_start,
    }


def table(r: dict) -> str:
    """One row per tenant count, then the ratios the issue asks for against their aims."""
    cols = ["tenants", "TTFT p50", "TTFT p99", "p99/1t", "user tok/s", "loop p50", "loop p95",
            "load p50", "evict", "wrong", "batch tok/s", "batch/merged", "resident MiB"]

    def f(x, fmt="{:.0f}"):
        return "-" if x is None else fmt.format(x)

    rows = [[str(x["tenants"]), f(x["user_ttft_ms"]["p50"]), f(x["user_ttft_ms"]["p99"]),
             f(x["ttft_p99_vs_1_tenant"], "{:.2f}x"), f(x["user_tokens_per_s"], "{:.1f}"),
             f(x["loop_ms"]["p50"]), f(x["loop_ms"]["p95"]), f(x["adapter_load_ms"]["p50"], "{:.1f}"),
             str(x["evictions"]), str(x["wrong_adapter_answers"]), f(x["batch_tokens_per_s"]),
             f(x["batch_vs_merged"], "{:.2f}x"), f(x["resident_adapter_mib"], "{:.1f}")]
            for x in r["runs"]]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths)),
             *("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows)]
    c = r["config"]
    lines.append(f"(ms unless marked; {c['users']} users, {c['tenant_slots']} slots, a version per "
                 f"tenant every {c['push_every_s']:g} s; merged adapter "
                 f"{r['merged_tokens_per_s']:.0f} tok/s (median; each run's own beside its "
                 f"batch); {r['machine']['cpu']}, "
                 f"{r['machine']['cores']} cores, {r['machine']['dtype']})")
    four = next((x for x in r["runs"] if x["tenants"] == 4), None)
    if four is not None and four["ttft_p99_vs_1_tenant"] is not None:
        lines.append(f"4 tenants' TTFT p99 / 1 tenant's: {four['ttft_p99_vs_1_tenant']:.2f}x "
                     f"(aim {r['aims']['ttft_p99_vs_1_tenant']})")
    for x in r["runs"]:
        lines.append(f"{x['tenants']} tenant(s): batch / merged tokens/s "
                     f"{x['batch_vs_merged']:.2f}x (aim {r['aims']['batch_vs_merged']})")
    lines.append(f"note: {r['note']}")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    """TTFT p50/p99 and batch tokens/s (against the merged adapter) per tenant count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [str(x["tenants"]) for x in r["runs"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for q, off in (("p50", -0.2), ("p99", 0.2)):
        a.bar([i + off for i in range(len(ks))], [x["user_ttft_ms"][q] or 0 for x in r["runs"]],
              width=0.4, label=f"TTFT {q}")
    a.set_xticks(range(len(ks)), ks)
    a.set_xlabel("tenants")
    a.set_ylabel("ms")
    a.legend()
    b.bar([i - 0.2 for i in range(len(ks))], [x["merged_tokens_per_s"] for x in r["runs"]],
          width=0.4, label="one merged adapter")
    b.bar([i + 0.2 for i in range(len(ks))], [x["batch_tokens_per_s"] for x in r["runs"]],
          width=0.4, label="tenants' adapters")
    b.set_xticks(range(len(ks)), ks)
    b.set_xlabel("tenants")
    b.set_ylabel("batch tokens/s")
    b.legend()
    fig.suptitle(f"hotloop bench tenants ({r['config']['tenant_slots']} slots, "
                 f"{r['config']['users']} users)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args) -> int:
    """`hotloop bench tenants`."""
    try:
        parse_counts(args.tenant_counts)
    except ValueError as e:
        say(str(e))
        return 2
    bad = check_args(args)
    if bad:
        say("; ".join(bad))
        return 2
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    result = asyncio.run(_bench(args))
    report(result, args.json, table=table(result), say=say)
    if args.plot:
        plot(result, args.plot)
        say(f"wrote {args.plot}")
    return 1 if any(x["wrong_adapter_answers"] for x in result["runs"]) else 0
