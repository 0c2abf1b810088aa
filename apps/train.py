"""`hotloop train grpo|ppo|online` and `hotloop eval`: jobs against a running mesh (`hotloop up`).

The CLI (apps/cli.py) reaches these bodies by module name, so the shared library never
imports a service. `online` learns from the feedback users give through the gateway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path


def load_job_configs(config_path: str | None, overrides: list[str]):
    """The mesh, `[grpo]` and `[trainer]` sections from one config (file < env < --set).
    `[grpo]` includes the asynchronous mode's fields (`max_staleness`, `is_cap`)."""
    from hotloop import config
    from services.trainer.config import TrainerConfig
    from services.trainer.recipes.grpo_async import AsyncGrpoJobConfig

    tree = config.raw_config(config_path, overrides)
    return (config.load_mesh(tree), config.load_section(tree, "grpo", AsyncGrpoJobConfig),
            config.load_section(tree, "trainer", TrainerConfig))


def load_ppo_configs(config_path: str | None, overrides: list[str]):
    """The mesh, `[ppo]` and `[trainer]` sections from one config (file < env < --set); the
    trainer's algorithm is PPO whatever the file says."""
    from hotloop import config
    from services.trainer.config import TrainerConfig
    from services.trainer.recipes.ppo import PpoJobConfig

    tree = config.raw_config(config_path, overrides)
    tree.setdefault("trainer", {})["algorithm"] = "ppo"
    return (config.load_mesh(tree), config.load_section(tree, "ppo", PpoJobConfig),
            config.load_section(tree, "trainer", TrainerConfig))


def load_online_configs(config_path: str | None, overrides: list[str]):
    """The mesh, `[online]` and `[trainer]` sections from one config (file < env < --set)."""
    from hotloop import config
    from services.trainer.config import OnlineConfig, TrainerConfig

    tree = config.raw_config(config_path, overrides)
    return (config.load_mesh(tree), config.load_section(tree, "online", OnlineConfig),
            config.load_section(tree, "trainer", TrainerConfig))


def train(args) -> int:
    from apps.launcher import MeshInfo
    from hotloop.threads import pin_configured

    logging.basicConfig(level=os.environ.get("HOTLOOP_LOG_LEVEL", "WARNING"))
    mesh_cfg, _, _ = load_job_configs(args.config, args.set)
    run_dir = args.run_dir or mesh_cfg.run_dir
    try:
        info = MeshInfo.load(run_dir)
    except FileNotFoundError as e:
        print(e)
        return 2
    os.environ.update(info.env())  # point every section at the running mesh
    if args.algorithm == "online":
        from hotloop.service import run_interruptible
        from services.trainer.recipes.job import run_online_job

        mesh_cfg, online_job, trainer_cfg = load_online_configs(args.config, args.set)
        pin_configured(trainer_cfg.cpus, "trainer")  # on a core where vLLM spins, <1% of it
        summary, interrupted = run_interruptible(run_online_job(mesh_cfg, online_job, trainer_cfg))
        if interrupted:  # nothing to save: un-acked feedback is redelivered to the next run
            print(f"online: stopped; resume with --set online.run_id={online_job.run_id}")
            return 130
        print(f"online: {summary['updates']} updates, version {summary['version']}, "
              f"counters {summary['counters']}")
        return 0
    from hotloop.service import run_interruptible
    from services.trainer.recipes.job import run_job

    load = load_ppo_configs if args.algorithm == "ppo" else load_job_configs
    mesh_cfg, job, trainer_cfg = load(args.config, args.set)
    pin_configured(trainer_cfg.cpus, "trainer")
    if not job.run_id:  # named here, so that the resume line below can say it
        prefix = "ppo-" if args.algorithm == "ppo" else ""
        job = job.model_copy(update={"run_id": prefix + time.strftime("%Y%m%d-%H%M%S")})
    text = Path(args.config).read_text() if args.config else ""
    result, interrupted = run_interruptible(
        run_job(mesh_cfg, job, trainer_cfg, text, recipe=args.algorithm))
    if interrupted:
        print(f"{args.algorithm}: stopped; checkpoint under {job.out_dir}/{job.run_id}/checkpoints. "
              f"Resume: the same command with --set {args.algorithm}.run_id={job.run_id}")
        return 130
    summary, report = result
    print(f"report: {report}")
    return 0


def evaluate(args) -> int:
    """`hotloop eval`: pass@k of a policy version on held-out tasks or HumanEval."""
    from hotloop.clients import RewardClient, RolloutClient
    from apps.launcher import MeshInfo
    from hotloop.tasks import load_tasks
    from services.trainer.recipes.grpo import evaluate

    mesh_cfg, job, trainer_cfg = load_job_configs(args.config, args.set)
    try:
        info = MeshInfo.load(mesh_cfg.run_dir)
    except FileNotFoundError as e:
        print(e)
        return 2
    tasks = load_tasks(args.tasks, args.split)
    if args.limit:
        tasks = tasks[: args.limit]
    ks = tuple(sorted(set(args.k or [1])))
    if max(ks) > args.samples:
        print(f"pass@{max(ks)} needs at least {max(ks)} samples per task (--samples)")
        return 2

    async def run():
        rollout = RolloutClient(info.endpoints["rollout"][0])
        reward = RewardClient(info.endpoints["reward"])
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
