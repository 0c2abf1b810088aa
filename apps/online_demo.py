"""`hotloop demo-online` (`make demo-online`): the online loop measured end to end, from the
users' side. `hotloop bench update-loop` (benchmarks/update_loop.py) runs on the same stack.

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
- what became of the feedback: arrived (accepted by the gateway), trained, dropped (the
  trainer's `settled` records: shed, stale, dead-lettered), per second of training, against
  what the trainer could train in the time it computed;
- the report: `runs/<id>/online-report.{md,json}` and `online.png`.

Does not own: the services, the hidden preference and the users (`apps.simulate`). Imports
nothing from `services/`: everything is reached through processes, HTTP and NATS.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hotloop.service import run_interruptible

from apps.processes import die_with_parent, sigterm_interrupts, stop_process, tail_log
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

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "online.toml"
TRAINER_RUN = "trainer"  # the trainer's metrics and checkpoints: runs/<id>/trainer/
WARMUP_MAX_S = 300.0  # the longest wait for every user's first answer
TRAINER_STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL for a `hotloop train online` subprocess
log = logging.getLogger(__name__)


# ---- the mesh ---------------------------------------------------------------------------------


@dataclass
class Stack:
    """A running mesh plus the `hotloop train online` processes started beside it (none where
    the mesh runs the trainer role)."""

    mesh: object  # apps.launcher.Mesh
    trainers: dict[str, subprocess.Popen]  # name -> process; its log: mesh/logs/<name>.log
    out: Path  # runs/<id>
    target: Target

    @property
    def info(self):
        return self.mesh.info

    @property
    def metrics_path(self) -> Path:
        return self.out / TRAINER_RUN / "metrics.jsonl"

    def _procs(self) -> list[tuple[str, subprocess.Popen, Path]]:
        procs = [(p.name, p.popen, p.log_path) for p in self.mesh.procs]
        return procs + [(name, popen, self.out / "mesh" / "logs" / f"{name}.log")
                        for name, popen in self.trainers.items()]

    def dead(self) -> str | None:
        """Which process of the stack died, with its log's last lines; None while all run."""
        for name, popen, log_path in self._procs():
            if popen.poll() is not None:
                return (f"{name} died with exit code {popen.returncode}; last lines of {log_path}:\n"
                        f"{tail_log(log_path, 8)}")
        return None

    def stop(self) -> str | None:
        """Stop everything; returns why a process had failed on its own (it can report a
        fatal error and still be shutting down when the demo ends), else None."""
        procs = self._procs()
        for popen in self.trainers.values():  # all at once: each checkpoints meanwhile
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
        for popen in self.trainers.values():
            stop_process(popen, TRAINER_STOP_GRACE_S)
        self.mesh.stop()
        # A process that failed exits 1 (`hotloop.service`); a negative code is a signal, and
        # a SIGKILL here is the launcher's own, after its grace period (it says so itself).
        # `hotloop train online` stopped by its SIGTERM exits 130 (the CLI's "interrupted").
        for name, popen, log_path in procs:
            code = popen.returncode
            if code is not None and code > 0 and not (name in self.trainers and code == 130):
                return f"{name} exited with code {code}; last lines of {log_path}:\n{tail_log(log_path, 8)}"
        return None


