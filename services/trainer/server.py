"""gRPC edge of the trainer: `Trainer.Status` and `Trainer.FetchAdapter`.

Owns: `TrainerState`, the small plain object the training loop updates and `Status` reads,
and `FetchAdapter`, which streams a published version out of the publisher's `VersionStore`
(`VersionInfo` first, then `CHUNK_BYTES` data chunks; version 0 means the latest; an unknown
version is NOT_FOUND) so that a rollout replica that missed a push can catch up.
Does not own: training, publishing or the store's layout (publisher.py), or the process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from hotloop.adapters import version_to_proto
from hotloop.grpcutil import CHUNK_BYTES, create_server, map_errors
from hotloop.hardware import runtime_info
from hotloop.proto.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

from .recipes.publisher import Publisher, VersionStore

SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


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
    def __init__(self, state: TrainerState, store: VersionStore) -> None:
        self._state = state
        self._store = store

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
        info = await asyncio.to_thread(self._store.get, request.version)  # NotFound -> NOT_FOUND
        yield trainer_pb2.FetchAdapterChunk(info=version_to_proto(info))
        # Stored versions are immutable, so reading while the loop publishes the next is safe;
        # reads run off the event loop so a large archive does not stall other RPCs.
        with open(self._store.archive(info.version), "rb") as f:
            while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
                yield trainer_pb2.FetchAdapterChunk(data=chunk)


async def serve(
    state: TrainerState, store: VersionStore | Publisher, address: str
) -> tuple[grpc.aio.Server, int, object]:
    """Start the trainer's server (health and reflection included); returns (server, port, health).

    `store`: the publisher's `VersionStore`, or the `Publisher` itself (its store is used).
    """
    if isinstance(store, Publisher):
        store = store.store
    servicer = TrainerServicer(state, store)
    return await create_server(
        [lambda s: trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, s)],
        [SERVICE],
        address,
    )
