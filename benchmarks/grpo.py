"""`hotloop bench grpo`: GRPO samples/s, seconds per stage and how much of the cores sat idle,
synchronous against asynchronous, on the demo configuration in one run; `--peer trl` adds
TRL's GRPOTrainer on the same configuration; `--replicas N` runs N processes of each service
and reports each replica's share of the work and whether any was lost or done twice.

Owns:
- the run: the mesh (NATS, reference, reward, rollout; `launch.mesh.Mesh`), then in this
  process `--steps` steps of the synchronous recipe (`grpo.run`, `max_staleness = 0`) and as
  many of the asynchronous one (`grpo_async.run`), each from a fresh policy on the same tasks,
  with no evaluation; then the mesh stops and, with `--peer trl`, TRL's GRPOTrainer runs a few
  steps in a process of its own (grpo_trl.py) on the machine alone, as hotloop had it;
- with `--replicas N`: N rollout, reference and reward processes (`[up] replicas`), which the
  recipes spread their stages over (hotloop/replicas.py); `replicas` gives each replica's share
  of its service's work from the services' own Prometheus counters (before and after the
  steps), and `work` sets what each service counted against what the job consumed: `lost`
  (consumed more than the services did) and `duplicated` (the services did more than was
  consumed), both 0 when each sample was generated, scored and referenced exactly once;
- the figures, with their methods in the JSON: samples/s from the median wall time of a step
  after the first (the first carries start-up and, asynchronous, the pipeline's fill; the
  whole-run rate is reported beside it); seconds per stage (medians); the idle share from CPU
  accounting (below); per-sample reward curves; the ratios and the issue's aims;
- stopping: the mesh and the peer are stopped on every exit path, Ctrl-C and SIGTERM included.

The idle share is CPU accounting, not traces: psutil samples the CPU time of this process and
all its descendants (the trainer, the mesh's services, the engine, the sandboxes; reaped
children included) every half second, and the idle share of a window is 1 - that CPU time /
(window x cores). Per stage, the windows are the stages' spans (this process's traces), so a
stage's idle share says how much of the cores nothing of the run used while it ran; stages
overlap in the asynchronous run. Threads that spin while waiting (OpenMP) count as busy, so
this under-states idleness rather than over-stating it. The machine-wide share (all processes)
is reported beside it, since other work on a shared machine takes cores the run could not use.

Does not own: the recipes, the services, TRL's side (grpo_trl.py). The summarizing
functions are pure, for tests.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import (
    exit_code,
    report,
    run_interruptible,
    say_as,
    sigterm_interrupts,
    stop_process,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "demo.toml"
MESH_SERVICES = ["reference", "reward", "rollout"]
CPU_SAMPLE_S = 0.5
STAGES = ("generate", "score", "reference", "train", "publish", "wait")
IDLE_AIM, ASYNC_AIM, PEER_AIM = 0.10, 1.3, 3.0  # the issue's aims
PEER_STOP_GRACE_S = 10.0
SAMPLES_PER_S_METHOD = ("samples per step / the median wall time of the steps between the first (start-up, "
                        "the pipeline's fill) and the last (the drain: nothing is produced beside it) when "
                        "there are 3 or more (a step's wall time: from the previous step's end to its own; "
                        "the first step's from its start); samples_per_s_all: every step's samples / first "
                        "start -> last end")
IDLE_METHOD = ("CPU accounting (psutil, every 0.5 s): 1 - CPU seconds of this process and all its "
               "descendants (trainer, mesh services, engine, sandboxes) / (wall seconds x cores), over the "
               "same steps as samples_per_s; per stage over the stage's spans; spin-waiting threads count "
               "as busy. machine_idle_share: the same from all processes (psutil.cpu_times)")
log = logging.getLogger(__name__)
say = say_as("grpo")


# ---- pure: CPU windows, steps, figures ---------------------------------------------------------


@dataclass
class CpuSample:
    at: float  # unix seconds
    own_s: float  # CPU seconds of the run's process tree
    busy_s: float  # CPU seconds of the whole machine


def cpu_at(samples: list[CpuSample], t: float) -> tuple[float, float]:
    """(own, busy) CPU seconds at unix time t, interpolated between samples (clamped)."""
    if not samples:
        return 0.0, 0.0
    if t <= samples[0].at:
        return samples[0].own_s, samples[0].busy_s
    for a, b in zip(samples, samples[1:]):
        if a.at <= t <= b.at:
            f = (t - a.at) / (b.at - a.at) if b.at > a.at else 0.0
            return a.own_s + f * (b.own_s - a.own_s), a.busy_s + f * (b.busy_s - a.busy_s)
    return samples[-1].own_s, samples[-1].busy_s


def idle(samples: list[CpuSample], windows: list[tuple[float, float]], cpus: int) -> dict:
    """Idle share of `cpus` cores over the union of (non-overlapping) windows."""
    wall = own = busy = 0.0
    for t0, t1 in windows:
        if t1 <= t0:
            continue
        (o0, b0), (o1, b1) = cpu_at(samples, t0), cpu_at(samples, t1)
        wall, own, busy = wall + (t1 - t0), own + (o1 - o0), busy + (b1 - b0)
    if wall <= 0:
        return {"idle_share": None, "machine_idle_share": None, "own_cores": None, "other_cores": None,
                "seconds": 0.0}
    return {"idle_share": max(0.0, 1 - own / (wall * cpus)),
            "machine_idle_share": max(0.0, 1 - busy / (wall * cpus)),
            "own_cores": own / wall, "other_cores": max(0.0, busy - own) / wall, "seconds": wall}


def merge(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of windows as sorted, disjoint windows."""
    out: list[list[float]] = []
    for a, b in sorted(windows):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


