"""A training job against a running mesh: clients, publisher, the trainer's own gRPC
server (Status, FetchAdapter), then the recipe, then the report.

Runs any registered recipe (`recipes.registry`): a batch one (`run_job`: its checks, its run,
its report writer, as its entry says) or the online loop (`run_online_job`, a lane per tenant
where configured). Used by `hotloop train <recipe>`, `hotloop demo` and the trainer's
`__main__` (the online trainer as a mesh process). `open_edge` is what every job holds around
its recipe. Endpoints come from the mesh config (`[endpoints]`, filled in by `hotloop up`
through the environment or mesh.json); each service's replicas are one balanced client
(hotloop.replicas), whose per-replica counts the summary reports under `replicas`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hotloop import models, telemetry
from hotloop.clients import ReferenceClient, RolloutClient
from hotloop.config import MeshConfig
from hotloop.replicas import References, Replicas, Rewards, Rollouts
from hotloop.tenants import DEFAULT, TenantId

from .recipes import grpo, registry
from .config import TrainerConfig

log = logging.getLogger(__name__)


async def check_dtype(trainer_cfg: TrainerConfig,
                      reference: References | ReferenceClient | None) -> str:
    """The trainer's resolved dtype, after checking that the reference computes in the same
    one (every replica of it): bf16 and fp32 logprobs differ by ~1e-2 per token, which the KL
    term would read as policy drift. A mismatch stops the job before any step."""
    from hotloop.hardware import resolve_dtype

    dtype = resolve_dtype(trainer_cfg.dtype, device=trainer_cfg.device)  # as the policy resolves it
    if reference is not None and trainer_cfg.loss.kl_beta > 0:
        for replica in reference if isinstance(reference, References) else [reference]:
            theirs = (await replica.status()).runtime.dtype
            if theirs and theirs != dtype:
                several = isinstance(reference, References) and len(reference) > 1
                where = f" at {replica.address}" if several else ""
                raise SystemExit(
                    f"the reference service{where} computes in {theirs} but the trainer in {dtype} "
                    f"(configured {trainer_cfg.dtype!r}): start both from a config with the same "
                    f"[model] dtype (\"auto\" resolves identically on one host)")
    return dtype


async def effective_config(mesh_cfg: MeshConfig, job, trainer_cfg: TrainerConfig,
                           dtype: str, mesh: grpo.Mesh, section: str = "grpo") -> dict:
    """What actually ran: every section after file, environment and `--set` overrides, with
    the automatic choices resolved (dtypes, update mode) as the services report them. The
    report shows this, not the TOML file it started from. Secrets are left out."""
    from hotloop.hardware import cpu_capability

    ro = await mesh.rollout[0].status()
    shared = mesh_cfg.model_dump(mode="json", exclude={"security", "endpoints"})
    shared["model"]["dtype"] = ro.runtime.dtype or shared["model"]["dtype"]
    out = {
        **shared,
        "rollout": {"update_mode": ro.update_mode, "swap": ro.swap, "engine": ro.engine,
                    "dtype": ro.runtime.dtype, "cpu": ro.runtime.cpu},
        section: job.model_dump(mode="json"),
        "trainer": trainer_cfg.model_copy(update={"dtype": dtype}).model_dump(mode="json"),
        "host": {"cpu": str(cpu_capability())},
    }
    if mesh.reference is not None:
        rs = await mesh.reference.status()
        out["reference"] = {"dtype": rs.runtime.dtype, "cpu": rs.runtime.cpu}
    return out


@dataclass
class Edge:
    """What a job holds around its recipe: the bus, the reference, the publisher and the
    trainer's own server, whose `state` the recipe's `on_step` updates."""

    bus: Any  # hotloop.bus.Bus | None
    reference: References | None
    publisher: Any  # .publish.Publisher; None where the lanes make one per tenant (tenants/lanes.py)
    state: Any  # .server.TrainerState
    server: Any  # grpc.aio.Server
    port: int
    health: Any
    dtype: str
    fetch_from: str = ""  # this trainer's FetchAdapter address, as announced

    async def close(self) -> None:
        if self.reference is not None:
            await self.reference.close()
        if self.publisher is not None:
            await self.publisher.close()
        await self.server.stop(1)
        if self.bus is not None:
            try:
                await self.bus.close()
            except Exception as e:  # NATS gone (reconnecting) at exit: the job's work is done
                log.warning("closing the bus connection failed: %r", e)


_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def advertised(host: str, port: int, configured: str = "") -> str:
    """The address a replica fetches this trainer's versions from: `[endpoints] trainer` when
    set (what the others reach it at: a compose service name, a Kubernetes Service), else the
    bind address, with a wildcard bind (0.0.0.0, ::) replaced by this host's name, since no
    replica can connect to a wildcard."""
    if configured:
        return configured
    if host in _WILDCARDS:
        import socket

        host = socket.getfqdn()
    return f"{host}:{port}"


async def open_edge(mesh_cfg: MeshConfig, trainer_cfg: TrainerConfig, run_dir: Path,
                    algorithm: str, address: str = "127.0.0.1:0", tenant: TenantId = DEFAULT,
                    stores=None) -> Edge:
    """Connect the bus (if configured) and the reference, check dtypes, start the trainer's
    Status/FetchAdapter server on `address`. `stores` (server.Stores): the lineages' stores
    when the caller publishes per tenant (no publisher here then); else one publisher for
    `tenant`'s lineage under `run_dir`. Close with `Edge.close()`."""
    from .publish import Publisher
    from .server import TrainerState, serve

    ep = mesh_cfg.endpoints
    bus = None
    if mesh_cfg.nats.url:
        from hotloop.bus import Bus

        bus = await Bus.connect(mesh_cfg.nats.url, "trainer", mesh_cfg.nats.connect_timeout_s,
                                replicas=mesh_cfg.nats.replicas, ping_interval_s=mesh_cfg.nats.ping_interval_s)
    reference = References.connect(ep.reference) if ep.reference else None
    try:
        dtype = await check_dtype(trainer_cfg, reference)
    except BaseException:
        if reference is not None:
            await reference.close()
        if bus is not None:
            await bus.close()
        raise
    publisher = None if stores is not None else Publisher(
        list(ep.rollout), mesh_cfg.security.admin_token, run_dir / "store", bus,
        mesh_cfg.model.name, tenant=tenant)
    state = TrainerState(algorithm=algorithm, dtype=dtype)
    server, port, health = await serve(state, stores if stores is not None else publisher,
                                       address, mesh_cfg.security.admin_token)
    host = address.rsplit(":", 1)[0]
    # announced, so a replica that missed a push can fetch from here
    fetch_from = advertised(host, port, ep.trainer)
    if publisher is not None:
        publisher.fetch_from = fetch_from
    log.info("trainer serving Status/FetchAdapter on %s:%d (announced as %s)", host, port, fetch_from)
    return Edge(bus, reference, publisher, state, server, port, health, dtype, fetch_from)


