"""`hotloop demo` (`make demo`): start the mesh, run the GRPO demo, write the report, stop.

Everything runs on embedded defaults: a local NATS server, the services as local
processes, the small CPU model. The report lands under `runs/<run id>/`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from launch.jobs import load_job
from services.trainer.runner import run_job

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"


def main(args) -> int:
    from hotloop.service import run_interruptible

    from launch.mesh import Mesh
    from launch.processes import sigterm_interrupts

    logging.basicConfig(level=os.environ.get("HOTLOOP_LOG_LEVEL", "WARNING"))
    config_path = args.config or str(DEFAULT_CONFIG)
    mesh_cfg, _, _ = load_job(config_path, args.set, "grpo")  # every section checked, first
    mesh = Mesh(mesh_cfg, config_path, args.set, ["reference", "reward", "rollout"])
    print("[demo] starting the mesh (NATS, reference, reward, rollout with vLLM)...", flush=True)
    t0 = time.monotonic()
    with sigterm_interrupts(), mesh:  # SIGTERM during start-up stops the mesh, like Ctrl-C
        mesh_cfg, job, trainer_cfg = load_job(config_path, args.set, "grpo", mesh.info)
        if not job.run_id:  # fixed here so that an interrupted run can name itself for resume
            job = job.model_copy(update={"run_id": time.strftime("%Y%m%d-%H%M%S")})
        if job.run_budget_s:  # the demo's bound: its mesh's start counts against it
            job = job.model_copy(update={"run_budget_s": max(1.0, job.run_budget_s - (time.monotonic() - t0))})

        print(f"[demo] GRPO: {trainer_cfg.num_steps} steps x {trainer_cfg.batch_prompts} prompts x "
              f"{trainer_cfg.group_size} samples; held-out eval before and after", flush=True)
        result, interrupted = run_interruptible(
            run_job(mesh_cfg, job, trainer_cfg, Path(config_path).read_text()))
        if interrupted:
            print("[demo] interrupted; stopping the mesh. Resume with:\n"
                  f"  hotloop demo --set grpo.run_id={job.run_id}", flush=True)
            return 130
        summary, report = result
    h = summary["heldout"]
    print(f"[demo] held-out pass@1: base {h['pass_at_1_base']:.3f} -> final {h['pass_at_1_final']:.3f} "
          f"({h['tasks']} tasks); {summary['samples_per_s']:.2f} samples/s")
    for name, p in h.get("paired", {}).items():
        lo, hi = p["ci95"]
        print(f"[demo] paired {name} pass@1: {p['diff'] * 100:+.1f} points, 95% CI "
              f"[{lo * 100:+.1f}, {hi * 100:+.1f}] ({'significant' if p['significant'] else 'not significant'})")
    print("[demo] stage share: " + ", ".join(f"{k} {v:.0%}" for k, v in summary["stage_share"].items()))
    print(f"[demo] report: {report}")
    return 0
