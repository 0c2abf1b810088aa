"""gRPC edge of the trainer: `Trainer.Status` and `Trainer.FetchAdapter`.

Owns: `TrainerState`, the small plain object the training loop updates and `Status` reads,
and `FetchAdapter`, which streams a published version of a lineage out of that lineage's
`VersionStore` (`VersionInfo` first, then `CHUNK_BYTES` data chunks; version 0 means the
latest; an unknown version or a lineage this trainer does not train is NOT_FOUND) so that a
rollout replica that missed a push can catch up. FetchAdapter is an admin RPC: a version is a
tenant's model, readable only with the admin token.
Does not own: training, publishing or the store's layout (publish.py), or the process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from hotloop.adapters import version_to_proto
from hotloop.errors import NotFound
from hotloop.grpcutil import CHUNK_BYTES, create_server, map_errors
from hotloop.hardware import runtime_info
from hotloop.proto.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from hotloop.tenants import TenantId

from .publish import Publisher, VersionStore

SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
ADMIN_METHODS = [f"/{SERVICE}/FetchAdapter"]

Stores = Callable[[TenantId], VersionStore]
"""tenant -> the `VersionStore` of the lineage this trainer trains for it; NotFound if none."""


def single_store(store: VersionStore | Publisher) -> Stores:
    """`Stores` of a trainer that trains one lineage: a `Publisher`'s (its tenant's) or a bare
    store's (the default lineage's)."""
    tenant = store.tenant if isinstance(store, Publisher) else ""
    store = store.store if isinstance(store, Publisher) else store

    def of(name: TenantId) -> VersionStore:
        if name != tenant:
            raise NotFound(f"this trainer trains the lineage of tenant {tenant!r}, not {name!r}")
        return store

    return of


@dataclass
class TrainerState:
    """What the loop reports: updated in place by the loop, read by `Status`. Both run on one
    event loop, so a reader sees each field either before or after an update, never torn.
    Not `checkpoint.TrainerState` (what a restore hands back); import one of them by module."""

    algorithm: str = ""  # "grpo" | "ppo" | ...
    step: int = 0  # optimizer steps applied
    latest_version: int = 0  # last version published (0: the base model)
    last_metrics: dict[str, float] = field(default_factory=dict)  # StepMetrics.as_dict()
    dtype: str = ""  # the policy's resolved compute dtype


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, state: TrainerState, stores: Stores) -> None:
        self._state = state
        self._stores = stores

    async def Status(
        self, request: trainer_pb2.TrainerStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        p = self._state
        return trainer_pb2.TrainerStatus(
            algorithm=p.algorithm, step=p.step, latest_version=p.latest_version,
            last_metrics={k: float(v) for k, v in p.last_metrics.items()},
            runtime=common_pb2.RuntimeInfo(**runtime_info(p.dtype)) if p.dtype else None,
        )

    @map_errors
    async def FetchAdapter(
        self, request: trainer_pb2.FetchAdapterRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.FetchAdapterChunk]:
        # InvalidTenant -> INVALID_ARGUMENT; a tenant this process holds no store of: NOT_FOUND
        store = self._stores(TenantId(request.tenant))
        info = await asyncio.to_thread(store.get, request.version)
        yield trainer_pb2.FetchAdapterChunk(info=version_to_proto(info))
        # Stored versions are immutable, so reading while the loop publishes the next is safe;
        # reads run off the event loop so a large archive does not stall other RPCs.
        with open(store.archive(info.version), "rb") as f:
            while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
                yield trainer_pb2.FetchAdapterChunk(data=chunk)


async def serve(
    state: TrainerState, stores: VersionStore | Publisher | Stores, address: str,
    admin_token: str = "",
) -> tuple[grpc.aio.Server, int, object]:
    """Start the trainer's server (health and reflection included); returns (server, port, health).

    `stores`: tenant -> its lineage's store, or one `Publisher` / `VersionStore` (one lineage).
    `admin_token`: what FetchAdapter requires (none configured: FetchAdapter is refused).
    """
    if isinstance(stores, (VersionStore, Publisher)):
        stores = single_store(stores)
    servicer = TrainerServicer(state, stores)
    return await create_server(
        [lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, s)],
        [SERVICE],
        address,
        admin_methods=ADMIN_METHODS,
        admin_token=admin_token,
    )
