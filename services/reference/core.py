"""The reference core: per-token logprobs of completions under the frozen base model.

Owns: the request/result dataclasses, the backend interface and the one factory that picks a
backend, the torch backend (HF model, no adapter, eval, inference mode, the shared
completion-only chunked computation from `hotloop.logprobs`, micro-batched by a padded-token
budget), and the async path for a bidirectional stream: take whatever requests are waiting,
up to the token budget, score them off the event loop, yield results in arrival order; and the
service's Prometheus metrics (requests, tokens scored, batch seconds).

Does not own: gRPC (server.py converts protos; `InvalidRequest`, a `hotloop.errors`
InvalidArgument, becomes INVALID_ARGUMENT there), the trainer's policy, or deciding which model
is "the base" (config).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import time

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram
from transformers import AutoModelForCausalLM

from hotloop.errors import InvalidArgument
from hotloop.hardware import describe, resolve_device, resolve_dtype, torch_dtype
from hotloop.logprobs import can_share_prompts, score_pairs
from hotloop.metrics import LATENCY_BUCKETS
from hotloop.models import resolve
from services.reference.config import ReferenceConfig

Pair = tuple[Sequence[int], Sequence[int]]  # (prompt_ids, completion_ids)

log = logging.getLogger(__name__)


class InvalidRequest(InvalidArgument, ValueError):
    """A request that cannot be scored (empty prompt, token id outside the vocabulary).

    An `InvalidArgument`, so the service edge maps it to INVALID_ARGUMENT with this message,
    and a `ValueError`, the backend contract's error, so callers catching that keep working.
    `index` is the request's position in the batch given to the backend, when known.
    """

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True)
class LogprobsRequest:
    id: str
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(frozen=True)
class LogprobsResult:
    id: str
    logprobs: list[float]  # one per completion token: log p(c_t | prompt, c_<t)


class ReferenceBackend(ABC):
    """Scores (prompt, completion) pairs; owns its own batching (vLLM schedules itself)."""

    @abstractmethod
    def score(self, pairs: Sequence[Pair]) -> list[list[float]]:
        """Per-token completion logprobs, one list per pair, in the given order. Raises
        ValueError on a request it cannot score (empty prompt, token id out of vocabulary);
        `InvalidRequest` with the pair's `index` lets the core name the request by its id."""


class TorchBackend(ReferenceBackend):
    """Exact reference logprobs with the same code path as the trainer's policy."""

    def __init__(self, cfg: ReferenceConfig, model_dir: Path | None = None) -> None:
        self.cfg = cfg
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        if cfg.flush_denormal:
            torch.set_flush_denormal(True)  # process-wide; a no-op where unsupported
        path = Path(model_dir) if model_dir is not None else resolve(cfg.model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(cfg.dtype, device=cfg.device))
        model.to(resolve_device(cfg.device)).eval().requires_grad_(False)
        self.model = model
        mc = model.config
        pad = mc.pad_token_id if mc.pad_token_id is not None else mc.eos_token_id
        self.pad_id = int(pad if isinstance(pad, int) else 0)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        if cfg.share_prompts and not can_share_prompts(model):
            log.info("share_prompts: %s has sliding-window or hybrid attention; every row "
                     "runs its whole prompt", mc.model_type)
            self.cfg = cfg.model_copy(update={"share_prompts": False})

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        # The trainer runs its bf16 base under autocast; doing the same here keeps the ops
        # (and so the rounding) identical, which is what lets the two agree to ~1e-6.
        if self.cfg.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.model.device.type, dtype=torch_dtype(self.cfg.dtype))

    def _check(self, pairs: Sequence[Pair]) -> None:
        for i, (p, c) in enumerate(pairs):
            if len(p) == 0:
                raise InvalidRequest("empty prompt (at least one token is required)", index=i)
            bad = [t for t in (*p, *c) if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})", index=i
                )

    @torch.inference_mode()
    def score(self, pairs: Sequence[Pair]) -> list[list[float]]:
        self._check(pairs)
        return score_pairs(self.model, pairs, token_budget=self.cfg.token_budget,
                           pad_id=self.pad_id, share_prompts=self.cfg.share_prompts,
                           chunk_tokens=self.cfg.chunk_tokens, temperature=self.cfg.temperature,
                           autocast=self._autocast)


def make_backend(cfg: ReferenceConfig, model_dir: Path | None = None) -> ReferenceBackend:
    """The one place that maps `cfg.backend` to an implementation.

    Extension point for "vllm": add the literal to `ReferenceConfig.backend` and a case here
    returning a backend that asks an engine built *without* LoRA for `prompt_logprobs` of
    prompt+completion (docs/results.md: that works without LoRA, crashes with `enable_lora=True`).
    """
    match cfg.backend:
        case "torch":
            return TorchBackend(cfg, model_dir)
        case other:  # unreachable through a validated config
            raise ValueError(f"unknown reference backend {other!r}")


