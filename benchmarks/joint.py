"""`hotloop bench joint`: what PPO training costs the users of the same engine, per users-first
policy, measured in one run.

Owns:
- the run: the colocated mesh (NATS, rollout, reward, gateway; `launch.mesh.Mesh`),
  simulated users streaming through the gateway with the `openai` client for the whole run
  (`measure.users`), and `hotloop train ppo` as a subprocess, once per policy;
- the phases: warm-up (each user's first answer, excluded), idle (users only), then per
  policy: start the trainer, wait for its first logged step, measure, let the measured
  requests finish, SIGTERM the trainer and wait for it. Training starts where the first step
  began (its metrics line's time less its stage seconds): the trainer's start-up (imports,
  model loads, a resumed run's publish) is left out, and the first step counts, so a policy's
  phase lasts `phase_s` or one step, whichever is longer (a step beside users took minutes on
  2 cores). A request belongs to the phase it started in, and a phase switch waits until no
  request of the old phase is streaming, so every measured request ran wholly beside (or
  wholly without) training;
- the figures: TTFT and ITL p50/p99 per phase, PPO samples/s per policy, the TTFT p99 ratio
  to idle, the choice of policy and whether the issue's aim (p99 TTFT at most 1.5x idle with
  samples/s > 0) was met; where each phase's TTFT went, hop by hop, from the traces
  (`measure.traces.ttft_hops`); and how much CPU other work took meanwhile, since the
  machine is shared and a busy neighbour inflates both figures;
- stopping: the mesh and any trainer are stopped on every exit path, Ctrl-C and SIGTERM
  included (the trainer also dies with this process: PR_SET_PDEATHSIG).

Does not own: PPO, the policies themselves (`[ppo] users_first`, applied by the trainer), the
gateway or the users. The summarizing and choosing functions are pure, for tests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.processes import die_with_parent, hotloop_command, stop_process, tail_log
from measure.users import Brevity, Record, SimConfig, Simulation, percentile, summarize
from measure.traces import TTFT_HOPS, read_trace_spans, ttft_hops
from benchmarks.common import exit_code, report, run_interruptible, say_as, sigterm_interrupts

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "ppo.toml"
POLICIES = ("none", "nice", "pause")
MESH_SERVICES = ["rollout", "reward", "gateway"]  # `hotloop up --profile colocated`
RUN_ID = "ppo"  # one trainer run across policies: each trainer resumes the last one's checkpoint
TTFT_P99_AIM = 1.5  # the aim: user p99 TTFT at most 1.5x idle while PPO progresses
ITL_P99_AIM = 2.0  # and the users' streams' p99 stall at most 2x idle
MIN_REQUESTS = 200  # per phase, for a p99 that rests on more than one or two requests
WARMUP_MAX_S = 300.0  # the longest wait for every user's first answer
FIRST_STEP_MAX_S = 420.0  # the longest wait for a trainer's first step (one took 310 s beside
                          # users on 2 cores) before measuring anyway
DRAIN_MAX_S = 60.0  # the longest wait for a phase's requests to finish after it ends
STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL for the trainer
SLOWEST = 3  # requests whose hops are shown per phase: a p99 of ~100 rests on the slowest two
PROGRESS_S = 15.0
MARK_S = 5.0  # CPU accounting marks, to take other work's share from a start found afterwards
ENDLESS_STEPS = 1_000_000  # the trainer runs until SIGTERM
SAMPLES_PER_S_METHOD = ("samples of the non-skipped PPO steps whose metrics line appeared in the "
                        "training window / the time those steps took: from the first step's start "
                        "(its line's time less its stage_seconds) to the last counted step's line "
                        "(a step cut by SIGTERM is not counted, nor the time it ran, which would "
                        "bias a window holding a few long steps low); per_step: samples / the sum "
                        "of those steps' stage_seconds")
log = logging.getLogger(__name__)
say = say_as("joint")


# ---- pure: steps, phases, the choice -------------------------------------------------------


@dataclass
class StepSeen:
    """One `step` record of the trainer's metrics.jsonl, with when the bench read it."""

    step: int
    samples: int
    seen_at: float  # unix seconds
    seconds: float  # sum of stage_seconds (0 when the record has none)
    skipped: bool = False
    paused_s: float = 0.0  # `pause`: how long the train stage waited for users


