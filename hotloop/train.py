"""`hotloop train grpo` / `hotloop train online`: a training job against a running mesh (see
`hotloop up`). `online` learns from the feedback users give through the gateway."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path


def load_job_configs(config_path: str | None, overrides: list[str]):
    """The mesh, `[grpo]` and `[trainer]` sections from one config (file < env < --set)."""
    from hotloop import config
    from services.trainer.config import TrainerConfig
    from services.trainer.grpo import GrpoJobConfig

    tree = config.raw_config(config_path, overrides)
    return (config.load_mesh(tree), config.load_section(tree, "grpo", GrpoJobConfig),
            config.load_section(tree, "trainer", TrainerConfig))


def load_online_configs(config_path: str | None, overrides: list[str]):
    """The mesh, `[online]` and `[trainer]` sections from one config (file < env < --set)."""
    from hotloop import config
    from services.trainer.config import OnlineConfig, TrainerConfig

    tree = config.raw_config(config_path, overrides)
    return (config.load_mesh(tree), config.load_section(tree, "online", OnlineConfig),
            config.load_section(tree, "trainer", TrainerConfig))


def main(args) -> int:
    from hotloop.launcher import MeshInfo

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
        from services.trainer.job import run_online_job

        mesh_cfg, online_job, trainer_cfg = load_online_configs(args.config, args.set)
        summary, interrupted = run_interruptible(run_online_job(mesh_cfg, online_job, trainer_cfg))
        if interrupted:  # nothing to save: un-acked feedback is redelivered to the next run
            print(f"online: stopped; resume with --set online.run_id={online_job.run_id}")
            return 130
        print(f"online: {summary['updates']} updates, version {summary['version']}, "
              f"counters {summary['counters']}")
        return 0
    mesh_cfg, job, trainer_cfg = load_job_configs(args.config, args.set)
    from services.trainer.job import run_job

    text = Path(args.config).read_text() if args.config else ""
    summary, report = asyncio.run(run_job(mesh_cfg, job, trainer_cfg, text))
    print(f"report: {report}")
    return 0