_END = object()


class ReferenceMetrics:
    """The reference service's Prometheus metrics, on `registry` (a private one by default).
    Updated once per batch, outside the forward pass."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "hotloop_reference_requests", "Requests, by result: scored, or refused (every "
            "request of a batch that held one the model cannot score: it fails as a whole).",
            ["result"], registry=self.registry)
        self.tokens = Counter(
            "hotloop_reference_tokens", "Tokens of scored requests, by kind (prompt, completion; "
            "a completion token gets a logprob).", ["kind"], registry=self.registry)
        self.batch_seconds = Histogram(
            "hotloop_reference_batch_seconds", "Seconds the model took for one batch.",
            buckets=LATENCY_BUCKETS, registry=self.registry)


class ReferenceCore:
    """Frozen base-model logprobs, as plain calls (tests, colocated) or a request stream."""

    def __init__(
        self,
        cfg: ReferenceConfig,
        backend: ReferenceBackend | None = None,
        model_dir: Path | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """`registry`: where the metrics go (the process's in a service)."""
        # `auto` becomes a concrete device and dtype once, here, so the backend, Status and
        # the trainer's start-up check all see the same ones.
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device=device)
        log.info(describe("reference", cfg.dtype, dtype) + f"; device {device}")
        self.cfg = cfg = cfg.model_copy(update={"dtype": dtype, "device": device})
        self.backend = backend if backend is not None else make_backend(cfg, model_dir)
        self.metrics = ReferenceMetrics(registry)

    def logprobs(self, requests: Sequence[LogprobsRequest]) -> list[LogprobsResult]:
        """Score requests; results come back in request order. A request the backend cannot
        score fails the call with `InvalidRequest` naming that request's id."""
        if not requests:
            return []
        m = self.metrics
        t0 = time.perf_counter()
        try:
            rows = self.backend.score([(r.prompt_ids, r.completion_ids) for r in requests])
        except ValueError as e:
            m.requests.labels("refused").inc(len(requests))
            # The backend contract: ValueError means "this input cannot be scored". Name the
            # request by its id, which a caller on a stream can match; a batch index is internal.
            index = getattr(e, "index", None)
            if index is not None and 0 <= index < len(requests):
                who = f"request {requests[index].id!r}"
            else:
                who = f"a batch of {len(requests)} request(s)"
            reason = e.args[0] if e.args else str(e)
            raise InvalidRequest(f"{who}: {reason}", index) from e
        m.batch_seconds.observe(time.perf_counter() - t0)
        m.requests.labels("scored").inc(len(requests))
        m.tokens.labels("prompt").inc(sum(len(r.prompt_ids) for r in requests))
        m.tokens.labels("completion").inc(sum(len(r.completion_ids) for r in requests))
        return [LogprobsResult(id=r.id, logprobs=row) for r, row in zip(requests, rows)]

    async def stream(
        self, requests: AsyncIterable[LogprobsRequest]
    ) -> AsyncIterator[LogprobsResult]:
        """Results for a stream of requests, in arrival order.

        A reader task drains `requests` into a queue so that, whenever the scorer is free, it
        takes everything already waiting (FIFO, up to `token_budget` tokens, at least one
        request) as one batch; it never waits for more to arrive. Scoring runs in a worker
        thread so the event loop (and the gRPC server on it) stays responsive. An error from
        the request iterator or the backend propagates to the consumer.
        """
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def read() -> None:
            try:
                async for r in requests:
                    await queue.put(r)
                await queue.put(_END)
            except Exception as e:  # handed to the consumer, which re-raises it
                await queue.put(e)

        reader = asyncio.create_task(read())
        pending: deque[LogprobsRequest] = deque()
        ended = False

        def take(item: Any) -> None:
            nonlocal ended
            if isinstance(item, Exception):
                raise item
            if item is _END:
                ended = True
            else:
                pending.append(item)

        try:
            while True:
                if not pending and not ended:
                    take(await queue.get())
                while not ended:  # everything already waiting, without blocking
                    try:
                        take(queue.get_nowait())
                    except asyncio.QueueEmpty:
                        break
                if not pending:
                    return
                batch = [pending.popleft()]
                used = batch[0].num_tokens
                while pending and used + pending[0].num_tokens <= self.cfg.token_budget:
                    used += pending[0].num_tokens
                    batch.append(pending.popleft())
                for result in await asyncio.to_thread(self.logprobs, batch):
                    yield result
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
