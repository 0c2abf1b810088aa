"""`hotloop demo-online` (`make demo-online`): the online loop measured end to end, from the
users' side. `hotloop bench update-loop` (benchmarks/update_loop.py) runs on the same stack.

Owns:
- the demo's phases: an idle phase (users only, no feedback: idle TTFT/ITL and the base rate
  of the hidden preference), then training (users rate answers, the trainer learns);
- the loop latency: from a feedback sent to the first token a user receives from a version
  trained on it (`measure.loop.LoopTracker` pairs them);
- what became of the feedback: arrived (accepted by the gateway), trained, dropped (the
  trainer's `settled` records: shed, stale, dead-lettered), per second of training, against
  what the trainer could train in the time it computed;
- the report: `runs/<id>/online-report.{md,json}` and `online.png`.

Does not own: the services; starting and stopping the stack (`launch.stack`, the mesh with
the gateway and the online trainer); the hidden preference and the users (`measure.users`).
Imports nothing from `services/`: everything is reached through processes, HTTP and NATS.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hotloop.service import run_interruptible

from launch.processes import sigterm_interrupts
from launch.stack import DEFAULT_CONFIG, Stack, start_stack
from measure.loop import LoopTracker
from measure.users import Brevity, Record, SimConfig, Simulation, SlidingShare, percentile, summarize

WARMUP_MAX_S = 300.0  # the longest wait for every user's first answer
log = logging.getLogger(__name__)


# ---- the demo ------------------------------------------------------------------------------


@dataclass
class DemoState:
    """Everything the report needs; filled while the demo runs, so an interrupted demo still
    reports what it saw."""

    run_id: str
    out: Path
    preference: Brevity
    window: int
    sim: Simulation | None = None
    tracker: LoopTracker | None = None
    training_started: float | None = None  # unix seconds
    training_ended: float | None = None  # unix seconds the users stopped
    base: float | None = None
    target: float | None = None
    reached_at: float | None = None  # unix seconds the window share first met the target
    interrupted: bool = False
    failed: str = ""  # a process of the mesh died: why
    settings: dict = field(default_factory=dict)


def target_share(base: float | None, factor: float = 3.0) -> float:
    """The demo's aim: `factor` x the base rate, capped at 0.8 (0.8 when the base rate is 0)."""
    return 0.8 if not base else min(0.8, factor * base)


def training_window(records: list[Record], since: float, window: int) -> SlidingShare:
    share = SlidingShare(window)
    for r in records:
        if r.phase == "training" and not r.error and r.ts >= since:
            share.add(bool(r.matched))
    return share


