"""`python -m services.trainer`: the online trainer as a mesh process (`hotloop up
--services ...,trainer`).

Runs the online loop (online.py) in the background of the trainer's gRPC server (Status,
FetchAdapter), so a demo can start the gateway and the online trainer together; with
`[online] tenants`, a lane per tenant on one shared policy (tenants/lanes.py). Reads
`[trainer]` (optimizer, LoRA, dtype, kl_beta), `[online]` and `[report]` (the experiment
trackers its records also go to, hotloop.tracking); listens on `[trainer_server]`'s
address. If the loop fails, the process stops with its error (the launcher reports it); on
SIGTERM the loop is cancelled and whatever it had not acked is redelivered to the next run.
GRPO jobs are not a service: they run through `hotloop train grpo`.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pydantic import Field

from hotloop import metrics, service
from hotloop.config import MeshConfig, ServiceSection
from hotloop.tracking import ReportConfig

from .config import OnlineConfig, TrainerConfig

log = logging.getLogger("trainer")
STOP_TIMEOUT_S = 10.0  # per stage of a stop: the loop's cancellation, then closing connections


class TrainerServerConfig(ServiceSection):
    """The `[trainer_server]` section: where the online trainer's Status/FetchAdapter listen."""

    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(0, ge=0, le=65535)
    """Port to listen on; 0 picks a free one (written to the port file)."""


async def build(mesh: MeshConfig, cfg: TrainerServerConfig, *, online: OnlineConfig,
                trainer: TrainerConfig, report: ReportConfig | None = None) -> service.Running:
    # torch and peft load inside the loop, after every section has parsed
    from hotloop import models
    from hotloop.errors import FatalError
    from hotloop.threads import pin_configured

    from .recipes import online as online_loop
    from .runner import close_lanes, close_online, online_status, open_lanes, open_online
    from .tracking import online_params, open_job_tracker

    job, trainer_cfg = online, trainer
    pin_configured(trainer_cfg.cpus, "trainer")
    tracker = open_job_tracker(report, Path(job.out_dir) / job.run_id, job.run_id,
                               online_params(mesh, job, trainer_cfg))
    try:
        if job.lanes:  # a lane per tenant on one policy (tenants/lanes.py)
            edge, lanes = await open_lanes(mesh, job, trainer_cfg, f"{cfg.host}:{cfg.port}",
                                           registry=metrics.registry(), tracker=tracker)
            loop = asyncio.create_task(lanes.run())

            async def close() -> None:
                await close_lanes(edge, lanes)
        else:
            edge, omesh, run_dir = await open_online(mesh, job, trainer_cfg, f"{cfg.host}:{cfg.port}")
            loop = asyncio.create_task(online_loop.run(
                job, trainer_cfg, models.resolve(mesh.model.name), omesh, run_dir,
                on_step=online_status(edge.state),
                metrics=online_loop.OnlineMetrics(metrics.registry()), tracker=tracker))

            async def close() -> None:
                await close_online(edge, omesh)
    except BaseException:
        tracker.close()
        raise

    def check() -> None:
        if loop.done() and not loop.cancelled() and loop.exception() is not None:
            raise FatalError(f"the online loop failed: {loop.exception()!r}")
        if loop.done() and not loop.cancelled():
            raise FatalError("the online loop finished (online.max_steps reached)")

    async def stop() -> None:
        # Bounded: a stop must end the process within seconds whatever an await is stuck on.
        # Nothing is lost by giving up on one: feedback is acked only after its checkpoint,
        # so anything in flight is redelivered to the next run.
        log.info("stopping the online loop")
        loop.cancel()
        done, _ = await asyncio.wait([loop], timeout=STOP_TIMEOUT_S)
        if not done:
            log.error("the online loop did not stop within %.0f s; closing without it",
                      STOP_TIMEOUT_S)
        try:
            await asyncio.wait_for(close(), STOP_TIMEOUT_S)
        except Exception as e:  # TimeoutError included: exit anyway, nothing acked is lost
            log.error("closing the trainer's connections failed: %r", e)
        tracker.close_timeout_s = STOP_TIMEOUT_S  # what is still queued then is left out
        await asyncio.to_thread(tracker.close)
        log.info("online loop stopped")

    # The loop is cancelled at the signal, not after the server's grace: a call in flight
    # (Status, FetchAdapter) held the stop for the grace while the loop went on training.
    return service.Running(edge.server, edge.port, edge.health, cleanups=[stop], check=check,
                           on_signal=loop.cancel)


if __name__ == "__main__":
    service.run("trainer_server", TrainerServerConfig, build,
                also={"online": OnlineConfig, "trainer": TrainerConfig, "report": ReportConfig})