@dataclass
class StepSeen:
    """One step as the bench saw it (`on_step`)."""

    step: int
    end: float  # unix seconds
    wall_s: float  # previous step's end -> this end (the first: its start -> end)
    stage_seconds: dict[str, float]
    reward_mean: float
    samples: int
    skipped: bool = False
    staleness_max: float = 0.0
    tokens: int = 0  # completion tokens of the step's batch
    trained: int = 0  # samples trained on (kept), which are the ones the reference scored


def phase_figures(steps: list[StepSeen], samples: list[CpuSample], spans: list[tuple[str, float, float]],
                  cpus: int) -> dict:
    """samples/s, stage seconds, idle shares and the reward curve of one mode's steps.
    spans: (name, start, end) in unix seconds."""
    if not steps:
        return {"samples_per_s": 0.0, "idle_share": None, "stage_seconds": {}, "steps": 0}
    # the steady state: not the first step (start-up; asynchronous, the pipeline's fill) nor,
    # from 3 steps on, the last (asynchronous, nothing is produced beside it: the drain)
    steady = steps[1:-1] if len(steps) >= 3 else steps[1:] or steps
    per_step = steps[0].samples
    start, end = steps[0].end - steps[0].wall_s, steps[-1].end
    window = [(steady[0].end - steady[0].wall_s, steady[-1].end)]  # the steps samples_per_s rests on
    total = idle(samples, [(start, end)], cpus)
    inside = [(n, a, b) for n, a, b in spans if a >= start - 1.0 and b <= end + 1.0]
    stage_idle = {}
    for name in STAGES:
        ws = merge([(a, b) for n, a, b in inside if n == name])
        if ws:
            stage_idle[name] = idle(samples, ws, cpus)["idle_share"]
    stage_seconds = {}
    for name in STAGES:
        vals = [s.stage_seconds[name] for s in steps if name in s.stage_seconds]
        if vals:
            stage_seconds[name] = statistics.median(vals)
    figs = idle(samples, window, cpus)
    rewards = [s.reward_mean for s in steps]
    return {
        "samples_per_s": per_step / statistics.median(s.wall_s for s in steady),
        "samples_per_s_all": len(steps) * per_step / (end - start) if end > start else 0.0,
        "idle_share": figs["idle_share"],
        "machine_idle_share": figs["machine_idle_share"],
        "own_cores": figs["own_cores"], "other_cores": figs["other_cores"],
        "idle_share_all_steps": total["idle_share"],
        "stage_seconds": stage_seconds,
        "stage_idle_share": stage_idle,
        "step_seconds": [s.wall_s for s in steps],
        "steps": len(steps),
        "samples_per_step": per_step,
        "skipped_steps": sum(s.skipped for s in steps),
        "staleness_max": max(s.staleness_max for s in steps),
        "reward_curve": [{"samples": per_step * (i + 1), "reward_mean": r} for i, r in enumerate(rewards)],
        "reward_mean": statistics.fmean(rewards),
        "reward_sem": statistics.stdev(rewards) / len(rewards) ** 0.5 if len(rewards) > 1 else None,
    }