async def run_demo(state: DemoState, stack: Stack, users: int, idle_s: float, train_s: float,
                   max_tokens: int, until_target: bool, progress_s: float) -> None:
    tracker = state.tracker = LoopTracker(stack.info.nats_url, stack.metrics_path)
    await tracker.start()

    def extra() -> str:
        parts = [f"trained v{tracker.trained_version}"]
        if state.base is not None:
            parts.append(f"base {state.base:.2f} target {state.target:.2f}")
        loops = tracker.loops(state.sim.feedback_sent, state.sim.clock)
        if loops:
            parts.append(f"loop p50 {percentile([e['loop_ms'] for e in loops], 50) / 1e3:.1f} s")
        return "  ".join(parts)

    # Phases: warm-up (each user's first answer: the engine's first batches are slow and say
    # nothing about serving), idle (users only: base rate, idle latency), training.
    cfg = SimConfig(users=users, duration_s=WARMUP_MAX_S + idle_s + train_s, max_tokens=max_tokens,
                    feedback=False, phase="warmup", window=state.window, progress_s=progress_s)
    sim = state.sim = Simulation(stack.target, cfg, state.preference, state.out / "requests.jsonl",
                                 status_extra=extra)
    run = asyncio.create_task(sim.run())
    try:
        t0 = time.monotonic()
        while not run.done() and len(sim.records) < users and time.monotonic() - t0 < WARMUP_MAX_S:
            await _tick(run, stack, state)
        cfg.phase = "idle"
        idle_until = time.monotonic() + idle_s
        while not run.done() and time.monotonic() < idle_until:
            await _tick(run, stack, state)
        idle = [r for r in sim.records if r.phase == "idle" and not r.error]
        state.base = sum(bool(r.matched) for r in idle) / len(idle) if idle else None
        state.target = target_share(state.base)
        if not run.done():
            print(f"[demo-online] idle phase: {len(idle)} answers, base rate of the hidden preference "
                  f"({state.preference.describe()}): {_f(state.base)}; training until the last "
                  f"{state.window} answers reach {state.target:.2f}", flush=True)
        cfg.phase, cfg.feedback = "training", True
        state.training_started = time.time()
        train_until = time.monotonic() + train_s
        while not run.done() and time.monotonic() < train_until:
            await _tick(run, stack, state)
            share = training_window(sim.records, state.training_started, state.window)
            if len(share) == state.window and share.value >= state.target and state.reached_at is None:
                state.reached_at = time.time()
                print(f"[demo-online] target reached after "
                      f"{state.reached_at - state.training_started:.0f} s of training", flush=True)
                if until_target:
                    break
        sim.stop()
        await run
    finally:
        state.training_ended = time.time() if state.training_started else None
        await sim.halt(run)
        await tracker.poll()
        await tracker.close()


async def _tick(run: asyncio.Task, stack: Stack, state: DemoState) -> None:
    """Wait a second (or until the users stop); a dead mesh process stops the users."""
    await asyncio.wait({run}, timeout=1.0)
    if not state.failed and (why := stack.dead()) is not None:
        state.failed = why
        print(f"[demo-online] {why}\n[demo-online] stopping", flush=True)
        state.sim.stop()


def loop_summary(loops: list[dict]) -> dict:
    """Percentiles of the loops (ordered by when their feedback was sent), and the trend: the
    median of the first third against the last; and the loop's two sides, where the version's
    announcement was heard: `to_live_p50` (feedback sent -> its version announced: the queue,
    the turn, the update, the push) and `after_live_p50` (-> the first token a user got from
    it: waiting for a request, and its TTFT)."""
    ms = [e["loop_ms"] for e in sorted(loops, key=lambda e: e["sent"])]
    third = len(ms) // 3
    heard = [e for e in loops if e.get("live") is not None]
    return {"p50": percentile(ms, 50), "p95": percentile(ms, 95), "p99": percentile(ms, 99),
            "n": len(ms), "first_third_p50": percentile(ms[:third], 50) if third else None,
            "last_third_p50": percentile(ms[-third:], 50) if third else None,
            "to_live_p50": percentile([(e["live"] - e["sent"]) * 1e3 for e in heard], 50),
            "after_live_p50": percentile([max(0.0, e["first_token"] - e["live"]) * 1e3
                                          for e in heard], 50)}


def feedback_rates(state: DemoState) -> dict:
    """What became of the feedback during training, per second: arrived (the gateway took
    it), trained, dropped (settled without training, any reason); `capacity` is what the
    trainer trained per second of its updates (stages all together), the rate it could
    sustain were it never idle."""
    sim, tracker = state.sim, state.tracker
    t0, t1 = state.training_started, state.training_ended
    if not (sim and tracker and t0 and t1 and t1 > t0):
        return {}
    arrived = sum(r.phase == "training" and r.feedback in ("accepted", "duplicate") for r in sim.records)
    trained = sum(u.feedback for u in tracker.updates)
    dropped = sum(tracker.settled.values())
    busy = sum(u.seconds for u in tracker.updates)
    span = t1 - t0
    return {"arrived": arrived / span, "trained": trained / span, "dropped": dropped / span,
            "capacity": trained / busy if busy else None,
            "counts": {"arrived": arrived, "trained": trained, "dropped": dropped,
                       "pending": arrived - trained - dropped},
            "dropped_by_reason": dict(tracker.settled), "training_s": span,
            "trainer_busy_share": busy / span,
            "trained_tokens_per_update_s": (sum(u.tokens for u in tracker.updates) / busy
                                            if busy else None)}