def parse_steps(lines: list[str], seen_at: float) -> list[StepSeen]:
    """The `step` records among metrics lines (other records, e.g. `eval`, are skipped)."""
    out = []
    for line in lines:
        if not line.strip():
            continue
        step = json.loads(line).get("step")
        if not isinstance(step, dict):
            continue
        stages = step.get("stage_seconds") or {}
        out.append(StepSeen(int(step["step"]), int(step.get("samples", 0)), seen_at,
                            float(sum(v for v in stages.values() if v is not None)),
                            bool(step.get("skipped", False)), float(step.get("paused_s") or 0.0)))
    return out


def latency(records: list[Record]) -> dict:
    """TTFT and ITL p50/p99 (ms) of one phase's records, as `measure.users.summarize` takes
    them: ITL p50 is the median of per-request medians, p99 the p99 of per-request p99s."""
    s = summarize(records)
    return {"ttft_ms": s["ttft_ms"], "itl_ms": s["itl_ms"], "requests": s["requests"],
            "errors": s["errors"]}


def ppo_rate(steps: list[StepSeen], t0: float, t1: float) -> dict:
    """PPO progress in the window (t0, t1]: steps whose line was seen in it. Skipped steps
    (no update) count as steps but not as samples trained on."""
    inside = [s for s in steps if t0 < s.seen_at <= t1]
    trained = [s for s in inside if not s.skipped]
    samples = sum(s.samples for s in trained)
    busy = sum(s.seconds for s in trained)
    wall = max(s.seen_at for s in inside) - t0 if inside else t1 - t0
    return {"ppo_samples_per_s": samples / wall if wall > 0 else 0.0,
            "ppo_samples_per_s_per_step": samples / busy if busy > 0 else None,
            "ppo_steps": len(inside), "ppo_skipped_steps": len(inside) - len(trained),
            "ppo_samples": samples, "window_s": wall, "paused_s": sum(s.paused_s for s in inside),
            "step_s_median": percentile([s.seconds for s in trained if s.seconds], 50)}


def ratio(x: float | None, base: float | None) -> float | None:
    return x / base if x is not None and base else None


def training_records(records: list[Record], policy: str, window: tuple[float, float] | None) -> list[Record]:
    """The requests that ran beside `policy`'s training: started at or after training began
    (labelled start-up while the first step ran, or training after it was logged). None of
    them is still streaming at SIGTERM (the bench waits). Without a window (an interrupted
    run), those labelled training."""
    if window is None:
        return [r for r in records if r.phase == f"{policy}:training"]
    return [r for r in records if r.phase in (f"{policy}:startup", f"{policy}:training") and r.ts >= window[0]]


def policy_figures(records: list[Record], policy: str, idle: dict, steps: list[StepSeen],
                   window: tuple[float, float] | None) -> dict:
    """One policy's latency, its ratios to idle and PPO's progress during its phase."""
    lat = latency(training_records(records, policy, window))
    t0, t1 = window or (None, None)
    rate = ppo_rate(steps, t0, t1) if t0 is not None and t1 is not None else ppo_rate([], 0, 0)
    return {**lat, **rate,
            "ttft_p99_ratio": ratio(lat["ttft_ms"]["p99"], idle["ttft_ms"]["p99"]),
            "ttft_p50_ratio": ratio(lat["ttft_ms"]["p50"], idle["ttft_ms"]["p50"]),
            "itl_p99_ratio": ratio(lat["itl_ms"]["p99"], idle["itl_ms"]["p99"])}


def hop_figures(hops: dict[str, dict[str, float]], records: list[Record]) -> dict | None:
    """Where the phase's time to first token went (`measure.traces.ttft_hops`): each hop's
    median, and the hops of its slowest requests (what its p99 is made of). None when the
    traces cover none of the phase's requests."""
    mine = sorted(((r.ttft_ms, hops[r.response_id]) for r in records
                   if r.response_id in hops and r.ttft_ms is not None), key=lambda x: x[0])
    if not mine:
        return None
    return {"requests": len(mine),
            "p50_ms": {h: percentile([x[1][h] for x in mine], 50) for h in TTFT_HOPS},
            "slowest": [{"ttft_ms": round(t, 1), **{h: round(v[h], 1) for h in TTFT_HOPS}}
                        for t, v in mine[-SLOWEST:][::-1]]}


def meets_aim(fig: dict, aim: float = TTFT_P99_AIM, itl_aim: float = ITL_P99_AIM) -> bool:
    r, i = fig.get("ttft_p99_ratio"), fig.get("itl_p99_ratio")
    return (r is not None and r <= aim and i is not None and i <= itl_aim
            and fig.get("ppo_samples_per_s", 0) > 0)


