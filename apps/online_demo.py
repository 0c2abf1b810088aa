"""`hotloop demo-online` (`make demo-online`) and `hotloop bench update-loop`: the online loop
measured end to end, from the users' side.

Owns:
- starting the mesh with the gateway and the online trainer (`apps.launcher`, the trainer
  role; `hotloop train online` as a subprocess where the role is not built), and stopping all
  of it on every exit, Ctrl-C and SIGTERM included;
- the demo's phases: an idle phase (users only, no feedback: idle TTFT/ITL and the base rate
  of the hidden preference), then training (users rate answers, the trainer learns);
- the loop latency: from a feedback sent to the first token a user receives from a version
  trained on it. Which version that is comes from the trainer's `metrics.jsonl` (stream
  sequences per update) and the FEEDBACK stream (sequence -> response id); when a version went
  live comes from `hotloop.weights.updated` on the bus;
- the reports: `runs/<id>/online-report.{md,json}` and `online.png`; the bench's JSON and the
  stage budget of each loop from the OTLP JSON-lines traces.

Does not own: the services, the hidden preference and the users (`apps.simulate`). Imports
nothing from `services/`: everything is reached through processes, HTTP and NATS.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from apps.simulate import (
    Brevity,
    Record,
    SimConfig,
    Simulation,
    SlidingShare,
    Target,
    VersionClock,
    percentile,
    summarize,
)
from apps.tracebudget import read_trace_spans

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "online.toml"
TRAINER_RUN = "trainer"  # the trainer's metrics and checkpoints: runs/<id>/trainer/
WARMUP_MAX_S = 300.0  # the longest wait for every user's first answer
log = logging.getLogger(__name__)


# ---- the mesh ---------------------------------------------------------------------------------


@dataclass
class Stack:
    """A running mesh plus, where the trainer role is not built, `hotloop train online`."""

    mesh: object  # apps.launcher.Mesh
    trainer: subprocess.Popen | None
    out: Path  # runs/<id>
    target: Target

    @property
    def info(self):
        return self.mesh.info

    @property
    def metrics_path(self) -> Path:
        return self.out / TRAINER_RUN / "metrics.jsonl"

    def dead(self) -> str | None:
        """Which process of the stack died, with its log's last lines; None while all run."""
        from apps.launcher import tail_log

        procs = [(p.name, p.popen, p.log_path) for p in self.mesh.procs]
        if self.trainer is not None:
            procs.append(("trainer", self.trainer, self.out / "mesh" / "logs" / "trainer.log"))
        for name, popen, log_path in procs:
            if popen.poll() is not None:
                return (f"{name} died with exit code {popen.returncode}; last lines of {log_path}:\n"
                        f"{tail_log(log_path, 8)}")
        return None

    def stop(self) -> str | None:
        """Stop everything; returns why a process had failed on its own (it can report a
        fatal error and still be shutting down when the demo ends), else None."""
        from apps.launcher import tail_log

        procs = [(p.name, p.popen, p.log_path) for p in self.mesh.procs]
        if self.trainer is not None:
            procs.append(("trainer", self.trainer, self.out / "mesh" / "logs" / "trainer.log"))
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.send_signal(signal.SIGTERM)
            try:
                self.trainer.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.trainer.pid, signal.SIGKILL)
                self.trainer.wait()
        self.mesh.stop()
        # A process that failed exits 1 (`hotloop.service`); a negative code is a signal, and
        # a SIGKILL here is the launcher's own, after its grace period (it says so itself).
        for name, popen, log_path in procs:
            if popen.returncode is not None and popen.returncode > 0:
                return f"{name} exited with code {popen.returncode}; last lines of {log_path}:\n{tail_log(log_path, 8)}"
        return None