def compare(sync: dict, asyn: dict, peer: dict | None) -> dict:
    """Ratios and the issue's aims, all from this run."""
    ratio = asyn["samples_per_s"] / sync["samples_per_s"] if sync.get("samples_per_s") else None
    out = {
        "async_vs_sync": ratio,
        "async_vs_sync_all": (asyn.get("samples_per_s_all", 0.0) / sync["samples_per_s_all"]
                              if sync.get("samples_per_s_all") else None),
        "aims": {
            "async_idle_share_below": IDLE_AIM,
            "async_idle_share_met": asyn.get("idle_share") is not None and asyn["idle_share"] < IDLE_AIM,
            "async_vs_sync_at_least": ASYNC_AIM,
            "async_vs_sync_met": ratio is not None and ratio >= ASYNC_AIM,
        },
    }
    # the per-sample learning curves: within noise when the mean rewards differ by less than
    # twice their combined standard error (a few steps resolve only large differences)
    if sync.get("reward_sem") is not None and asyn.get("reward_sem") is not None:
        diff = asyn["reward_mean"] - sync["reward_mean"]
        se = (sync["reward_sem"] ** 2 + asyn["reward_sem"] ** 2) ** 0.5
        out["reward_diff"] = diff
        out["reward_diff_se"] = se
        out["aims"]["learning_within_noise"] = abs(diff) <= 2 * se
    if peer and peer.get("samples_per_s"):
        best = max(sync.get("samples_per_s", 0.0), asyn.get("samples_per_s", 0.0))
        out["vs_peer"] = {"sync": sync.get("samples_per_s", 0.0) / peer["samples_per_s"],
                          "async": asyn.get("samples_per_s", 0.0) / peer["samples_per_s"]}
        out["aims"]["vs_peer_at_least"] = PEER_AIM
        out["aims"]["vs_peer_met"] = best / peer["samples_per_s"] >= PEER_AIM
    return out


# What each replicated service counts of its work, and in what unit: (counter, labels, unit).
WORK = {"rollout": ("hotloop_rollout_generated_tokens_total", {}, "tokens"),
        "reference": ("hotloop_reference_requests_total", {"result": "scored"}, "samples"),
        "reward": ("hotloop_reward_samples_total", {}, "samples")}
WORK_METHOD = ("each replica's counter (rollout: hotloop_rollout_generated_tokens_total; reference: "
               "hotloop_reference_requests_total{result=scored}; reward: hotloop_reward_samples_total) "
               "scraped from its /metrics before and after the steps; share: its part of its service's "
               "increase. work: each service's increase against what the job consumed (rollout: the "
               "batches' completion tokens; reference: the samples trained on, when kl_beta > 0; "
               "reward: every sample); lost: consumed - counted when positive, duplicated: counted - "
               "consumed when positive, in the service's unit; the top-level figures are their sums")


def replica_of(process: str) -> tuple[str, int]:
    """`reward-1` -> ("reward", 1): a process's service and its index among the replicas
    (`launch.mesh.Mesh` names them so)."""
    service, _, index = process.rpartition("-")
    return (service, int(index)) if service and index.isdigit() else (process, 0)