def choose(policies: dict[str, dict]) -> str | None:
    """The best policy by measurement: the lowest TTFT p99 ratio to idle among those where PPO
    made progress (samples/s > 0); None when none did."""
    ok = [(f["ttft_p99_ratio"], name) for name, f in policies.items()
          if f.get("ppo_samples_per_s", 0) > 0 and f.get("ttft_p99_ratio") is not None]
    return min(ok)[1] if ok else None


def bench_summary(records: list[Record], runs: list[dict], default_policy: str,
                  aim: float = TTFT_P99_AIM) -> dict:
    """The bench's JSON (less settings and timings). `runs` holds per policy: policy, steps
    (StepSeen), window (t0, t1: training start -> SIGTERM, unix seconds) and whatever else to
    report (first-step wait, exit).

    "training" at the top is the configured default policy's figure when it was measured,
    else the chosen one's (else the first measured), and `training_policy` says which."""
    idle = latency([r for r in records if r.phase == "idle"])
    policies = {}
    for run in runs:
        window = run.get("window")
        fig = policy_figures(records, run["policy"], idle, run["steps"], window)
        extra = {k: v for k, v in run.items() if k not in ("policy", "steps", "window")}
        # the trainer's start-up (imports, model loads) is a cost users pay too, reported apart
        startup = latency([r for r in records if r.phase == f"{run['policy']}:startup"
                           and (window is None or r.ts < window[0])])
        policies[run["policy"]] = {**fig, "aim_met": meets_aim(fig, aim), "startup": startup, **extra}
    chosen = choose(policies)
    shown = (default_policy if default_policy in policies
             else chosen if chosen is not None else next(iter(policies), None))
    train = policies.get(shown) or policy_figures([], "-", idle, [], None)
    met = meets_aim(train, aim)
    why = []
    if train.get("ttft_p99_ratio") is None:
        why.append("no TTFT p99 ratio (too few requests in a phase)")
    elif train["ttft_p99_ratio"] > aim:
        why.append(f"TTFT p99 {train['ttft_p99_ratio']:.2f}x idle > {aim:g}x")
    if train.get("itl_p99_ratio") is None:
        why.append("no ITL p99 ratio")
    elif train["itl_p99_ratio"] > ITL_P99_AIM:
        why.append(f"ITL p99 {train['itl_p99_ratio']:.2f}x idle > {ITL_P99_AIM:g}x")
    if not train.get("ppo_samples_per_s"):
        why.append("PPO made no progress during the phase (samples/s = 0)")
    return {
        "ttft_ms": {"idle": idle["ttft_ms"], "training": train["ttft_ms"]},
        "itl_ms": {"idle": idle["itl_ms"], "training": train["itl_ms"]},
        "ppo_samples_per_s": train.get("ppo_samples_per_s", 0.0),
        "ppo_samples_per_s_method": SAMPLES_PER_S_METHOD,
        "training_policy": shown,
        "default_policy": default_policy,
        "chosen": chosen,
        "aim": {"ttft_p99_ratio_max": aim, "ttft_p99_ratio": train.get("ttft_p99_ratio"),
                "itl_p99_ratio_max": ITL_P99_AIM, "itl_p99_ratio": train.get("itl_p99_ratio"),
                "met": met, "why_not": "; ".join(why)},
        "requests": {"idle": idle["requests"], "idle_errors": idle["errors"]},
        "policies": policies,
    }