async def run_job(mesh_cfg: MeshConfig, job, trainer_cfg: TrainerConfig, config_text: str = "",
                  progress: bool = True, recipe: str = "grpo", report=None) -> tuple[dict, Path]:
    """A batch job (`recipe`: a registered batch recipe's name, with its section as `job`)
    against the running mesh; returns its summary and the report's path. `report`: the
    `[report]` section (hotloop.tracking.ReportConfig), the trackers the records also go to."""
    from hotloop.tracking import check_installed

    from .tracking import open_job_tracker

    entry = registry.recipe(recipe)
    if entry.kind != "batch":
        raise ValueError(f"recipe {recipe!r} is not a batch job: run_online_job runs it")
    if report is not None:
        check_installed(report)  # a tracker's missing package: before anything connects
    ep = mesh_cfg.endpoints
    missing = [n for n, v in (("rollout", ep.rollout), ("reward", ep.reward)) if not v]
    if missing:
        raise SystemExit(f"no endpoint for {missing}: start the mesh with `hotloop up` first")
    if entry.check is not None:
        entry.check(job, trainer_cfg, ep)
    run, write, default_id = entry.run(job), entry.report, entry.run_prefix
    telemetry.setup("trainer", mesh_cfg.telemetry, mesh_cfg.run_dir)
    model_dir = models.resolve(mesh_cfg.model.name)
    run_id = job.run_id or default_id + time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(job.out_dir) / run_id
    edge = await open_edge(mesh_cfg, trainer_cfg, run_dir, recipe)
    state = edge.state

    def on_step(rec) -> None:
        state.step, state.latest_version = rec.step, rec.version
        state.last_metrics = {k: v for k, v in asdict(rec).items() if isinstance(v, (int, float))}
        state.last_metrics.update({f"seconds_{k}": v for k, v in rec.stage_seconds.items()})

    mesh = grpo.Mesh(
        rollout=Rollouts.connect(ep.rollout),
        reward=Rewards.connect(ep.reward),
        reference=edge.reference,
        publisher=edge.publisher,
    )
    try:
        effective = await effective_config(mesh_cfg, job, trainer_cfg, edge.dtype, mesh, recipe)
        tracker = open_job_tracker(report, run_dir, run_id, effective)
        try:
            summary = await run(job, trainer_cfg, model_dir, mesh, run_dir, progress, on_step,
                                tracker=tracker)
        finally:
            tracker.close()
        summary["config"] = effective
        summary["replicas"] = replica_counts(mesh)
        path = write(summary, run_dir, config_text)
    finally:
        await mesh.rollout.close()
        await mesh.reward.close()
        await edge.close()
        telemetry.shutdown()
    return summary, path


