"""`hotloop simulate users`: simulated users (`measure.users`) against a running mesh's gateway,
or any OpenAI-compatible URL with a key, until they have sent their requests or their time is up.

Owns the command only: its arguments and what it prints.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from launch.mesh import find_target
from measure.users import Brevity, SimConfig, Simulation, Target, summarize


def main(args) -> int:
    if args.base_url:
        if not args.key:
            print("simulate users: --base-url needs --key", flush=True)
            return 2
        target = Target(args.base_url.rstrip("/").removesuffix("/v1"), args.key)
    else:
        from hotloop import config

        run_dir = args.run_dir or config.load_mesh(config.raw_config(args.config, args.set)).run_dir
        try:
            target = find_target(run_dir)
        except (FileNotFoundError, LookupError) as e:
            print(f"simulate users: {e}", flush=True)
            return 2
    if not (args.requests or args.duration):
        args.requests = 10
    cfg = SimConfig(users=args.users, requests_per_user=args.requests, duration_s=args.duration,
                    rate=args.rate, max_tokens=args.max_tokens, feedback=not args.no_feedback,
                    seed=args.seed, progress_s=args.progress)
    pref = Brevity(args.max_words)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"[simulate] {cfg.users} users x {cfg.requests_per_user or 'unbounded'} requests"
          f"{f' or {cfg.duration_s:g}s' if cfg.duration_s else ''} -> {target.base_url}; "
          f"hidden preference: {pref.describe()}; records: {out}", flush=True)
    sim = Simulation(target, cfg, pref, out)
    try:
        summary = asyncio.run(sim.run())
    except KeyboardInterrupt:
        summary = summarize(sim.records)
    finally:
        sim.close()
    print(f"[simulate] done: {summary['requests']} requests, {summary['errors']} errors, "
          f"matched {_fmt(summary['matched_share'])}, feedback accepted "
          f"{summary['feedback']['accepted']}/{summary['feedback']['sent']}, versions "
          f"{summary['versions']}, TTFT p50/p99 {_fmt(summary['ttft_ms']['p50'], '.0f')}/"
          f"{_fmt(summary['ttft_ms']['p99'], '.0f')} ms", flush=True)
    return 0


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)