def markdown(result: dict) -> str:
    """A short table: idle, then each policy."""

    def f(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    idle_t, idle_i = result["ttft_ms"]["idle"], result["itl_ms"]["idle"]
    rows = [
        "| phase | requests | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | p99 / idle | ITL p50 ms | ITL p99 ms "
        "| p99 / idle | PPO steps | PPO samples/s | aim |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| idle (users only) | {result['requests']['idle']} | {f(idle_t['p50'])} | {f(idle_t.get('p95'))} | "
        f"{f(idle_t['p99'])} | 1.00 | {f(idle_i['p50'])} | {f(idle_i['p99'])} | 1.00 | - | - | |",
    ]
    for name, p in result["policies"].items():
        mark = " (chosen)" if name == result["chosen"] else ""
        rows.append(f"| PPO, users_first={name}{mark} | {p['requests']} | {f(p['ttft_ms']['p50'])} | "
                    f"{f(p['ttft_ms'].get('p95'))} | {f(p['ttft_ms']['p99'])} | {f(p['ttft_p99_ratio'], '.2f')} | "
                    f"{f(p['itl_ms']['p50'])} | {f(p['itl_ms']['p99'])} | {f(p['itl_p99_ratio'], '.2f')} | "
                    f"{p['ppo_steps']} | {f(p['ppo_samples_per_s'], '.3f')} | "
                    f"{'met' if p['aim_met'] else 'not met'} |")
    aim = result["aim"]
    verdict = (f"**Aim met** with `{result['training_policy']}`" if aim["met"] else
               f"**Aim not met** with `{result['training_policy']}`: {aim['why_not']}")
    lines = ["# hotloop bench joint", "",
             f"Users through the gateway alone, then beside PPO training, per users-first policy. "
             f"Aim: user TTFT p99 at most {aim['ttft_p99_ratio_max']:g}x idle and ITL p99 at most "
             f"{aim['itl_p99_ratio_max']:g}x idle with PPO making progress.", "",
             *rows, "",
             f"{verdict}. Chosen by measurement: `{result['chosen']}`; configured default: "
             f"`{result['default_policy']}`.", "",
             f"PPO samples/s: {result['ppo_samples_per_s_method']}.", ""]
    hop_rows = []
    for phase, h in (result.get("ttft_hops") or {}).items():
        if h is None:
            continue
        med = h["p50_ms"]
        hop_rows.append(f"| {phase} | median | {' | '.join(f(med[k]) for k in TTFT_HOPS)} |")
        for x in h["slowest"]:
            hop_rows.append(f"| {phase} | TTFT {f(x['ttft_ms'])} | {' | '.join(f(x[k]) for k in TTFT_HOPS)} |")
    if hop_rows:
        lines += ["Where time to first token went, ms, from the traces (to the gateway: client, "
                  "HTTP and auth; to the replica: routing and the gRPC hop; replica: queueing and "
                  "prefill up to its first token; to the client: the stream back):", "",
                  "| phase | request | " + " | ".join(TTFT_HOPS) + " |",
                  "|---|---|" + "---|" * len(TTFT_HOPS), *hop_rows, ""]
    for note in result.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


# ---- CPU taken by other work ------------------------------------------------------------------


@dataclass
class CpuMark:
    at: float  # unix seconds
    busy_s: float  # all CPUs: non-idle, non-iowait, non-steal seconds
    steal_s: float
    own_s: float  # this process and its descendants (the mesh, the trainer)
    others: dict[int, tuple[float, str]] = field(default_factory=dict)  # pid -> (CPU s, command)


def cpu_mark() -> CpuMark | None:
    try:
        import psutil
    except ImportError:
        return None
    t = psutil.cpu_times()
    busy = sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0) - getattr(t, "guest", 0.0) \
        - getattr(t, "guest_nice", 0.0)  # guest time is already counted in user/nice
    # children_*: descendants that exited and were reaped stay counted (in their reaper)
    own = 0.0
    me = psutil.Process()
    tree = [me, *me.children(recursive=True)]
    for p in tree:
        try:
            c = p.cpu_times()
            own += c.user + c.system + c.children_user + c.children_system
        except psutil.Error:
            pass
    mine = {p.pid for p in tree}
    others = {}
    for p in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        c = p.info["cpu_times"]
        if p.pid not in mine and c is not None:
            others[p.pid] = (c.user + c.system, " ".join(p.info["cmdline"] or [p.info["name"] or "?"])[:120])
    return CpuMark(time.time(), busy, getattr(t, "steal", 0.0), own, others)


def foreign_cpu(a: CpuMark | None, b: CpuMark | None) -> dict | None:
    """Cores' worth of CPU used by processes outside this bench between two marks (and stolen
    by the hypervisor). A descendant that exits in between is counted only once reaped."""
    if a is None or b is None or b.at <= a.at:
        return None
    wall = b.at - a.at
    # the busiest other processes: a process started since `a` counts from 0, one that ended
    # before `b` is missing (it still counts in other_cores)
    top = sorted(((cpu - a.others.get(pid, (0.0, ""))[0], cmd) for pid, (cpu, cmd) in b.others.items()),
                 reverse=True)[:3]
    return {"other_cores": max(0.0, (b.busy_s - a.busy_s) - (b.own_s - a.own_s)) / wall,
            "own_cores": (b.own_s - a.own_s) / wall, "steal_cores": (b.steal_s - a.steal_s) / wall,
            "cpus": os.cpu_count(), "window_s": wall,
            "top_other": [{"cores": round(d / wall, 2), "cmd": cmd} for d, cmd in top if d / wall >= 0.05]}


# ---- the run --------------------------------------------------------------------------------