def start_stack(config_path: str, overrides: list[str], out: Path, quiet: bool = False,
                trainers: dict[str, list[str]] | None = None) -> Stack:
    """Start NATS, the rollout, the gateway, the reference (only with kl_beta > 0 and
    `[online] reference = "service"`) and the online trainer, with the mesh's files under
    `out/mesh` and the trainer's under `out/trainer` (`online.run_id`). `trainers`: name ->
    overrides of its own, one `hotloop train online` process each beside the mesh (its run
    id, its tenant); None: one trainer, the mesh's trainer role where it is built, else such
    a process. Raises if any of them does not come up (and stops what did)."""
    from apps import sections
    from apps.launcher import Mesh, available

    out = out.resolve()
    overrides = [*overrides, f"run_dir={out / 'mesh'}", f"online.out_dir={out}",
                 f"online.run_id={TRAINER_RUN}"]
    for own in (trainers or {}).values():  # every trainer's sections checked before anything starts
        sections.load(config_path, [*overrides, *own])
    loaded = sections.load(config_path, overrides)
    # the KL's reference: a service of the mesh, unless the trainer computes it itself
    service_ref = loaded["trainer"].loss.kl_beta > 0 and loaded["online"].reference == "service"
    role = trainers is None and available("trainer")
    if trainers is None and not role:
        trainers = {"trainer": []}
    services = ["rollout", "gateway"] + (["reference"] if service_ref else []) + (["trainer"] if role else [])
    mesh = Mesh(loaded.mesh, config_path, overrides, services, quiet=quiet, up=loaded["up"],
                rollout=loaded["rollout"])
    mesh.start()
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, own in (trainers or {}).items():
            cmd = [sys.executable, "-m", "apps.cli", "train", "online", "--config", config_path,
                   "--run-dir", str(out / "mesh")] + [a for o in [*overrides, *own] for a in ("--set", o)]
            with open(out / "mesh" / "logs" / f"{name}.log", "ab") as f:
                procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                               start_new_session=True, preexec_fn=die_with_parent)
        from apps.simulate import find_target

        return Stack(mesh, procs, out, find_target(out / "mesh"))
    except BaseException:
        for popen in procs.values():
            popen.kill()
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
    seconds: float = 0.0  # the update's stages, all together
    tokens: int = 0  # completion tokens trained
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage (turn_wait: a
    # lane of a shared trainer waiting for its turn)
    kl: float | None = None  # per-token KL of its batch to the base model (with kl_beta > 0)
    kl_coef: float | None = None  # the KL coefficient it trained with


class LoopTracker:
    """Follows one lineage's trainer from outside: its updates (metrics.jsonl) and the versions
    the bus announces for `tenant` (its own subject: `bus.weights_subject`). `loops()` pairs
    them with the users' feedback and first tokens."""

    def __init__(self, nats_url: str, metrics_path: Path, tenant: str = ""):
        self.nats_url, self.metrics_path, self.tenant = nats_url, metrics_path, tenant
        self.published_at: dict[int, float] = {}  # version -> unix seconds announced
        self.trained_in: dict[str, int] = {}  # response id -> first version trained on it
        self.trained_tenants: dict[str, int] = {}  # tenant a trained feedback names -> count
        self.updates: list[Update] = []
        self.settled: dict[str, int] = {}  # kind -> feedback the trainer dropped or dead-lettered
        self._offset = 0
        self._bus = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        from hotloop.bus import Bus, weights_subject
        from hotloop.proto.v1 import bus_pb2

        self._bus = await Bus.connect(self.nats_url, f"online-demo-{self.tenant}" if self.tenant
                                      else "online-demo")

        async def on_weights(msg, headers) -> None:
            if msg.tenant == self.tenant:
                self.published_at.setdefault(int(msg.info.version), time.time())

        await self._bus.subscribe(weights_subject(self.tenant), bus_pb2.WeightsUpdated, on_weights)
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
            rec = json.loads(line) if line.strip() else {}
            if "settled" in rec:
                kind = rec["settled"]["kind"]
                self.settled[kind] = self.settled.get(kind, 0) + 1
            step = rec.get("step")
            if not step:
                continue
            up = Update(int(step["version"]), time.time(), int(step["feedback"]), float(step["score_mean"]),
                        seconds=sum(step["stage_seconds"].values()), tokens=int(step["tokens"]),
                        stages=dict(step["stage_seconds"]), kl=step.get("train", {}).get("kl"),
                        kl_coef=step.get("kl_coef"))
            for seq in step["seqs"]:
                raw = await self._bus.js.get_msg("FEEDBACK", seq)
                fb = decode(bus_pb2.FeedbackEvent, raw.data, dict(raw.headers or {}))
                up.response_ids.append(fb.response_id)
                self.trained_in.setdefault(fb.response_id, up.version)
                self.trained_tenants[fb.tenant] = self.trained_tenants.get(fb.tenant, 0) + 1
            self.updates.append(up)

    def loops(self, feedback_sent: dict[str, float], clock: VersionClock) -> list[dict]:
        """One entry per trained feedback whose version has reached a user yet; `live`: when
        the bus announced the version trained on it (None if unheard), which splits the loop
        into the trainer's side (sent -> live) and the users' (live -> a first token from it)."""
        out = []
        for rid, version in self.trained_in.items():
            sent, first = feedback_sent.get(rid), clock.first_at_least(version)
            if sent is not None and first is not None:
                out.append({"response_id": rid, "version": version, "sent": sent,
                            "live": self.published_at.get(version),
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