def replica_shares(before: dict[str, float], after: dict[str, float],
                   endpoints: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Each replica's part of its service's work between two scrapes (by process name), in
    replica order: {service: [{process, address, work, share}]}."""
    out: dict[str, list[dict]] = {}
    for process in sorted(after, key=replica_of):
        service, index = replica_of(process)
        if service not in WORK:
            continue
        work = after[process] - before.get(process, 0.0)
        address = endpoints.get(service, [])[index] if index < len(endpoints.get(service, [])) else ""
        out.setdefault(service, []).append({"process": process, "address": address, "work": work})
    for reps in out.values():
        total = sum(r["work"] for r in reps)
        for r in reps:
            r["share"] = r["work"] / total if total > 0 else None
    return {service: out[service] for service in WORK if service in out}


def work_accounting(replicas: dict[str, list[dict]], steps: list[StepSeen], kl: bool) -> dict:
    """What each service counted against what the job consumed (`WORK_METHOD`)."""
    consumed = {"rollout": sum(s.tokens for s in steps), "reward": sum(s.samples for s in steps),
                "reference": sum(s.trained for s in steps) if kl else 0}
    out = {}
    for service, reps in replicas.items():
        counted = sum(r["work"] for r in reps)
        out[service] = {"unit": WORK[service][2], "consumed": consumed[service], "counted": counted,
                        "lost": max(0.0, consumed[service] - counted),
                        "duplicated": max(0.0, counted - consumed[service])}
    return out


def scrape_work(metrics: dict[str, str]) -> dict[str, float]:
    """Each replicated service's work counter now, by process name (`MeshInfo.metrics`)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for process, url in metrics.items():
        service, _ = replica_of(process)
        if service not in WORK:
            continue
        name, labels, _ = WORK[service]
        text = httpx.get(url, timeout=10).text
        out[process] = sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                           if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
    return out


def markdown(result: dict) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    rows = ["| mode | samples/s | (all steps) | idle share | machine idle | "
            + " | ".join(STAGES) + " | staleness |",
            "|---|---|---|---|---|" + "---|" * len(STAGES) + "---|"]
    for name in ("sync", "async"):
        p = result.get(name)
        if not p or not p.get("steps"):
            continue
        st = p["stage_seconds"]
        rows.append(f"| {name} | {f(p['samples_per_s'], '.3f')} | {f(p.get('samples_per_s_all'), '.3f')} | "
                    f"{f(p['idle_share'], '.1%')} | {f(p.get('machine_idle_share'), '.1%')} | "
                    + " | ".join(f(st.get(s), ".1f") for s in STAGES) + f" | {p.get('staleness_max', 0):g} |")
    lines = ["# hotloop bench grpo", "", *rows, ""]
    idle_rows = ["| mode | " + " | ".join(STAGES) + " |", "|---|" + "---|" * len(STAGES)]
    for name in ("sync", "async"):
        p = result.get(name)
        if p and p.get("steps"):
            idle_rows.append(f"| {name} | " + " | ".join(f(p["stage_idle_share"].get(s), ".0%")
                                                      for s in STAGES) + " |")
    lines += ["Idle share of the cores while each stage ran (stages overlap when asynchronous):", "",
              *idle_rows, ""]
    if peer := result.get("peer"):
        lines.append(f"Peer: {peer.get('name')}: {f(peer.get('samples_per_s'), '.3f')} samples/s"
                     + (f" ({peer['error']})" if peer.get("error") else ""))
    c = result.get("comparison", {})
    aims = c.get("aims", {})
    lines.append(f"async / sync: {f(c.get('async_vs_sync'))}x (aim >= {ASYNC_AIM}x: "
                 f"{'met' if aims.get('async_vs_sync_met') else 'not met'}); async idle share "
                 f"{f(result.get('async', {}).get('idle_share'), '.1%')} (aim < {IDLE_AIM:.0%}: "
                 f"{'met' if aims.get('async_idle_share_met') else 'not met'})")
    if "vs_peer" in c:
        lines.append(f"vs peer: sync {c['vs_peer']['sync']:.2f}x, async {c['vs_peer']['async']:.2f}x "
                     f"(aim >= {PEER_AIM}x: {'met' if aims.get('vs_peer_met') else 'not met'})")
    if "reward_diff" in c:
        lines.append(f"mean training reward async - sync: {c['reward_diff']:+.3f} ± {c['reward_diff_se']:.3f} "
                     f"(SE; {'within' if aims.get('learning_within_noise') else 'outside'} 2 SE)")
    if result.get("replicas"):
        lines += ["", "| service | replica | share | work | unit |", "|---|---|---|---|---|"]
        for service, reps in result["replicas"].items():
            unit = result.get("work", {}).get(service, {}).get("unit", "")
            lines += [f"| {service} | {r['address']} | {f(r['share'], '.0%')} | {r['work']:g} | {unit} |"
                      for r in reps]
        lines.append(f"lost: {result.get('lost', 0):g}, duplicated: {result.get('duplicated', 0):g} "
                     f"(" + "; ".join(f"{s}: {w['counted']:g} of {w['consumed']:g} {w['unit']}"
                                      for s, w in result.get("work", {}).items()) + ")")
    lines += ["", f"samples/s: {SAMPLES_PER_S_METHOD}.", f"idle share: {IDLE_METHOD}."]
    for note in result.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


# ---- CPU accounting ------------------------------------------------------------------------------


class CpuSampler(threading.Thread):
    """Samples this process tree's and the machine's CPU seconds every `every` seconds."""

    def __init__(self, every: float = CPU_SAMPLE_S) -> None:
        super().__init__(daemon=True, name="cpu-sampler")
        self.every, self.samples = every, []
        self._halt = threading.Event()  # not `_stop`: threading.Thread has a method of that name

    def sample(self) -> CpuSample:
        import psutil

        t = psutil.cpu_times()
        busy = (sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "steal", 0.0)
                - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0))  # guest is in user
        me = psutil.Process()
        own = 0.0
        for p in [me, *me.children(recursive=True)]:
            try:
                c = p.cpu_times()
                own += c.user + c.system + c.children_user + c.children_system
            except psutil.Error:
                pass
        return CpuSample(time.time(), own, busy)

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append(self.sample())
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(5)
        self.samples.append(self.sample())