def demo_report(state: DemoState) -> dict:
    sim, tracker = state.sim, state.tracker
    records = sim.records if sim else []
    idle = [r for r in records if r.phase == "idle"]
    training = [r for r in records if r.phase == "training"]
    s_idle, s_train = summarize(idle), summarize(training)
    final = training_window(records, state.training_started or 0, state.window).value
    loops = tracker.loops(sim.feedback_sent, sim.clock) if tracker and sim else []
    t0 = state.training_started
    return {
        "run_id": state.run_id,
        "interrupted": state.interrupted,
        "failed": state.failed,
        "preference": state.preference.describe(),
        "preference_share": {
            # every idle-phase answer (some finish after the switch, all from the base model);
            # the target was set from those finished at the switch (`base_at_switch`)
            "base": s_idle["matched_share"], "base_at_switch": state.base,
            "final": final, "target": state.target,
            "reached": state.reached_at is not None,
            "time_to_target_s": (state.reached_at - t0) if state.reached_at and t0 else None,
            "window": state.window,
        },
        "loop_ms": loop_summary(loops),
        "feedback_per_s": feedback_rates(state),
        "user_ttft_ms": {"idle_p50": s_idle["ttft_ms"]["p50"], "idle_p99": s_idle["ttft_ms"]["p99"],
                         "training_p50": s_train["ttft_ms"]["p50"], "training_p99": s_train["ttft_ms"]["p99"]},
        "user_itl_ms": {"idle_p50": s_idle["itl_ms"]["p50"], "idle_p99": s_idle["itl_ms"]["p99"],
                        "training_p50": s_train["itl_ms"]["p50"], "training_p99": s_train["itl_ms"]["p99"]},
        "version_lag": tracker.lag(training) if tracker else {},
        "versions": {"trained": tracker.trained_version if tracker else 0,
                     "served": sim.clock.latest if sim else 0},
        "updates": [{"version": u.version, "feedback": u.feedback, "score_mean": u.score_mean,
                     "seconds": u.seconds, "tokens": u.tokens,
                     "t_s": u.seen_at - t0 if t0 else None} for u in (tracker.updates if tracker else [])],
        "phases": {"idle": s_idle, "training": s_train},
        "training_s": (records[-1].ts - t0) if training and t0 else 0.0,
        "settings": state.settings,
    }


