"""`hotloop train <recipe>` (every recipe the trainer's registry lists: `grpo`, `ppo`,
`online`, ...) and `hotloop eval`: jobs against a running mesh (`hotloop up`).

The CLI (apps/cli.py) imports these bodies when a command runs. A job gets the running mesh's
addresses as a typed `MeshConfig` (`MeshInfo.apply`), never through the environment.
`online` learns from the feedback users give through the gateway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

from launch.jobs import load_job, load_job_report, running_mesh


def train(args) -> int:
    """`hotloop train <recipe>`: the registered recipe `args.algorithm`, as its entry says it
    runs (`services.trainer.recipes.registry`)."""
    from hotloop.threads import pin_configured
    from services.trainer.recipes.registry import recipe

    logging.basicConfig(level=os.environ.get("HOTLOOP_LOG_LEVEL", "WARNING"))
    entry = recipe(args.algorithm)
    # the file first
    mesh_cfg, job, trainer_cfg, report = load_job_report(args.config, args.set, args.algorithm)
    info = running_mesh(args.run_dir or mesh_cfg.run_dir)
    if info is None:
        return 2
    mesh_cfg = info.apply(mesh_cfg)
    if entry.kind == "online":
        from hotloop.service import run_interruptible
        from services.trainer.runner import run_online_job

        online_job = job
        pin_configured(trainer_cfg.cpus, "trainer")  # on a core where vLLM spins, <1% of it
        summary, interrupted = run_interruptible(run_online_job(mesh_cfg, online_job, trainer_cfg,
                                                                report))
        if interrupted:  # nothing to save: un-acked feedback is redelivered to the next run
            print(f"online: stopped; resume with --set online.run_id={online_job.run_id}")
            return 130
        for tenant, one in (summary["tenants"].items() if "tenants" in summary
                            else [(online_job.tenant, summary)]):
            print(f"online{f' [{tenant}]' if tenant else ''}: {one['updates']} updates, "
                  f"version {one['version']}, counters {one['counters']}")
        return 0
    from hotloop.service import run_interruptible
    from services.trainer.runner import run_job

    pin_configured(trainer_cfg.cpus, "trainer")
    if not job.run_id:  # named here, so that the resume line below can say it
        job = job.model_copy(update={"run_id": entry.run_prefix + time.strftime("%Y%m%d-%H%M%S")})
    text = Path(args.config).read_text() if args.config else ""
    result, interrupted = run_interruptible(
        run_job(mesh_cfg, job, trainer_cfg, text, recipe=args.algorithm, report=report))
    if interrupted:
        print(f"{args.algorithm}: stopped; checkpoint under {job.out_dir}/{job.run_id}/checkpoints. "
              f"Resume: the same command with --set {args.algorithm}.run_id={job.run_id}")
        return 130
    summary, report = result
    print(f"report: {report}")
    return 0


def evaluate(args) -> int:
    """`hotloop eval`: pass@k of a policy version on held-out tasks or HumanEval."""
    from hotloop.replicas import Rewards, Rollouts
    from hotloop.tasks import load_tasks
    from services.trainer.recipes.grpo import evaluate

    mesh_cfg, job, trainer_cfg = load_job(args.config, args.set, "grpo")
    info = running_mesh(mesh_cfg.run_dir)
    if info is None:
        return 2
    tasks = load_tasks(args.tasks, args.split)
    if args.limit:
        tasks = tasks[: args.limit]
    ks = tuple(sorted(set(args.k or [1])))
    if max(ks) > args.samples:
        print(f"pass@{max(ks)} needs at least {max(ks)} samples per task (--samples)")
        return 2

    ep = info.apply(mesh_cfg).endpoints

    async def run():  # spread over every replica of each
        rollout, reward = Rollouts.connect(ep.rollout), Rewards.connect(ep.reward)
        try:
            return await evaluate(rollout, reward, tasks, samples=args.samples,
                                  temperature=job.eval_temperature, max_tokens=trainer_cfg.max_new_tokens,
                                  version=args.version, ks=ks, stop=job.stop)
        finally:
            await rollout.close()
            await reward.close()

    rec = asyncio.run(run())
    print(json.dumps(asdict(rec), indent=2))
    print(f"pass@1 = {rec.pass_at_1:.3f} ± {rec.ci95:.3f} (95% CI over {rec.tasks} tasks, "
          f"{rec.samples_per_task} samples each, version {rec.version})")
    return 0
