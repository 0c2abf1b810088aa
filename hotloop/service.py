"""The common `__main__` of every service: parse config, set up tracing, serve, shut down.

Each service's `__main__.py` supplies only its section model and an async `build` that
returns a started server; this module owns argument parsing, the process's Prometheus endpoint
(`GET /metrics` on the section's `metrics_port`, serving `hotloop.metrics.registry()`, which
`build` hands to the service's core), the port file the launcher waits for, signal handling
and ordered shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hotloop import config as hconfig
from hotloop import metrics, quickexit, telemetry


WATCH_INTERVAL_S = 2.0  # how often `Running.check` is polled


@dataclass
class Running:
    server: Any
    port: int
    health: Any
    cleanups: list[Callable[[], Any]] = field(default_factory=list)
    check: Callable[[], None] | None = None
    """Raises `FatalError` when the service can no longer serve (polled every 2 s until the
    service begins to stop; not while its cleanups take down what it checks): the
    process then stops with exit code 1, so `hotloop up` restarts it and says why."""
    on_signal: Callable[[], None] | None = None
    """Runs at once when the stop begins, before the server's grace for calls in flight (the
    trainer's loop must not go on learning through it); `cleanups` run after the grace."""


def parse_args(name: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"hotloop serve {name}")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set rollout.port=50051")
    p.add_argument("--port-file", help="write {'port': N, 'metrics_port': M} here once serving "
                                       "(used by `hotloop up`)")
    return p.parse_args()


def run(name: str, section: type, build: Callable[..., Awaitable[Running]],
        also: dict[str, type] | None = None) -> None:
    """Serve `build(mesh, cfg, **also_loaded)`: `cfg` is the `[name]` section, `also` names
    further sections the service reads (each passed by its name). Every section is checked
    before anything starts; a config problem prints them all and exits with status 2."""
    args = parse_args(name)
    quickexit.arm()  # before the heavy imports: its handler runs after every other
    logging.basicConfig(
        level=os.environ.get("HOTLOOP_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    try:
        tree = hconfig.raw_config(args.config, args.set)
        mesh, loaded = hconfig.load_sections(tree, {name: section, **(also or {})}, only_known=False)
    except hconfig.ConfigError as e:
        print(f"{name}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    cfg = loaded.pop(name)
    asyncio.run(_main(name, mesh, cfg, functools.partial(build, **loaded), args.port_file))


async def _main(name, mesh, cfg, build, port_file) -> None:
    from hotloop.grpcutil import configure, serve_until_signal

    configure(mesh.grpc)  # before `build` opens its clients
    telemetry.setup(name, mesh.telemetry, mesh.run_dir)
    log = logging.getLogger(name)
    host = getattr(cfg, "host", "127.0.0.1")
    # Before `build`, so a taken metrics port stops the process before a model loads, and the
    # process's own numbers (memory, CPU) are there while a slow start runs.
    endpoint = _serve_metrics(name, cfg, host)
    try:
        running = await build(mesh, cfg)
    except BaseException:
        if endpoint is not None:
            endpoint.close()
        raise
    log.info("serving on %s:%d", host, running.port)
    if endpoint is not None:
        log.info("metrics on http://%s:%d/metrics", host, endpoint.port)
    if port_file:
        ports = {"port": running.port, "pid": os.getpid()}
        if endpoint is not None:
            ports["metrics_port"] = endpoint.port
        tmp = Path(port_file).with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(ports))
        tmp.rename(port_file)  # the launcher never reads a half-written file

    async def cleanup():
        # Stopping is not a failure: the cleanups take down what `check` watches (the
        # rollout's engine), and any await among them would let the watchdog see that.
        watchdog.cancel()
        for fn in reversed(running.cleanups):
            res = fn()
            if asyncio.iscoroutine(res):
                await res
        if endpoint is not None:  # last: what the service did until it stopped stays readable
            await asyncio.to_thread(endpoint.close)
        telemetry.shutdown()

    failed: list[str] = []
    watchdog = asyncio.create_task(_watch(running, failed, log))

    def signalled() -> None:
        if running.on_signal is not None:
            watchdog.cancel()  # what it checks is being stopped now, as in `cleanup`
            running.on_signal()

    await serve_until_signal(running.server, running.health, on_stop=cleanup,
                             on_signal=signalled)
    watchdog.cancel()
    log.info("stopped")
    if failed:
        raise SystemExit(f"{name}: {failed[0]}")


def _serve_metrics(name: str, cfg: Any, host: str) -> metrics.Endpoint | None:
    """The process's `/metrics` endpoint on the section's `metrics_port` (None for -1)."""
    port = cfg.metrics_port if isinstance(cfg, hconfig.ServiceSection) else -1
    if port < 0:
        return None
    try:
        return metrics.serve(metrics.registry(), host, port)
    except OSError as e:
        raise SystemExit(f"{name}: cannot serve metrics on {host}:{port}: {e}") from None


async def _watch(running: Running, failed: list[str], log) -> None:
    from hotloop.errors import FatalError

    if running.check is None:
        return
    while True:
        await asyncio.sleep(WATCH_INTERVAL_S)
        try:
            running.check()
        except FatalError as e:
            log.error("fatal: %s; stopping", e)
            failed.append(str(e))
            os.kill(os.getpid(), signal.SIGTERM)  # the same orderly path as Ctrl-C
            return


def run_interruptible(main: Awaitable[Any]) -> tuple[Any, bool]:
    """Run a job's coroutine; the first SIGINT or SIGTERM cancels it (a job checkpoints on
    cancellation), a second one is the default Ctrl-C. Returns (result, interrupted).

    Why not KeyboardInterrupt: `asyncio.run` then waits in `shutdown_default_executor` for a
    training step running in a worker thread, which took minutes on slow CPUs; cancellation
    reaches the job at its next await and lets it stop its thread cooperatively.
    """

    async def _run():
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)

        def _cancel() -> None:
            print("\n[hotloop] stopping: finishing the current micro-batch, then checkpointing "
                  "(Ctrl-C again to force)", flush=True)
            task.cancel()
            for s in signals:  # a second signal gets Python's default behaviour
                loop.remove_signal_handler(s)

        for s in signals:
            loop.add_signal_handler(s, _cancel)
        try:
            return await task, False
        except asyncio.CancelledError:
            if task.cancelled() or not task.done():
                return None, True
            raise
        finally:
            for s in signals:
                loop.remove_signal_handler(s)

    return asyncio.run(_run())