# ---- the run --------------------------------------------------------------------------------------


@dataclass
class Bench:
    out: Path
    steps: int
    max_staleness: int
    samples_per_step: int
    say: object
    seen: dict[str, list[StepSeen]] = field(default_factory=dict)
    failed: str = ""

    def on_step(self, mode: str):
        runs = self.seen.setdefault(mode, [])

        def on_step(rec) -> None:
            now = time.time()
            secs = dict(rec.stage_seconds)
            if runs:
                wall = now - runs[-1].end
            else:  # sync: the stages are the step; async: the recipe measured its first step
                wall = rec.train.get("step_wall_s") or sum(v for k, v in secs.items() if k != "wait")
            runs.append(StepSeen(rec.step, now, wall, secs, rec.reward_mean, self.samples_per_step,
                                 rec.skipped, float(rec.train.get("staleness_max", 0.0)), rec.tokens,
                                 int(rec.train.get("trained_samples", 0))))
            self.say(f"{mode} step {rec.step}/{self.steps}: {wall:.1f} s ("
                     + ", ".join(f"{k} {v:.1f}" for k, v in secs.items()) + f"), reward {rec.reward_mean:.2f}"
                     + (f", staleness {rec.train.get('staleness_max', 0):g}" if mode == "async" else ""))

        return on_step

    async def run(self, mesh_cfg, trainer_cfg, job, model_dir: Path) -> None:
        from hotloop.replicas import Rewards, Rollouts

        from services.trainer.recipes import grpo, grpo_async
        from services.trainer.runner import open_edge

        ep = mesh_cfg.endpoints
        edge = await open_edge(mesh_cfg, trainer_cfg, self.out / "trainer", "grpo")
        mesh = grpo.Mesh(rollout=Rollouts.connect(ep.rollout), reward=Rewards.connect(ep.reward),
                         reference=edge.reference, publisher=edge.publisher)
        try:
            for mode, staleness in (("sync", 0), ("async", self.max_staleness)):
                j = job.model_copy(update={"max_staleness": staleness, "run_id": mode})
                self.say(f"{mode}: {self.steps} steps (max_staleness {staleness}); loading the policy")
                await grpo_async.recipe(j)(j, trainer_cfg, model_dir, mesh, self.out / mode, progress=False,
                                           on_step=self.on_step(mode))
        finally:
            await mesh.rollout.close()
            await mesh.reward.close()
            await edge.close()


