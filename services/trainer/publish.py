"""Publishing policy versions: durable store, push to every rollout replica, announcement.

Owns: `VersionStore`, the trainer's durable, immutable copies of published versions
(`<dir>/versions/v{n}.tar` + `v{n}.json`), which `Trainer.FetchAdapter` serves to a replica
that missed a push; and `Publisher`, which after a training step packs an adapter directory,
stores it, pushes it concurrently to every replica (`RolloutClient.push_adapter`, the one
rollout client: header, chunks, admin bearer token), retrying only UNAVAILABLE a bounded
number of times, then announces it on the bus (`WeightsUpdated`, and in the KV the version
under "latest" and the whole announcement, with this trainer's address, under "announced"). A
tenant's publisher does all of it in the tenant's lineage: pushes into it, stores the KV keys
and announces on the subject of that lineage.

Does not own: writing the adapter (`LoraPolicy.save_adapter`), numbering versions or deciding
what to do when a push fails (the loop: `PublishError` says which replicas failed and why),
verifying or loading on the replica (the rollout service), or the bus connection (the caller's;
`close()` leaves it open).

Announcement rule: a version is announced when it is live on at least one replica (or there
are no replicas to push to). Then a replica that was down catches up from the KV and
`FetchAdapter` (services/rollout/catchup.py); a version every replica refused is never
advertised. `reannounce` says the latest announced version again with this trainer's address:
a replica that restarted while no trainer was up learns where to fetch it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from opentelemetry import trace
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from hotloop import adapters
from hotloop.adapters import Version, version_to_proto
from hotloop.bus import Bus, announced_key, latest_key, weights_subject
from hotloop.clients import RolloutClient, direct_channel
from hotloop.errors import FailedPrecondition, InvalidArgument, NotFound
from hotloop.proto.v1 import bus_pb2, common_pb2
from hotloop.tenants import DEFAULT, TenantId

log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)


# ---- the durable store -----------------------------------------------------------------------


class VersionStore:
    """Published versions on disk, immutable once written.

    `v{n}.json` (the `Version`) is written after `v{n}.tar` and is the commit marker: a version
    whose json exists has a complete archive. Both are written to a temporary name, fsynced and
    renamed, so a crash never leaves a half-written version that looks complete.
    """

    def __init__(self, root: str | Path) -> None:
        self.dir = Path(root) / "versions"
        self.dir.mkdir(parents=True, exist_ok=True)

    def archive(self, version: int) -> Path:
        return self.dir / f"v{version}.tar"

    def _meta(self, version: int) -> Path:
        return self.dir / f"v{version}.json"

    def versions(self) -> list[Version]:
        """Every stored version, oldest first."""
        out = []
        for p in self.dir.glob("v*.json"):
            out.append(Version(**json.loads(p.read_text())))
        return sorted(out, key=lambda v: v.version)

    def latest(self) -> Version | None:
        held = self.versions()
        return held[-1] if held else None

    def get(self, version: int) -> Version:
        """A stored version; 0 means the latest. Unknown: `NotFound`."""
        if version == 0:
            latest = self.latest()
            if latest is None:
                raise NotFound("no version has been published yet")
            return latest
        meta = self._meta(version)
        if not meta.exists():
            raise NotFound(f"version {version} is not in the trainer's store")
        return Version(**json.loads(meta.read_text()))

    def put(self, info: Version, data: bytes) -> Version:
        """Store a version; returns what is stored.

        Re-storing a version with the same sha256 is a no-op returning the stored record (a
        retried publish); other content under a stored number, or a number below the latest,
        is refused: versions are immutable and monotonic.
        """
        if info.version <= 0:
            raise InvalidArgument(f"version must be a positive integer, got {info.version}")
        if self._meta(info.version).exists():
            held = self.get(info.version)
            if held.sha256 != info.sha256:
                raise FailedPrecondition(
                    f"version {info.version} is already published with sha256 "
                    f"{held.sha256[:12]}; this adapter is {info.sha256[:12]}"
                )
            return held
        latest = self.latest()
        if latest is not None and info.version < latest.version:
            raise FailedPrecondition(
                f"version {info.version} is older than the latest published ({latest.version})"
            )
        _write_atomic(self.archive(info.version), data)
        _write_atomic(self._meta(info.version), json.dumps(asdict(info)).encode())
        return info


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)


# ---- results and errors ----------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaPush:
    """One replica's successful push."""

    replica: str
    push_ms: float  # send + the replica's verify and load, all attempts included
    verify_ms: float  # as the replica reports them
    load_ms: float
    already_present: bool  # the replica held this version already (a retried publish)
    attempts: int