def replica_counts(mesh: grpo.Mesh) -> dict[str, dict[str, dict]]:
    """What each replica of each service did for the job, as its balanced client saw it
    (`hotloop.replicas.ReplicaStats`: results kept, calls lost with it, items re-sent)."""
    return {name: {a: asdict(s) for a, s in pool.stats.items()}
            for name, pool in (("rollout", mesh.rollout), ("reward", mesh.reward),
                               ("reference", mesh.reference)) if isinstance(pool, Replicas)}


# ---- the online trainer ------------------------------------------------------------------------


def _check_online_mesh(mesh_cfg: MeshConfig, trainer_cfg: TrainerConfig, job) -> None:
    ep = mesh_cfg.endpoints
    if not mesh_cfg.nats.url:
        raise SystemExit("the online trainer reads feedback from the bus: no [nats] url configured")
    if not ep.rollout:
        raise SystemExit("no rollout endpoint: start the mesh with `hotloop up` first")
    if job.kl_target is not None and trainer_cfg.loss.kl_beta <= 0:
        raise SystemExit("[online] kl_target steers the KL coefficient from [trainer.loss] "
                         "kl_beta: set kl_beta > 0 (its starting value)")
    if trainer_cfg.loss.kl_beta > 0 and job.reference == "service" and not ep.reference:
        raise SystemExit("kl_beta > 0 with [online] reference = 'service' needs the reference "
                         "service: no endpoint configured (or use reference = 'colocated')")
    if (trainer_cfg.loss.kl_beta > 0 and trainer_cfg.loss.kl_estimator == "full"
            and job.reference != "colocated"):
        raise SystemExit('[trainer.loss] kl_estimator = "full" needs the reference\'s whole '
                         "distributions: [online] reference = 'colocated'")


async def open_online(mesh_cfg: MeshConfig, job, trainer_cfg: TrainerConfig,
                      address: str = "127.0.0.1:0"):
    """The edge and the `online.OnlineMesh` of an online job; returns (edge, mesh, run_dir).
    Close with `close_online`."""
    from .recipes import online

    ep = mesh_cfg.endpoints
    _check_online_mesh(mesh_cfg, trainer_cfg, job)
    run_dir = Path(job.out_dir) / job.run_id
    from .pacing.usersfirst import UsersFirst

    # Here, in the processes that run the loop, before the policy loads (torch's threads
    # inherit the priority); not in `online.run`, which tests drive inside pytest.
    UsersFirst(job.users_first).start()
    edge = await open_edge(mesh_cfg, trainer_cfg, run_dir, "reinforce_tis", address, job.tenant)
    registry = None
    if edge.bus is not None and job.tenant != DEFAULT:  # the admin API holds named tenants
        from hotloop.tenants import Registry

        registry = Registry(edge.bus)
    mesh = online.OnlineMesh(edge.bus, edge.publisher, edge.reference,
                             [RolloutClient(a) for a in ep.rollout], registry)
    return edge, mesh, run_dir


def online_status(state):
    """An `on_step` for `online.run` that keeps the trainer's Status current."""

    def on_step(rec) -> None:
        state.step, state.latest_version = rec.step, rec.version
        state.last_metrics = {"score_mean": rec.score_mean, "baseline": rec.baseline,
                              "feedback": rec.feedback, **rec.train,
                              **{f"seconds_{k}": v for k, v in rec.stage_seconds.items()}}

    return on_step


async def close_online(edge: Edge, mesh) -> None:
    for c in mesh.rollout:
        await c.close()
    await edge.close()