def start_stack(config_path: str, overrides: list[str], out: Path, quiet: bool = False) -> Stack:
    """Start NATS, the rollout, the gateway, the reference (only with kl_beta > 0) and the
    online trainer, with the mesh's files under `out/mesh` and the trainer's under
    `out/trainer`. Raises if any of them does not come up (and stops what did)."""
    from hotloop import config
    from apps.launcher import Mesh, die_with_parent, available

    out = out.resolve()
    overrides = [*overrides, f"run_dir={out / 'mesh'}", f"online.out_dir={out}",
                 f"online.run_id={TRAINER_RUN}"]
    tree = config.raw_config(config_path, overrides)
    kl_beta = float(tree.get("trainer", {}).get("loss", {}).get("kl_beta", 0.0))
    role = available("trainer")
    services = ["rollout", "gateway"] + (["reference"] if kl_beta > 0 else []) + (["trainer"] if role else [])
    mesh = Mesh(config.load_mesh(tree), config_path, overrides, services, quiet=quiet)
    mesh.start()
    trainer = None
    try:
        if not role:
            log_path = out / "mesh" / "logs" / "trainer.log"
            cmd = [sys.executable, "-m", "apps.cli", "train", "online", "--config", config_path,
                   "--run-dir", str(out / "mesh")] + [a for o in overrides for a in ("--set", o)]
            with open(log_path, "ab") as f:
                trainer = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True, preexec_fn=die_with_parent)
        from apps.simulate import find_target

        return Stack(mesh, trainer, out, find_target(out / "mesh"))
    except BaseException:
        if trainer is not None:
            trainer.kill()
        mesh.stop()
        raise


# ---- which version trained on which feedback, and when versions went live -------------------


@dataclass
class Update:
    version: int
    seen_at: float  # unix seconds the demo saw the trainer's step record
    feedback: int
    score_mean: float
    response_ids: list[str] = field(default_factory=list)