def run_peer(out: Path, model_dir: Path, steps: int, threads: int | None, reward: str, say,
             stop: Sequence[str] = ()) -> dict:
    """TRL's GRPOTrainer in its own process, scored by the reward service at `reward`; its
    figure, or why there is none."""
    path = out / "peer-trl.json"
    log_path = out / "peer-trl.log"
    cmd = [sys.executable, "-m", "benchmarks.grpo_trl", "--model", str(model_dir),
           "--steps", str(steps), "--reward", reward, "--json", str(path)] \
        + (["--threads", str(threads)] if threads else []) \
        + [a for s in stop for a in ("--stop", s)]
    say(f"peer: TRL GRPOTrainer, {steps} steps of the same configuration (log {log_path})")
    popen = None
    try:
        with open(log_path, "wb") as f:
            popen = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                     start_new_session=True)
        last = 0
        while popen.poll() is None:
            time.sleep(2)
            # tqdm's carriage returns share a line with the peer's own progress lines
            lines = [ln[ln.index("[trl]") + 6:] for ln in log_path.read_text(errors="replace").splitlines()
                     if "[trl]" in ln]
            for ln in lines[last:]:
                say(f"peer: {ln}")
            last = len(lines)
    finally:
        stop_process(popen, PEER_STOP_GRACE_S, say)
    from benchmarks.grpo_trl import INSTALL_HINT, MISSING_TRL

    if popen.returncode == MISSING_TRL:
        say(f"peer: {INSTALL_HINT}")
        return {"name": "trl", "samples_per_s": None, "error": INSTALL_HINT}
    if popen.returncode != 0 or not path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-5:])
        return {"name": "trl", "samples_per_s": None,
                "error": f"the TRL run exited with code {popen.returncode}; see {log_path}: {tail}"}
    return json.loads(path.read_text())


def notes(result: dict, cpus: int) -> list[str]:
    out = []
    for name in ("sync", "async"):
        p = result.get(name) or {}
        if p.get("other_cores") is not None and p["other_cores"] > 0.25:
            out.append(f"other work used {p['other_cores']:.2f} of {cpus} cores during the {name} steps: "
                       f"both its rate and its idle share are contaminated by a busy machine")
        if p.get("steps", 0) < 3:
            out.append(f"{name}: {p.get('steps', 0)} steps; its median rests on "
                       f"{max(0, p.get('steps', 0) - 1) or 1} step(s)")
    if result.get("sync", {}).get("steps") and result.get("async", {}).get("steps", 0) \
            and result["async"].get("reward_sem") is not None:
        out.append("learning curves from a few steps resolve only large differences in reward")
    return out