@dataclass
class PolicyRun:
    policy: str
    log_path: Path
    popen: subprocess.Popen | None = None
    offset: int = 0  # metrics.jsonl bytes before this trainer started
    started_at: float = 0.0  # unix
    first_step_wait_s: float | None = None
    first_step_logged: bool = False
    startup_s: float | None = None  # trainer started -> its first step began
    window: tuple[float, float] | None = None  # unix seconds: the first step began -> SIGTERM
    steps: list[StepSeen] = field(default_factory=list)
    stop_s: float | None = None  # SIGTERM -> exit
    exit_code: int | None = None
    failed: str = ""
    cpu: dict | None = None

    @property
    def phase(self) -> str:
        return f"{self.policy}:training"

    def report(self) -> dict:
        return {"policy": self.policy, "steps": self.steps, "window": self.window,
                "first_step_wait_s": self.first_step_wait_s, "first_step_logged": self.first_step_logged,
                "startup_s": self.startup_s,
                "steps_total": len(self.steps), "stop_s": self.stop_s, "exit_code": self.exit_code,
                "failed": self.failed, "other_cpu": self.cpu, "trainer_log": str(self.log_path)}


@dataclass
class Bench:
    out: Path
    mesh: object  # launch.mesh.Mesh
    config_path: str
    overrides: list[str]
    users: int
    phase_s: float
    max_tokens: int
    policies: list[str]
    sim: Simulation | None = None
    runs: list[PolicyRun] = field(default_factory=list)
    failed: str = ""
    idle_cpu: dict | None = None
    timings: dict = field(default_factory=dict)
    marks: list[CpuMark] = field(default_factory=list)  # every few seconds: CPU use from any start

    def mark_at(self, t: float) -> CpuMark | None:
        return next((m for m in self.marks if m.at >= t), None)

    @property
    def metrics_path(self) -> Path:
        return self.out / RUN_ID / "metrics.jsonl"

    def say(self, msg: str) -> None:
        say(msg)

    def mesh_dead(self) -> str | None:
        for p in self.mesh.procs:
            if p.popen.poll() is not None:
                return (f"{p.name} died with exit code {p.popen.returncode}; last lines of "
                        f"{p.log_path}:\n{tail_log(p.log_path, 8)}")
        return None

    def trainer_command(self, policy: str) -> list[str]:
        sets = [*self.overrides, f"ppo.run_id={RUN_ID}", f"ppo.out_dir={self.out}",
                f"ppo.users_first={policy}", f"trainer.num_steps={ENDLESS_STEPS}", "ppo.train_budget_s=0",
                "ppo.run_budget_s=0", "ppo.eval_limit=0"]
        return [*hotloop_command(), "train", "ppo", "--config", self.config_path,
                "--run-dir", str(self.mesh.run_dir)] + [a for s in sets for a in ("--set", s)]

    def read_steps(self, run: PolicyRun) -> list[StepSeen]:
        """New complete step lines of this trainer (a half-written last line waits)."""
        if not self.metrics_path.exists():
            return []
        with open(self.metrics_path, "rb") as f:
            f.seek(run.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        run.offset += end
        new = parse_steps(chunk[:end].decode().splitlines(), time.time())
        run.steps.extend(new)
        return new

    # ---- phases ----

    async def run(self) -> None:
        cfg = SimConfig(users=self.users, duration_s=24 * 3600, max_tokens=self.max_tokens,
                        feedback=False, phase="warmup", progress_s=0)
        sim = self.sim = Simulation(self.mesh_target(), cfg, Brevity(), self.out / "requests.jsonl")
        users = asyncio.create_task(sim.run())
        try:
            t0 = time.monotonic()
            self.say(f"warm-up: each of {self.users} users' first answer (excluded)")
            while len(sim.records) < self.users and time.monotonic() - t0 < WARMUP_MAX_S:
                await self.tick(users)
            self.timings["warmup_s"] = time.monotonic() - t0
            await self.switch(users, "idle")
            mark = cpu_mark()
            await self.measure(users, "idle", None, time.time())
            await self.switch(users, "idle:after")
            self.idle_cpu = foreign_cpu(mark, cpu_mark())
            for policy in self.policies:
                run = PolicyRun(policy, self.mesh.run_dir / "logs" / f"trainer-{policy}.log")
                self.runs.append(run)
                await self.one_policy(users, run)
        finally:
            await sim.halt(users)

    def mesh_target(self):
        from launch.mesh import find_target

        return find_target(self.mesh.run_dir)

    async def tick(self, users: asyncio.Task, run: PolicyRun | None = None) -> None:
        """A second passes; the users, the mesh and this policy's trainer must still be alive."""
        await asyncio.wait({users}, timeout=1.0)
        if users.done():
            users.result()  # raises what stopped them
            raise RuntimeError("the simulated users stopped")
        if not self.marks or time.time() - self.marks[-1].at >= MARK_S:
            if (m := cpu_mark()) is not None:
                self.marks.append(m)
        if (why := self.mesh_dead()) is not None:
            raise RuntimeError(why)
        if run is not None and run.popen is not None and run.popen.poll() is not None and not run.failed:
            run.exit_code = run.popen.returncode
            run.failed = (f"the trainer exited with code {run.exit_code} during training; last lines "
                          f"of {run.log_path}:\n{tail_log(run.log_path, 8)}")
            self.say(run.failed)

    async def switch(self, users: asyncio.Task, phase: str, also: tuple[str, ...] = ()) -> None:
        """Start labelling new requests `phase`, then wait until no request of the previous
        phase (nor of the phases in `also`) is still streaming (bounded)."""
        old, self.sim.cfg.phase = {self.sim.cfg.phase, *also}, phase
        t0 = time.monotonic()
        while old & set(self.sim.in_flight.values()) and time.monotonic() - t0 < DRAIN_MAX_S:
            await asyncio.wait({users}, timeout=0.1)
            if users.done():
                users.result()

    async def measure(self, users: asyncio.Task, phase: str, run: PolicyRun | None, since: float) -> None:
        """Label new requests `phase` until `phase_s` after `since` (unix seconds)."""
        self.sim.cfg.phase = phase
        last = time.monotonic()
        while time.time() - since < self.phase_s:
            await self.tick(users, run)
            if run is not None:
                self.read_steps(run)
                if run.failed:
                    return
            if time.monotonic() - last >= PROGRESS_S:
                last = time.monotonic()
                self.progress(phase, since, run)

    def progress(self, phase: str, since: float, run: PolicyRun | None) -> None:
        now = time.time()
        recs = ([r for r in self.sim.records if r.phase == phase] if run is None
                else training_records(self.sim.records, run.policy, (since, now)))
        lat = latency(recs)
        t, i = lat["ttft_ms"], lat["itl_ms"]

        def f(x):
            return "-" if x is None else f"{x:.0f}"

        ppo = ""
        if run is not None:
            rate = ppo_rate(run.steps, since, now)
            ppo = f"  PPO steps {rate['ppo_steps']} ({rate['ppo_samples']} samples)"
        self.say(f"{phase} {now - since:3.0f}/{self.phase_s:g} s: {lat['requests']} requests "
                 f"({lat['errors']} errors), TTFT p50 {f(t['p50'])} p99 {f(t['p99'])} ms, "
                 f"ITL p50 {f(i['p50'])} ms{ppo}")

    async def one_policy(self, users: asyncio.Task, run: PolicyRun) -> None:
        from launch.mesh import MeshInfo

        await self.switch(users, f"{run.policy}:startup")
        run.offset = self.metrics_path.stat().st_size if self.metrics_path.exists() else 0
        env = {**os.environ, **MeshInfo.load(self.mesh.run_dir).env(), "PYTHONUNBUFFERED": "1"}
        self.say(f"{run.policy}: starting `hotloop train ppo` (users_first={run.policy}; log {run.log_path}); "
                 f"waiting for its first step (at most {FIRST_STEP_MAX_S:.0f} s)")
        run.started_at = time.time()
        with open(run.log_path, "ab") as f:
            run.popen = subprocess.Popen(self.trainer_command(run.policy), stdout=f, stderr=subprocess.STDOUT,
                                         env=env, cwd=REPO, start_new_session=True, preexec_fn=die_with_parent)
        try:
            t0, last = time.monotonic(), time.monotonic()
            while not run.steps and time.monotonic() - t0 < FIRST_STEP_MAX_S:
                await self.tick(users, run)
                if run.failed:
                    return
                self.read_steps(run)
                if time.monotonic() - last >= PROGRESS_S:
                    last = time.monotonic()
                    self.say(f"{run.policy}: waiting for the trainer's first step ({time.monotonic() - t0:.0f} s)")
            run.first_step_wait_s = time.monotonic() - t0
            run.first_step_logged = bool(run.steps)
            if run.steps:  # training began when the first step did; start-up is left out
                start = max(run.started_at, run.steps[0].seen_at - run.steps[0].seconds)
                run.startup_s = start - run.started_at
                self.say(f"{run.policy}: first step logged after {run.first_step_wait_s:.0f} s (start-up "
                         f"{run.startup_s:.0f} s, the step {run.steps[0].seconds:.0f} s); training counts "
                         f"from the step's start, measuring until {self.phase_s:g} s after it")
            else:
                start = time.time()
                self.say(f"{run.policy}: no step within {FIRST_STEP_MAX_S:.0f} s; measuring "
                         f"{self.phase_s:g} s anyway")
            await self.measure(users, run.phase, run, start)
            if run.failed:
                return
            # the measured requests (some labelled start-up: they began after the first step
            # did) finish beside training
            await self.switch(users, f"{run.policy}:stopping", also=(f"{run.policy}:startup",))
            self.read_steps(run)
            run.window = (start, time.time())
            run.cpu = foreign_cpu(self.mark_at(start), cpu_mark())
        finally:
            t = time.monotonic()
            await asyncio.to_thread(stop_trainer, run.popen)
            if run.exit_code is None:
                run.exit_code = run.popen.returncode
                run.stop_s = time.monotonic() - t
            self.read_steps(run)  # the checkpointing step may log after the window; not counted
        rate = ppo_rate(run.steps, *run.window) if run.window else None
        if rate:
            self.say(f"{run.policy}: trainer stopped in {run.stop_s:.1f} s (exit {run.exit_code}); "
                     f"{rate['ppo_steps']} steps, {rate['ppo_samples_per_s']:.3f} samples/s in the window"
                     + (f", {rate['paused_s']:.0f} s paused for users" if rate["paused_s"] else ""))


def stop_trainer(popen: subprocess.Popen | None) -> None:
    """SIGTERM (the trainer checkpoints and exits), then SIGKILL of its process group."""
    stop_process(popen, STOP_GRACE_S, lambda why: log.warning("the trainer: %s", why))


def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise ValueError(f"unknown users-first policies {unknown}; known: {', '.join(POLICIES)}")
    return list(dict.fromkeys(names))


def notes(bench: Bench, result: dict) -> list[str]:
    """What a reader should know before trusting the numbers."""
    out = []
    for name, cpu in [("idle", bench.idle_cpu), *((r.policy, r.cpu) for r in bench.runs)]:
        if cpu and cpu["other_cores"] > 0.25:
            top = "; ".join(f"{t['cores']:.2f} {t['cmd']}" for t in cpu.get("top_other", []))
            out.append(f"other work used {cpu['other_cores']:.2f} of {cpu['cpus']} cores during the {name} "
                       f"phase: its numbers are contaminated by a busy machine"
                       + (f" (busiest: {top})" if top else ""))
        if cpu and cpu["steal_cores"] > 0.1:
            out.append(f"the hypervisor stole {cpu['steal_cores']:.2f} cores during the {name} phase")
    for run in bench.runs:
        if run.window is None and not run.failed:
            out.append(f"{run.policy}: not measured to the end (the run was interrupted or stopped)")
        elif not run.first_step_logged and not run.failed:
            out.append(f"{run.policy}: no step was logged within {FIRST_STEP_MAX_S:.0f} s; its phase "
                       f"starts after that wait, not at the first step")
        if run.failed:
            out.append(f"{run.policy}: {run.failed.splitlines()[0]}")
        elif run.exit_code not in (0, 130, None):
            out.append(f"{run.policy}: the trainer exited with code {run.exit_code} after SIGTERM "
                       f"(see {run.log_path})")
    counts = [("idle", result["requests"]["idle"])] + [(n, p["requests"]) for n, p in result["policies"].items()]
    for name, n in counts:
        if n < MIN_REQUESTS:  # below ~200 a p99 is the slowest one or two requests
            out.append(f"{name}: {n} requests (fewer than {MIN_REQUESTS}): its p99 rests on its "
                       "few slowest requests; read its p95 beside it")
    for name, p in result["policies"].items():
        if p["ppo_steps"] == 1:
            out.append(f"{name}: PPO samples/s from one step of {p['step_s_median']:.0f} s")
    chosen = result["policies"].get(result["chosen"] or "")
    for name, p in result["policies"].items():
        # one run's p99 moves by more than this between repeats on a shared 2-core box
        if chosen and name != result["chosen"] and p["ttft_p99_ratio"] is not None \
                and p["ttft_p99_ratio"] <= chosen["ttft_p99_ratio"] * 1.1 \
                and p["ppo_samples_per_s"] > chosen["ppo_samples_per_s"]:
            out.append(f"{name} is within 10% of `{result['chosen']}`'s TTFT p99 ratio "
                       f"({p['ttft_p99_ratio']:.2f} vs {chosen['ttft_p99_ratio']:.2f}) with more PPO "
                       f"samples/s ({p['ppo_samples_per_s']:.3f} vs {chosen['ppo_samples_per_s']:.3f}): "
                       f"one run does not separate them")
    if result["chosen"] and result["chosen"] != result["default_policy"]:
        out.append(f"the measurement chose `{result['chosen']}`, the config's default is "
                   f"`{result['default_policy']}`")
    if bench.failed:
        out.append(f"the run stopped early: {bench.failed.splitlines()[0]}")
    return out


def main(args) -> int:
    """`hotloop bench joint`."""
    from launch import sections

    from launch.mesh import Mesh

    logging.basicConfig(level=os.environ.get("HOTLOOP_LOG_LEVEL", "WARNING"))
    try:
        policies = parse_policies(args.policies)
    except ValueError as e:
        print(f"bench joint: {e}", file=sys.stderr)
        return 2
    config_path = str(Path(args.config or DEFAULT_CONFIG).resolve())
    if not Path(config_path).exists():
        print(f"bench joint: no config at {config_path}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    out = (Path(args.out_dir) / time.strftime("bench-joint-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*args.set, f"run_dir={out / 'mesh'}"]
    loaded = sections.load(config_path, overrides)
    default_policy = loaded["ppo"].users_first
    mesh = Mesh(loaded.mesh, config_path, overrides, MESH_SERVICES, quiet=True, up=loaded["up"],
                rollout=loaded["rollout"])
    bench = Bench(out, mesh, config_path, list(args.set), args.users, args.phase_s, args.max_tokens, policies)
    say(f"starting the colocated mesh ({', '.join(MESH_SERVICES)}); run files under {out}; then "
        f"{args.users} users: idle {args.phase_s:g} s, then {args.phase_s:g} s beside PPO per policy "
        f"({', '.join(policies)})")
    try:
        with sigterm_interrupts():  # Mesh.start stops what started
            mesh.start()
    except KeyboardInterrupt:
        say("interrupted during start-up; stopped")
        return exit_code(interrupted=True)
    bench.timings["mesh_start_s"] = time.monotonic() - t_start
    bench.say(f"mesh up in {bench.timings['mesh_start_s']:.0f} s; gateway {mesh.info.gateway_url}")
    interrupted = False
    try:
        _, interrupted = run_interruptible(bench.run())
    except Exception as e:  # a dead mesh process or users: report what was measured
        bench.failed = str(e)
        bench.say(f"stopped: {e}")
    finally:
        for run in bench.runs:  # every exit path: no trainer left behind
            stop_trainer(run.popen)
        mesh.stop()
    records = bench.sim.records if bench.sim else []
    result = bench_summary(records, [r.report() for r in bench.runs], default_policy)
    result.update({
        "interrupted": interrupted, "failed": bench.failed,
        "other_cpu": {"idle": bench.idle_cpu, **{r.policy: r.cpu for r in bench.runs}},
        "seconds": time.monotonic() - t_start, "timings": bench.timings,
        "settings": {"config": config_path, "overrides": list(args.set), "users": args.users,
                     "phase_s": args.phase_s, "max_tokens": args.max_tokens, "policies": policies,
                     "run_dir": str(out)},
    })
    for p in result["policies"].values():
        p.pop("steps", None)
    # the mesh is stopped: every process flushed its spans
    hops = ttft_hops(read_trace_spans(sorted((out / "mesh" / "traces").glob("*.jsonl"))),
                     [{"response_id": r.response_id, "ts": r.ts, "ttft_ms": r.ttft_ms} for r in records])
    result["ttft_hops"] = {"idle": hop_figures(hops, [r for r in records if r.phase == "idle"]),
                           **{run.policy: hop_figures(hops, training_records(records, run.policy, run.window))
                              for run in bench.runs}}
    result["notes"] = notes(bench, result)
    report(result, args.json, table=markdown(result), markdown=True, run_dir=out, name="joint",
           say=say)
    aim = result["aim"]
    say(f"aim (TTFT p99 <= {TTFT_P99_AIM:g}x idle, ITL p99 <= {ITL_P99_AIM:g}x, PPO samples/s > 0) with {result['training_policy']}: "
        f"{'MET' if aim['met'] else 'NOT MET (' + aim['why_not'] + ')'}; {result['seconds']:.0f} s in all")
    return exit_code(interrupted, bench.failed)