def write_demo_report(state: DemoState) -> dict:
    report = demo_report(state)
    out = state.out
    (out / "online-report.json").write_text(json.dumps(report, indent=2))
    _plot(state, out / "online.png")
    ps, lm, tt, it, lag, fr = (report["preference_share"], report["loop_ms"], report["user_ttft_ms"],
                               report["user_itl_ms"], report["version_lag"], report["feedback_per_s"])
    reached = (f"reached {ps['target']:.2f} after {ps['time_to_target_s']:.0f} s of training"
               if ps["reached"] else f"target {_f(ps['target'])} not reached")
    lines = [
        f"# hotloop online run `{state.run_id}`{' (interrupted)' if state.interrupted else ''}",
        "",
        *([f"**The run stopped early:** {state.failed.splitlines()[0]}", ""] if state.failed else []),
        f"Simulated users rate answers by a preference the trainer never sees: "
        f"{report['preference']}.",
        "",
        f"- share of answers matching it: base {_f(ps['base'])} -> final {_f(ps['final'])} "
        f"(last {ps['window']} answers); {reached}",
        f"- versions trained {report['versions']['trained']}, served {report['versions']['served']}; "
        f"{len(report['updates'])} updates in {report['training_s']:.0f} s of training",
        f"- loop latency (feedback sent -> first token from a version trained on it): "
        f"p50 {_f(lm['p50'], '.0f')} ms, p95 {_f(lm['p95'], '.0f')} ms over {lm['n']} feedback; "
        f"p50 of the first third {_f(lm['first_third_p50'], '.0f')} ms, of the last third "
        f"{_f(lm['last_third_p50'], '.0f')} ms; p50 to the version's announcement "
        f"{_f(lm.get('to_live_p50'), '.0f')} ms, from it to a first token "
        f"{_f(lm.get('after_live_p50'), '.0f')} ms",
        f"- feedback per second of training: arrived {_f(fr.get('arrived'))}, trained "
        f"{_f(fr.get('trained'))}, dropped {_f(fr.get('dropped'))} "
        f"({', '.join(f'{k} {n}' for k, n in fr.get('dropped_by_reason', {}).items()) or 'none'}); "
        f"the trainer computed {_f(fr.get('trainer_busy_share'), '.0%')} of the time, at "
        f"{_f(fr.get('capacity'))} feedback/s while it did",
        f"- served-version lag behind training: p50 {_f(lag.get('versions', {}).get('p50'), '.1f')} / "
        f"p99 {_f(lag.get('versions', {}).get('p99'), '.1f')} versions, p50 "
        f"{_f(lag.get('seconds', {}).get('p50'), '.1f')} / p99 {_f(lag.get('seconds', {}).get('p99'), '.1f')} s",
        "",
        "| users see | idle p50 | idle p99 | training p50 | training p99 |",
        "|---|---|---|---|---|",
        f"| TTFT ms | {_f(tt['idle_p50'], '.0f')} | {_f(tt['idle_p99'], '.0f')} | "
        f"{_f(tt['training_p50'], '.0f')} | {_f(tt['training_p99'], '.0f')} |",
        f"| ITL ms | {_f(it['idle_p50'], '.0f')} | {_f(it['idle_p99'], '.0f')} | "
        f"{_f(it['training_p50'], '.0f')} | {_f(it['training_p99'], '.0f')} |",
        "",
        "![share and latency](online.png)",
        "",
        "## Settings", "", "```json", json.dumps(state.settings, indent=2), "```",
    ]
    (out / "online-report.md").write_text("\n".join(lines) + "\n")
    return report