def main(args) -> int:
    """`hotloop bench grpo`."""
    import httpx

    from hotloop import config, models, telemetry
    from hotloop.config import TelemetryConfig

    from launch.jobs import load_job
    from launch.mesh import Mesh

    logging.basicConfig(level=os.environ.get("HOTLOOP_LOG_LEVEL", "WARNING"))
    if args.steps < 2:
        print("bench grpo: --steps must be at least 2 (the first step is start-up)", file=sys.stderr)
        return 2
    config_path = str(Path(args.config or DEFAULT_CONFIG).resolve())
    t_start = time.monotonic()
    out = (Path(args.out_dir) / time.strftime("bench-grpo-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "no-heldout.jsonl").write_text("")  # the bench evaluates nothing
    replicated = [f"up.replicas.{s}={args.replicas}" for s in MESH_SERVICES] if args.replicas > 1 else []
    overrides = [*args.set, *replicated, f"run_dir={out / 'mesh'}", f"trainer.num_steps={args.steps}",
                 "grpo.train_budget_s=0", "grpo.run_budget_s=0", f"grpo.eval_tasks={out / 'no-heldout.jsonl'}",
                 "grpo.eval_split=all", f"grpo.out_dir={out}"]

    mesh_cfg, job, trainer_cfg = load_job(config_path, overrides, "grpo")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    mesh = Mesh(mesh_cfg, config_path, overrides, MESH_SERVICES, quiet=True)
    # every sample counts, trained or not (skipped uniform groups too): what each recipe produced
    bench = Bench(out, args.steps, args.max_staleness, trainer_cfg.batch_prompts * trainer_cfg.group_size, say)
    say(f"{trainer_cfg.batch_prompts} prompts x {trainer_cfg.group_size} samples x {trainer_cfg.max_new_tokens} "
        f"tokens{f' (stop {job.stop!r})' if job.stop else ''}, {args.steps} steps sync then {args.steps} async "
        f"(max_staleness {args.max_staleness})"
        + (", then TRL's GRPOTrainer" if args.peer else "") + f"; run files under {out}")
    sampler = CpuSampler()
    interrupted = False
    shares: dict = {}
    try:
        say("starting the mesh (NATS, reference, reward, rollout)")
        with sigterm_interrupts(), mesh:
            mesh_cfg = mesh.info.apply(mesh_cfg)
            say(f"mesh up in {time.monotonic() - t_start:.0f} s")
            telemetry.setup("trainer", TelemetryConfig(exporter="memory"))
            sampler.start()
            work_before = scrape_work(mesh.info.metrics)
            try:
                _, interrupted = run_interruptible(
                    bench.run(mesh_cfg, trainer_cfg, job, models.resolve(mesh_cfg.model.name)))
            except Exception as e:  # report what was measured
                bench.failed = f"{type(e).__name__}: {e}"
                say(f"stopped: {bench.failed}")
            try:
                shares = replica_shares(work_before, scrape_work(mesh.info.metrics),
                                        mesh_cfg.endpoints.model_dump())
            except httpx.HTTPError as e:  # a replica that died took its counters with it
                say(f"the replicas' work is not measured: {e!r}")
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted; the mesh is stopped")
    finally:
        sampler.stop()
    spans = [(s.name, s.start_time / 1e9, s.end_time / 1e9) for s in telemetry.memory_spans()]
    result: dict = {
        name: phase_figures(bench.seen.get(name, []), sampler.samples, spans, cpus) for name in ("sync", "async")
    }
    peer = None
    if args.peer == "trl" and not interrupted:
        try:
            # the reward service alone (idle, it takes no CPU): TRL has the machine as hotloop had
            say("peer: starting the reward service alone")
            peer_overrides = [*args.set, f"run_dir={out / 'peer-mesh'}"]
            with sigterm_interrupts(), Mesh(config.load_mesh(config.raw_config(config_path, peer_overrides)),
                                            config_path, peer_overrides, ["reward"], quiet=True) as reward_mesh:
                reward = reward_mesh.info.endpoints["reward"]
                peer = run_peer(out, models.resolve(mesh_cfg.model.name), args.peer_steps,
                                trainer_cfg.torch_threads, reward if isinstance(reward, str) else reward[0],
                                say, stop=job.stop)
        except KeyboardInterrupt:
            interrupted = True
        if peer is not None:
            result["peer"] = {"name": peer.get("name", "trl"), "samples_per_s": peer.get("samples_per_s"),
                              **{k: v for k, v in peer.items() if k not in ("name", "samples_per_s")}}
    result["comparison"] = compare(result["sync"], result["async"], result.get("peer"))
    if shares:
        every_step = [s for mode in ("sync", "async") for s in bench.seen.get(mode, [])]
        result["replicas"] = shares
        result["work"] = work_accounting(shares, every_step, trainer_cfg.loss.kl_beta > 0)
        result["lost"] = sum(w["lost"] for w in result["work"].values())
        result["duplicated"] = sum(w["duplicated"] for w in result["work"].values())
    result["samples_per_s"] = {mode: result[mode].get("samples_per_s") for mode in ("sync", "async")}
    result["methods"] = {"samples_per_s": SAMPLES_PER_S_METHOD, "idle_share": IDLE_METHOD, "replicas": WORK_METHOD}
    result.update({
        "interrupted": interrupted, "failed": bench.failed, "cpus": cpus,
        "seconds": time.monotonic() - t_start,
        "settings": {"config": config_path, "overrides": list(args.set), "steps": args.steps,
                     "replicas": args.replicas,
                     "max_staleness": args.max_staleness, "peer": args.peer, "peer_steps": args.peer_steps,
                     "batch_prompts": trainer_cfg.batch_prompts, "group_size": trainer_cfg.group_size,
                     "max_new_tokens": trainer_cfg.max_new_tokens, "stop": job.stop,
                     "lora_r": trainer_cfg.lora.r,
                     "lr": trainer_cfg.optimizer.lr, "kl_beta": trainer_cfg.loss.kl_beta,
                     "dtype": trainer_cfg.dtype, "torch_threads": trainer_cfg.torch_threads,
                     "run_dir": str(out)},
    })
    result["notes"] = notes(result, cpus)
    report(result, args.json, table=markdown(result), markdown=True, run_dir=out, name="grpo",
           say=say)
    return exit_code(interrupted, bench.failed)