async def open_lanes(mesh_cfg: MeshConfig, job, trainer_cfg: TrainerConfig,
                     address: str = "127.0.0.1:0", registry=None, tracker=None):
    """The edge and the `lanes.Lanes` of an online job with `[online] tenants`: one process,
    a lane per tenant (tenants/lanes.py); the server's FetchAdapter serves each lane's store. Returns
    (edge, lanes); run with `lanes.run()`, close with `close_lanes`."""
    from .tenants.lanes import Lanes
    from .publish import Publisher
    from .pacing.usersfirst import UsersFirst

    ep = mesh_cfg.endpoints
    _check_online_mesh(mesh_cfg, trainer_cfg, job)
    run_dir = Path(job.out_dir) / job.run_id
    UsersFirst(job.users_first).start()  # before the policy loads (see open_online)
    lanes: Lanes | None = None

    def stores(tenant: TenantId):
        if lanes is None:
            from hotloop.errors import NotFound

            raise NotFound("the trainer is starting")
        return lanes.store(tenant)

    edge = await open_edge(mesh_cfg, trainer_cfg, run_dir, "reinforce_tis", address, stores=stores)

    def publisher_for(tenant: TenantId, store_dir: Path) -> Publisher:
        return Publisher(list(ep.rollout), mesh_cfg.security.admin_token, store_dir, edge.bus,
                         mesh_cfg.model.name, fetch_from=edge.fetch_from, tenant=tenant)

    state = edge.state

    def on_step(tenant: TenantId, rec) -> None:
        # Status: the steps of every lineage together; the version of the default lineage
        # (0 when this process does not train it: versions of lineages do not compare)
        state.step = lanes.steps()
        if tenant == DEFAULT:
            state.latest_version = rec.version
        state.last_metrics = {"score_mean": rec.score_mean, "baseline": rec.baseline,
                              "feedback": rec.feedback, **rec.train,
                              **{f"seconds_{k}": v for k, v in rec.stage_seconds.items()}}

    lanes = Lanes(job, trainer_cfg, models.resolve(mesh_cfg.model.name), bus=edge.bus,
                  publisher_for=publisher_for, run_dir=run_dir, reference=edge.reference,
                  rollout=[RolloutClient(a) for a in ep.rollout], registry=registry,
                  on_step=on_step, tracker=tracker)
    if job.follow_registry and edge.bus is None:
        raise SystemExit("[online] follow_registry needs the bus: set [nats] url")
    if edge.bus is not None:
        from hotloop.tenants import Registry

        from .tenants.follow import RegistryFollower, held_tenants

        # Every lanes trainer applies the registry's resets and holds of its lineages (the
        # admin API's); one that follows the registry also adds and removes lanes.
        lanes.held = await held_tenants(Registry(edge.bus))  # held from their lanes' start
        lanes.follow = lambda lanes: RegistryFollower(
            lanes, Registry(edge.bus), edge.bus, run_dir / "registry.json",
            manage=job.follow_registry).run()
    return edge, lanes


async def close_lanes(edge: Edge, lanes) -> None:
    await lanes.close()
    for c in lanes.rollout:
        await c.close()
    await edge.close()


async def run_online_job(mesh_cfg: MeshConfig, job, trainer_cfg: TrainerConfig,
                         report=None) -> dict:
    """`hotloop train online`: the online loop until `max_steps` updates or Ctrl-C. With
    `[online] tenants`, a lane per tenant; the summary then has each tenant's under
    `tenants`. `report`: as `run_job`'s."""
    from .recipes import online
    from .tracking import online_params, open_job_tracker

    telemetry.setup("trainer", mesh_cfg.telemetry, mesh_cfg.run_dir)
    tracker = None
    try:
        tracker = open_job_tracker(report, Path(job.out_dir) / job.run_id, job.run_id,
                                   online_params(mesh_cfg, job, trainer_cfg))
        if job.lanes:
            edge, lanes = await open_lanes(mesh_cfg, job, trainer_cfg, tracker=tracker)
            try:
                return {"tenants": await lanes.run()}
            finally:
                await close_lanes(edge, lanes)
        edge, mesh, run_dir = await open_online(mesh_cfg, job, trainer_cfg)
        try:
            return await online.run(job, trainer_cfg, models.resolve(mesh_cfg.model.name), mesh,
                                    run_dir, on_step=online_status(edge.state), tracker=tracker)
        finally:
            await close_online(edge, mesh)
    finally:
        if tracker is not None:
            tracker.close()
        telemetry.shutdown()