class LoopTracker:
    """Follows the trainer from outside: its updates (metrics.jsonl) and the versions the bus
    announces. `loops()` pairs them with the users' feedback and first tokens."""

    def __init__(self, nats_url: str, metrics_path: Path):
        self.nats_url, self.metrics_path = nats_url, metrics_path
        self.published_at: dict[int, float] = {}  # version -> unix seconds announced
        self.trained_in: dict[str, int] = {}  # response id -> first version trained on it
        self.updates: list[Update] = []
        self._offset = 0
        self._bus = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        from hotloop.bus import WEIGHTS_UPDATED, Bus
        from hotloop.proto.v1 import bus_pb2

        self._bus = await Bus.connect(self.nats_url, "online-demo")

        async def on_weights(msg, headers) -> None:
            self.published_at.setdefault(int(msg.info.version), time.time())

        await self._bus.subscribe(WEIGHTS_UPDATED, bus_pb2.WeightsUpdated, on_weights)
        self._task = asyncio.create_task(self._follow())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._bus:
            await self._bus.close()

    @property
    def trained_version(self) -> int:
        return max(self.published_at, default=0)

    async def _follow(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(0.25)

    async def poll(self) -> None:
        """Read new step records; resolve their stream sequences to response ids."""
        from hotloop.bus import decode
        from hotloop.proto.v1 import bus_pb2

        if not self.metrics_path.exists():
            return
        with open(self.metrics_path) as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind("\n") + 1  # a half-written last line waits for the next poll
        self._offset += len(chunk[:end].encode())
        for line in chunk[:end].splitlines():
            step = json.loads(line).get("step") if line.strip() else None
            if not step:
                continue
            up = Update(int(step["version"]), time.time(), int(step["feedback"]), float(step["score_mean"]))
            for seq in step["seqs"]:
                raw = await self._bus.js.get_msg("FEEDBACK", seq)
                fb = decode(bus_pb2.FeedbackEvent, raw.data, dict(raw.headers or {}))
                up.response_ids.append(fb.response_id)
                self.trained_in.setdefault(fb.response_id, up.version)
            self.updates.append(up)

    def loops(self, feedback_sent: dict[str, float], clock: VersionClock) -> list[dict]:
        """One entry per trained feedback whose version has reached a user yet."""
        out = []
        for rid, version in self.trained_in.items():
            sent, first = feedback_sent.get(rid), clock.first_at_least(version)
            if sent is not None and first is not None:
                out.append({"response_id": rid, "version": version, "sent": sent,
                            "first_token": first, "loop_ms": (first - sent) * 1e3})
        return sorted(out, key=lambda e: e["sent"])

    def lag(self, records: list[Record]) -> dict:
        """How far behind training the served versions were, at each response's first token:
        in versions, and in seconds since the first newer version was announced."""
        pub = sorted(self.published_at.items())
        versions, seconds = [], []
        for r in records:
            if r.error or r.version is None or r.ttft_ms is None:
                continue
            t = r.ts + r.ttft_ms / 1e3
            live = [v for v, at in pub if at <= t]
            newest = max(live, default=0)
            versions.append(max(0, newest - r.version))
            newer = [at for v, at in pub if v > r.version and at <= t]
            seconds.append(t - min(newer) if newer else 0.0)
        return {"versions": {"p50": percentile(versions, 50), "p99": percentile(versions, 99)},
                "seconds": {"p50": percentile(seconds, 50), "p99": percentile(seconds, 99)}}


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
    base: float | None = None
    target: float | None = None
    reached_at: float | None = None  # unix seconds the window share first met the target
    interrupted: bool = False
    failed: str = ""  # a process of the mesh died: why
    settings: dict = field(default_factory=dict)


def target_share(base: float | None) -> float:
    """The demo's aim: 3x the base rate, capped at 0.8 (0.8 when the base rate is 0)."""
    return 0.8 if not base else min(0.8, 3.0 * base)


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
        sim.stop()
        if not run.done():
            run.cancel()
            try:
                await run
            except (asyncio.CancelledError, Exception):
                pass
        await tracker.poll()
        await tracker.close()
        sim.close()


async def _tick(run: asyncio.Task, stack: Stack, state: DemoState) -> None:
    """Wait a second (or until the users stop); a dead mesh process stops the users."""
    await asyncio.wait({run}, timeout=1.0)
    if not state.failed and (why := stack.dead()) is not None:
        state.failed = why
        print(f"[demo-online] {why}\n[demo-online] stopping", flush=True)
        state.sim.stop()


def demo_report(state: DemoState) -> dict:
    sim, tracker = state.sim, state.tracker
    records = sim.records if sim else []
    idle = [r for r in records if r.phase == "idle"]
    training = [r for r in records if r.phase == "training"]
    s_idle, s_train = summarize(idle), summarize(training)
    final = training_window(records, state.training_started or 0, state.window).value
    loops = tracker.loops(sim.feedback_sent, sim.clock) if tracker and sim else []
    loop_ms = [e["loop_ms"] for e in loops]
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
        "loop_ms": {"p50": percentile(loop_ms, 50), "p95": percentile(loop_ms, 95),
                    "p99": percentile(loop_ms, 99), "n": len(loop_ms)},
        "user_ttft_ms": {"idle_p50": s_idle["ttft_ms"]["p50"], "idle_p99": s_idle["ttft_ms"]["p99"],
                         "training_p50": s_train["ttft_ms"]["p50"], "training_p99": s_train["ttft_ms"]["p99"]},
        "user_itl_ms": {"idle_p50": s_idle["itl_ms"]["p50"], "idle_p99": s_idle["itl_ms"]["p99"],
                        "training_p50": s_train["itl_ms"]["p50"], "training_p99": s_train["itl_ms"]["p99"]},
        "version_lag": tracker.lag(training) if tracker else {},
        "versions": {"trained": tracker.trained_version if tracker else 0,
                     "served": sim.clock.latest if sim else 0},
        "updates": [{"version": u.version, "feedback": u.feedback, "score_mean": u.score_mean,
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
    ps, lm, tt, it, lag = (report["preference_share"], report["loop_ms"], report["user_ttft_ms"],
                           report["user_itl_ms"], report["version_lag"])
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
        f"p50 {_f(lm['p50'], '.0f')} ms, p95 {_f(lm['p95'], '.0f')} ms over {lm['n']} feedback",
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
        loops = state.tracker.loops(state.sim.feedback_sent, state.sim.clock)
        ax[1].scatter([e["sent"] - t0 for e in loops], [e["loop_ms"] for e in loops], s=6,
                      label="loop latency (ms)")
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


def _interrupt(signum, frame):
    """SIGTERM during start-up stops what started, like Ctrl-C (the launcher's cleanup runs)."""
    raise KeyboardInterrupt


def main(args) -> int:
    """`hotloop demo-online`."""
    from hotloop.service import run_interruptible

    logging.basicConfig(level=os.environ.get("HOTLOOP_LOG_LEVEL", "WARNING"))
    config_path = args.config or str(DEFAULT_CONFIG)
    run_id = args.run_id or time.strftime("online-%Y%m%d-%H%M%S")
    out = Path(args.out_dir) / run_id
    out.mkdir(parents=True, exist_ok=True)
    pref = Brevity(args.max_words)
    state = DemoState(run_id, out, pref, args.window, settings={
        "config": config_path, "overrides": args.set, "users": args.users, "idle_s": args.idle_s,
        "train_s": args.train_s, "max_tokens": args.max_tokens, "max_words": args.max_words,
        "until_target": not args.no_stop, "window": args.window})

    old = signal.signal(signal.SIGTERM, _interrupt)
    print(f"[demo-online] starting the mesh (NATS, rollout with vLLM, gateway, online trainer); "
          f"run files under {out}", flush=True)
    try:
        stack = start_stack(config_path, args.set, out, quiet=args.quiet)
    except KeyboardInterrupt:
        print("[demo-online] interrupted during start-up; stopped", flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
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
          f"loop p50 {_f(report['loop_ms']['p50'], '.0f')} ms; TTFT p99 idle "
          f"{_f(report['user_ttft_ms']['idle_p99'], '.0f')} ms, training "
          f"{_f(report['user_ttft_ms']['training_p99'], '.0f')} ms", flush=True)
    print(f"[demo-online] report: {out / 'online-report.md'}", flush=True)
    return 130 if state.interrupted else 1 if state.failed else 0


# ---- the bench --------------------------------------------------------------------------------

LOOP_STAGES = ("ingest", "consume", "join", "reference", "train", "pack", "push", "load", "first_token")


def loop_stages(spans: list[dict], loops: list[dict]) -> dict[str, list[float]]:
    """Per-loop stage times (ms) along the loop's critical path, from the traces: the
    trainer's `online.step` children; push (publish started -> the replica started loading:
    archive, send); load (the replica's PushAdapter server span: verify, merge, swap); and the
    ends the traces cannot see: ingest (feedback sent -> the update started) and first token
    (the replica loaded it -> a user's first token from it, 0 when a token came first). The
    stages follow each other in time, so they add up to the loop. The announce on the bus runs
    after the load and is off the path."""
    by_id = {s["span_id"]: s for s in spans}
    children = defaultdict(list)
    for s in spans:
        children[s["parent"]].append(s)
    publish = {}
    for s in spans:
        if s["name"] == "publish" and s["attrs"].get("hotloop.version") is not None:
            publish[int(s["attrs"]["hotloop.version"])] = s
    out: dict[str, list[float]] = defaultdict(list)
    for lp in loops:
        pub = publish.get(lp["version"])
        step = by_id.get(pub["parent"]) if pub else None
        if pub is None or step is None or step["name"] != "online.step":
            continue
        kids = {c["name"]: c for c in children[step["span_id"]]}
        out["ingest"].append((step["start"] - lp["sent"]) * 1e3)
        for name in ("consume", "join", "reference", "train", "pack"):
            if name in kids:
                out[name].append((kids[name]["end"] - kids[name]["start"]) * 1e3)
        loads = [s for s in spans if s["trace"] == pub["trace"] and s["name"].endswith("PushAdapter")
                 and s["start"] >= pub["start"] and _is_server(s, by_id)]
        first = lp["first_token"]
        if loads:  # one replica here; with several, the slowest one bounds the path
            load = max(loads, key=lambda s: s["end"])
            out["push"].append((load["start"] - pub["start"]) * 1e3)
            # An in-flight swap serves the new weights before PushAdapter returns (it still
            # retires old versions): the load ends, for the loop, at the first token if sooner.
            out["load"].append((min(load["end"], first) - load["start"]) * 1e3)
            live = load["end"]
        else:
            out["push"].append((pub["end"] - pub["start"]) * 1e3)
            live = pub["end"]
        out["first_token"].append(max(0.0, first - live) * 1e3)
    return out


def _is_server(span: dict, by_id: dict) -> bool:
    """A gRPC server span: its parent is the client span of the same call (another process)."""
    parent = by_id.get(span["parent"])
    return parent is not None and parent["name"] == span["name"]


def bench_update_loop(args) -> int:
    """`hotloop bench update-loop`."""
    from hotloop.service import run_interruptible

    logging.basicConfig(level=os.environ.get("HOTLOOP_LOG_LEVEL", "WARNING"))
    config_path = args.config or str(DEFAULT_CONFIG)
    out = Path(args.out_dir) / time.strftime("update-loop-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    # One feedback per update: each loop is one feedback, trained alone, published, served.
    overrides = ["online.batch_size=1", "online.batch_window_s=0", "telemetry.exporter=jsonl", *args.set]
    print(f"[bench update-loop] starting the mesh; run files under {out}", flush=True)
    old = signal.signal(signal.SIGTERM, _interrupt)
    try:
        stack = start_stack(config_path, overrides, out, quiet=True)
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    result: dict = {}
    try:
        res, interrupted = run_interruptible(_bench(stack, args, out, result))
    finally:
        stack.stop()  # flushes every process's spans
    if interrupted and not result.get("loops_detail"):
        return 130
    spans = read_trace_spans(sorted((out / "mesh" / "traces").glob("*.jsonl")))
    stages = loop_stages(spans, result["loops_detail"])
    loop_ms = [e["loop_ms"] for e in result["loops_detail"]]
    summary = {
        "loop_ms": {"p50": percentile(loop_ms, 50), "p95": percentile(loop_ms, 95)},
        "loops": len(loop_ms),
        "lost_feedback": result["lost"],
        "stages_ms": {s: percentile(stages[s], 50) for s in LOOP_STAGES if stages.get(s)},
        "stages_p95_ms": {s: percentile(stages[s], 95) for s in LOOP_STAGES if stages.get(s)},
        "per_loop": [{"version": e["version"], "loop_ms": round(e["loop_ms"], 1)}
                     for e in result["loops_detail"]],
        "background": result["background"],
        "interrupted": interrupted,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))
    _print_budget(summary)
    return 130 if interrupted else 0


async def _bench(stack: Stack, args, out: Path, result: dict) -> None:
    tracker = LoopTracker(stack.info.nats_url, stack.metrics_path)
    await tracker.start()
    result.update(loops_detail=[], lost=0, background={})
    # Background users stream without rating: they carry the new versions' first tokens.
    cfg = SimConfig(users=args.users, duration_s=24 * 3600, max_tokens=args.max_tokens,
                    feedback=False, phase="background", progress_s=0)
    sim = Simulation(stack.target, cfg, Brevity(args.max_words), out / "requests.jsonl")
    users = asyncio.create_task(sim.run())
    import httpx

    try:
        async with httpx.AsyncClient(timeout=30.0) as http:
            rated: set[str] = set()
            for i in range(args.loops):
                # rate the newest finished answer nobody rated yet
                while True:
                    fresh = [r for r in sim.records if r.response_id and not r.error and r.response_id not in rated]
                    if fresh:
                        break
                    if users.done():
                        users.result()
                        raise RuntimeError("the background users stopped")
                    await asyncio.sleep(0.05)
                rec = fresh[-1]
                rated.add(rec.response_id)
                before = max(tracker.trained_version, sim.clock.latest)
                sent = time.time()
                outcome = await sim.send_feedback(http, rec.response_id, rec.score)
                if outcome not in ("accepted", "duplicate"):
                    result["lost"] += 1
                    print(f"[bench update-loop] loop {i + 1}: feedback refused ({outcome})", flush=True)
                    continue
                sim.feedback_sent[rec.response_id] = sent
                deadline = time.monotonic() + args.loop_timeout_s
                entry = None
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                    if (why := stack.dead()) is not None:
                        raise RuntimeError(why)
                    v = tracker.trained_in.get(rec.response_id)
                    if v is not None and v > before and sim.clock.first_at_least(v) is not None:
                        entry = [e for e in tracker.loops(sim.feedback_sent, sim.clock)
                                 if e["response_id"] == rec.response_id][0]
                        break
                if entry is None:
                    result["lost"] += 1
                    print(f"[bench update-loop] loop {i + 1}: no first token from a version trained "
                          f"on the feedback within {args.loop_timeout_s:g} s", flush=True)
                    continue
                result["loops_detail"].append(entry)
                done = [e["loop_ms"] for e in result["loops_detail"]]
                print(f"[bench update-loop] loop {i + 1}/{args.loops}: {entry['loop_ms']:.0f} ms "
                      f"(v{entry['version']}; p50 so far {percentile(done, 50):.0f} ms)", flush=True)
    finally:
        sim.stop()
        users.cancel()
        try:
            await users
        except (asyncio.CancelledError, Exception):
            pass
        sim.close()
        await tracker.close()
        s = summarize(sim.records)
        result["background"] = {"users": args.users, "requests": s["requests"], "errors": s["errors"],
                                "ttft_ms_p50": s["ttft_ms"]["p50"], "itl_ms_p50": s["itl_ms"]["p50"]}


def _print_budget(summary: dict) -> None:
    lm = summary["loop_ms"]
    print(f"[bench update-loop] {summary['loops']} loops, lost feedback {summary['lost_feedback']}: "
          f"p50 {_f(lm['p50'], '.0f')} ms, p95 {_f(lm['p95'], '.0f')} ms", flush=True)
    stages = summary["stages_ms"]
    total = sum(v for v in stages.values() if v) or 1.0
    print(f"{'stage':<14}{'p50 ms':>10}{'share':>8}{'p95 ms':>10}")
    for name, v in stages.items():
        print(f"{name:<14}{v:>10.0f}{v / total:>8.0%}{summary['stages_p95_ms'][name]:>10.0f}")
    if lm["p50"] is not None and lm["p50"] >= 1000 and stages:
        over = lm["p50"] - 1000
        print(f"[bench update-loop] p50 is {over:.0f} ms over the 1000 ms aim. Largest stages first:")
        for name, v in sorted(stages.items(), key=lambda kv: -(kv[1] or 0))[:3]:
            print(f"  {name}: {v:.0f} ms — {_HINTS.get(name, '')}")


_HINTS = {
    "train": "one LoRA step on the CPU; fewer LoRA layers (target q/v only), a lower rank or "
             "bf16 on AMX hardware shrink it; on a GPU it is tens of ms",
    "load": "the replica's verify + merge + drain; the drain waits for in-flight requests in "
            "merged mode: in-flight weight updates (or LoRA slots) remove the wait",
    "first_token": "a version is live but no user request has produced a token from it yet: "
                   "in-flight updates switch running streams at the next token",
    "push": "packing and sending the adapter; a smaller adapter (rank, layers) is less to pack",
    "ingest": "gateway publish + JetStream delivery + the trainer's fetch (its fetch timeout)",
    "reference": "the KL reference pass: kl_beta = 0 removes it",
    "pack": "saving the adapter to disk before the push",
    "consume": "the batch window: batch_window_s = 0 with batch_size = 1",
}


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)
