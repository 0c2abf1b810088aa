"""`hotloop eval`: pass@k of a policy version on held-out tasks or HumanEval, via a running mesh."""

from __future__ import annotations

import asyncio
import json
import os


def main(args) -> int:
    from hotloop.clients import RewardClient, RolloutClient
    from hotloop.launcher import MeshInfo
    from hotloop.tasks import load_tasks
    from hotloop.train import load_job_configs
    from services.trainer.grpo import evaluate

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
                                  version=args.version, ks=ks)
        finally:
            await rollout.close()
            await reward.close()

    rec = asyncio.run(run())
    print(json.dumps(rec.__dict__, indent=2))
    print(f"pass@1 = {rec.pass_at_1:.3f} ± {rec.ci95:.3f} (95% CI over {rec.tasks} tasks, "
          f"{rec.samples_per_task} samples each, version {rec.version})")
    return 0