@dataclass(frozen=True)
class PublishResult:
    version: Version
    pushes: dict[str, ReplicaPush]  # replica address -> its push; failed replicas are absent
    total_ms: float  # pack + store + pushes + announcement
    announced: bool  # WeightsUpdated sent and KV "latest" set

    @property
    def push_ms(self) -> dict[str, float]:
        return {r: p.push_ms for r, p in self.pushes.items()}


class PushFailed(RuntimeError):
    """One replica did not take the version. `code` is the gRPC status name."""

    def __init__(self, replica: str, version: int, code: str, reason: str, attempts: int) -> None:
        self.replica, self.version, self.code, self.reason = replica, version, code, reason
        self.attempts = attempts
        super().__init__(self._describe())

    def _describe(self) -> str:
        return f"replica {self.replica} failed version {self.version} ({self.code}): {self.reason}"


class ReplicaRefused(PushFailed):
    """The replica answered and refused: bad archive, wrong base model, rank over its limit,
    older than its latest (INVALID_ARGUMENT, FAILED_PRECONDITION) or a wrong admin token
    (PERMISSION_DENIED, UNAUTHENTICATED). Pushing the same thing again will not help."""

    def _describe(self) -> str:
        return f"replica {self.replica} refused version {self.version} ({self.code}): {self.reason}"


class ReplicaUnavailable(PushFailed):
    """The replica could not be reached (UNAVAILABLE after every retry) or did not answer in
    time (DEADLINE_EXCEEDED). It can catch up later from the store."""

    def _describe(self) -> str:
        return (
            f"replica {self.replica} unreachable for version {self.version} after "
            f"{self.attempts} attempt(s) ({self.code}): {self.reason}"
        )


_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class PublishError(RuntimeError):
    """Some replicas did not take a version. `failures` maps replica -> its `PushFailed`;
    `result` holds the replicas that did and whether the version was announced."""

    def __init__(self, result: PublishResult, failures: dict[str, PushFailed]) -> None:
        self.result, self.failures = result, failures
        n = len(result.pushes) + len(failures)
        lines = "; ".join(str(f) for f in failures.values())
        super().__init__(
            f"version {result.version.version}: {len(failures)} of {n} replica(s) failed "
            f"({'announced' if result.announced else 'not announced'}): {lines}"
        )


# ---- the publisher ---------------------------------------------------------------------------


def _is_unavailable(e: BaseException) -> bool:
    return isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE


class Publisher:
    """Makes a trained adapter the mesh's new policy version. One caller (the loop) drives it."""

    def __init__(
        self,
        replicas: list[str],
        admin_token: str,
        store_dir: str | Path,
        bus: Bus | None,
        base_model: str,
        *,
        fetch_from: str = "",
        max_attempts: int = 4,
        push_timeout_s: float = 120.0,
        tenant: TenantId = DEFAULT,
    ) -> None:
        """`fetch_from`: this trainer's FetchAdapter address, put in the announcement (an
        attribute: set it once the trainer's server has its port).
        `tenant`: the lineage the versions go into on every replica, and are announced for
        (`bus.weights_subject`, `bus.latest_key`); "" is the default lineage.
        `max_attempts`: tries per replica while it answers UNAVAILABLE (1 = no retry).
        `push_timeout_s`: deadline of one push attempt, verify and load included."""
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.replicas = list(dict.fromkeys(replicas))  # a replica listed twice is pushed once
        self.store = VersionStore(store_dir)
        self._token = admin_token
        self._bus = bus
        self._base_model = base_model
        self.fetch_from = fetch_from
        self._max_attempts = max_attempts
        self._timeout_s = push_timeout_s
        self.tenant = tenant
        self._clients: dict[str, RolloutClient] = {}

    def _client(self, replica: str) -> RolloutClient:
        client = self._clients.get(replica)
        if client is None:
            # Retries are ours (tenacity, below), and the reconnect backoff stays shorter than
            # their waits, so that each retry really tries to connect.
            client = RolloutClient(
                replica, direct_channel(replica, (100, 1000), min_reconnect_backoff_ms=100), retry=False)
            self._clients[replica] = client
        return client

    async def publish(self, version: int, adapter_dir: str | Path) -> PublishResult:
        """Pack, store, push to every replica, announce. Raises `PublishError` if any replica
        did not take the version (after storing it, and announcing it per the module's rule);
        store conflicts raise `FailedPrecondition` before anything is pushed."""
        t0 = time.perf_counter()
        with _tracer.start_as_current_span("publish") as span:
            span.set_attribute("hotloop.version", version)
            data = await asyncio.to_thread(adapters.pack, adapter_dir)
            info = Version(version, adapters.sha256(data), len(data), self._base_model)
            # a retried publish of the same content keeps the first record (and its created_at)
            info = await asyncio.to_thread(self.store.put, info, data)
            latest = self.store.latest()
            if latest is not None and latest.version > info.version:
                # re-announcing an old version would move every replica's "latest" backwards
                raise FailedPrecondition(
                    f"version {info.version} is older than the latest published ({latest.version})"
                )
            span.set_attribute("hotloop.sha256", info.sha256)
            span.set_attribute("hotloop.bytes", info.bytes)

            outcomes = await asyncio.gather(
                *(self._push(r, info, data) for r in self.replicas), return_exceptions=True
            )
            pushes: dict[str, ReplicaPush] = {}
            failures: dict[str, PushFailed] = {}
            for replica, outcome in zip(self.replicas, outcomes):
                if isinstance(outcome, PushFailed):
                    failures[replica] = outcome
                elif isinstance(outcome, BaseException):
                    raise outcome  # a bug, not a replica's answer
                else:
                    pushes[replica] = outcome

            announce = self._bus is not None and (bool(pushes) or not self.replicas)
            if announce:
                await self._announce(version_to_proto(info))
            result = PublishResult(info, pushes, (time.perf_counter() - t0) * 1e3, announce)
            span.set_attribute("hotloop.replicas_failed", len(failures))
            if failures:
                err = PublishError(result, failures)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(err)))
                log.warning("%s", err)
                raise err
            log.info(
                "published v%d (%d bytes, sha %s) to %d replica(s) in %.0f ms",
                info.version, info.bytes, info.sha256[:12], len(pushes), result.total_ms,
            )
            return result

    async def _push(self, replica: str, info: Version, data: bytes) -> ReplicaPush:
        t0 = time.perf_counter()
        attempts = 0
        with _tracer.start_as_current_span("push") as span:
            span.set_attributes({"hotloop.replica": replica, "hotloop.version": info.version})
            client = self._client(replica)
            try:
                async for attempt in AsyncRetrying(
                    stop=stop_after_attempt(self._max_attempts),
                    wait=wait_exponential(multiplier=0.1, max=1.0),
                    retry=retry_if_exception(_is_unavailable),
                    reraise=True,
                ):
                    with attempt:
                        attempts += 1
                        resp = await client.push_adapter(
                            info, data, self._token, timeout_s=self._timeout_s,
                            tenant=self.tenant,
                        )
            except grpc.aio.AioRpcError as e:
                kind = (
                    ReplicaRefused if e.code() in _REFUSALS
                    else ReplicaUnavailable if e.code() in _UNREACHABLE
                    else PushFailed
                )
                failed = kind(replica, info.version, e.code().name, e.details() or "", attempts)
                span.set_attribute("hotloop.attempts", attempts)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(failed)))
                raise failed from e
            span.set_attribute("hotloop.attempts", attempts)
            loaded = resp.loaded
            if (loaded.version, loaded.sha256) != (info.version, info.sha256):
                failed = PushFailed(
                    replica, info.version, "DATA_LOSS",
                    f"replica reports v{loaded.version} sha {loaded.sha256[:12]}, "
                    f"pushed sha {info.sha256[:12]}", attempts,
                )
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(failed)))
                raise failed
            return ReplicaPush(
                replica=replica, push_ms=(time.perf_counter() - t0) * 1e3,
                verify_ms=resp.verify_ms, load_ms=resp.load_ms,
                already_present=resp.already_present, attempts=attempts,
            )

    async def _announce(self, info: common_pb2.VersionInfo) -> None:
        assert self._bus is not None
        msg = bus_pb2.WeightsUpdated(info=info, fetch_from=self.fetch_from, tenant=self.tenant)
        with _tracer.start_as_current_span("announce"):
            # KV first: whoever reacts to the announcement and reads "latest" sees this version,
            # and whoever reads "latest" later finds where to fetch it (`announced_key`)
            await self._bus.kv_put(announced_key(self.tenant), msg)
            await self._bus.kv_put(latest_key(self.tenant), info)
            await self._bus.publish(weights_subject(self.tenant), msg)

    async def reannounce(self) -> Version | None:
        """Announce the store's latest version again (with this trainer's `fetch_from`) if it
        is the mesh's latest (KV "latest", same sha256); returns it, else None. A stored version
        the KV does not hold was never announced (every replica refused it) and stays so."""
        held = self.store.latest()
        if self._bus is None or held is None:
            return None
        kv = await self._bus.kv_get(latest_key(self.tenant), common_pb2.VersionInfo)
        if kv is None or (kv.version, kv.sha256) != (held.version, held.sha256):
            return None
        await self._announce(version_to_proto(held))
        log.info("announced v%d again, fetchable from %s", held.version, self.fetch_from)
        return held

    async def close(self) -> None:
        """Close the replica channels. The bus is the caller's and stays open."""
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()