def _plot(state: DemoState, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    records = [r for r in (state.sim.records if state.sim else []) if not r.error]
    t0 = state.training_started or (records[0].ts if records else time.time())
    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    share, xs, ys, vx, vy = SlidingShare(state.window), [], [], [], []
    for r in records:
        share.add(bool(r.matched))
        xs.append(r.ts - t0)
        ys.append(share.value)
        if r.version is not None:
            vx.append(r.ts - t0)
            vy.append(r.version)
    ax[0].plot(xs, ys, label=f"matching share (last {state.window})")
    if state.base is not None:
        ax[0].axhline(state.base, color="grey", ls=":", label=f"base rate {state.base:.2f}")
        ax[0].axhline(state.target, color="green", ls="--", label=f"target {state.target:.2f}")
    ax[0].axvline(0, color="black", lw=0.8)
    ax[0].set_ylim(0, 1)
    ax[0].set_xlabel("seconds since training started (left of 0: idle phase)")
    ax[0].set_ylabel("share")
    ax[0].set_title(state.preference.describe())
    v = ax[0].twinx()
    v.step(vx, vy, where="post", color="tab:orange", alpha=0.6, label="served version")
    v.set_ylabel("served version")
    h1, l1 = ax[0].get_legend_handles_labels()
    h2, l2 = v.get_legend_handles_labels()
    ax[0].legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax[0].grid(alpha=0.3)
    ax[1].scatter([r.ts - t0 for r in records if r.ttft_ms], [r.ttft_ms for r in records if r.ttft_ms],
                  s=6, label="TTFT (ms)")
    if state.tracker and state.sim:
        loops = sorted(state.tracker.loops(state.sim.feedback_sent, state.sim.clock),
                       key=lambda e: e["sent"])
        xs, ys = [e["sent"] - t0 for e in loops], [e["loop_ms"] for e in loops]
        ax[1].scatter(xs, ys, s=6, label="loop latency (ms), by feedback sent")
        k = 9  # the trend: a running median of the last k loops
        med = [percentile(ys[max(0, i - k + 1):i + 1], 50) for i in range(len(ys))]
        ax[1].plot(xs, med, color="tab:red", lw=1.5, label=f"loop latency, median of the last {k}")
    if records:  # a log axis with nothing on it cannot be laid out
        ax[1].set_yscale("log")
    ax[1].set_xlabel("seconds since training started")
    ax[1].set_title("user TTFT and update-loop latency")
    ax[1].axvline(0, color="black", lw=0.8)
    ax[1].legend(fontsize=8)
    ax[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    """`hotloop demo-online`."""
    logging.basicConfig(level=os.environ.get("HOTLOOP_LOG_LEVEL", "WARNING"))
    config_path = args.config or str(DEFAULT_CONFIG)
    run_id = args.run_id or time.strftime("online-%Y%m%d-%H%M%S")
    out = Path(args.out_dir) / run_id
    out.mkdir(parents=True, exist_ok=True)
    pref = Brevity(args.max_words)
    state = DemoState(run_id, out, pref, args.window, settings={
        "config": config_path, "overrides": args.set, "users": args.users, "idle_s": args.idle_s,
        "train_s": args.train_s, "max_tokens": args.max_tokens, "max_words": args.max_words, "min_words": pref.min_words,
        "until_target": not args.no_stop, "window": args.window})

    print(f"[demo-online] starting the mesh (NATS, rollout with vLLM, gateway, online trainer); "
          f"run files under {out}", flush=True)
    try:
        with sigterm_interrupts():  # start_stack stops what started
            stack = start_stack(config_path, args.set, out, quiet=args.quiet)
    except KeyboardInterrupt:
        print("[demo-online] interrupted during start-up; stopped", flush=True)
        return 130
    try:
        print(f"[demo-online] gateway {stack.target.base_url}/v1; idle phase {args.idle_s:g} s "
              f"(users only), then up to {args.train_s:g} s of training", flush=True)
        _, state.interrupted = run_interruptible(run_demo(
            state, stack, args.users, args.idle_s, args.train_s, args.max_tokens,
            not args.no_stop, args.progress))
    finally:
        why = stack.stop()
    if why and not state.failed:
        state.failed = why
        print(f"[demo-online] {why}", flush=True)
    report = write_demo_report(state)
    ps = report["preference_share"]
    print(f"[demo-online] preference share: base {_f(ps['base'])} -> final {_f(ps['final'])}"
          f" (target {_f(ps['target'])}, {'reached in %.0f s' % ps['time_to_target_s'] if ps['reached'] else 'not reached'}); "
          f"loop p50 {_f(report['loop_ms']['p50'], '.0f')} ms (first third "
          f"{_f(report['loop_ms']['first_third_p50'], '.0f')}, last third "
          f"{_f(report['loop_ms']['last_third_p50'], '.0f')}); feedback/s arrived "
          f"{_f(report['feedback_per_s'].get('arrived'))} trained "
          f"{_f(report['feedback_per_s'].get('trained'))} dropped "
          f"{_f(report['feedback_per_s'].get('dropped'))}; TTFT p99 idle "
          f"{_f(report['user_ttft_ms']['idle_p99'], '.0f')} ms, training "
          f"{_f(report['user_ttft_ms']['training_p99'], '.0f')} ms", flush=True)
    print(f"[demo-online] report: {out / 'online-report.md'}", flush=True)
    return 130 if state.interrupted else 1 if state.failed else 0


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)
