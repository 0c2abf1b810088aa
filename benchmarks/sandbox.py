"""Sandbox throughput: scored samples per second through a pool, local or Ray.

`python -m benchmarks.sandbox [n] [local|ray|both]`. Each sample is a built-in task's
reference solution in a ```python block, scored by `code_tests` (extraction, parse, sandbox
run with the default limits and the strongest isolation the host allows). The pool's start-up
(isolation probe; Ray start) is timed separately and not counted.
Does not own: any decision; it only measures.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time

from benchmarks.common import report


def bench_sandbox(n: int, backend: str, repeats: int = 3, concurrency: int | None = None) -> dict:
    """Median scored samples/s over `repeats` batches of `n` samples.

    `concurrency` defaults to the service's default. Runs spend most of their wall time
    waiting on the kernel (process start, namespace and cgroup set-up), so more runs than
    cores raise throughput until the CPUs are busy.
    """
    from hotloop.tasks.builtin import reference_tasks

    from services.reward.config import RewardConfig
    from services.reward.pool import make_pool
    from services.reward.scorers import CodeTestsScorer
    from services.reward.types import ScoreInput, task_spec_from_code_task

    concurrency = concurrency or RewardConfig().concurrency
    tasks = reference_tasks()
    items = [
        ScoreInput(str(i), t.prompt, f"```python\n{t.solution}```", task_spec_from_code_task(t))
        for i, t in ((i, tasks[i % len(tasks)]) for i in range(n))
    ]

    async def run() -> dict:
        start = time.perf_counter()
        pool = make_pool(RewardConfig(backend=backend, concurrency=concurrency))
        startup = time.perf_counter() - start
        try:
            scorer = CodeTestsScorer(pool)
            await scorer.score(items[: min(n, concurrency)])  # warm-up (first runs pay page faults)
            rates = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                outs = await scorer.score(items)
                elapsed = time.perf_counter() - t0
                bad = [o for o in outs if o.reward != 1.0]
                if bad:
                    raise RuntimeError(f"benchmark samples failed: {bad[:3]}")
                rates.append(n / elapsed)
        finally:
            await pool.close()
        return {
            "backend": backend, "n": n, "concurrency": concurrency,
            "isolation": pool.isolation.level, "fork_server": pool.isolation.fork_server,
            "startup_s": round(startup, 2),
            "samples_per_s": round(statistics.median(rates), 1),
            "samples_per_s_runs": [round(r, 1) for r in rates],
            "load_avg_1m": round(os.getloadavg()[0], 2),
        }

    return asyncio.run(run())


def main(args) -> int:
    """`hotloop bench sandbox`: local process pool and Ray actors, in one run."""
    report({"local": bench_sandbox(args.samples, "local"), "ray": bench_sandbox(args.samples, "ray")},
           args.json)
    return 0


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    which = sys.argv[2] if len(sys.argv) > 2 else "both"
    for backend in (["local", "ray"] if which == "both" else [which]):
        print(json.dumps(bench_sandbox(n, backend)))
