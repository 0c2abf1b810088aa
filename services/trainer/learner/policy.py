"""The LoRA policy: a frozen base model with a trainable peft adapter and its optimizer.

Owns: loading the base (HF directory) with a LoRA adapter, AdamW over the adapter only, one
training update per `train_step` (micro-batches by token budget, exact gradient accumulation,
clipping, a non-finite guard), scoring completions with or without the adapter, writing the
adapter as a publishable directory, and checkpoint save/restore (via checkpoint.py).

Does not own: the algorithm math (algorithms.py), sampling, rewards, publishing versions to
rollout replicas, or the loop. Errors in inputs propagate; a non-finite loss or gradient is a
result (`StepMetrics.skipped`), not an exception, because one bad batch should not kill a run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from hotloop.hardware import describe, resolve_device, resolve_dtype, torch_dtype
from hotloop.logprobs import (
    PromptSet,
    PromptStates,
    PromptTrunk,
    Trunk,
    can_share_prompts,
    can_split,
    completion_hidden,
    completion_logprobs,
    prompt_states,
    prompt_trunk,
    score_pairs,
    trunk_states,
)
from hotloop.models import resolve
from services.trainer.learner.algorithms import loss_normalizer, make_algorithm
from services.trainer.learner.batching import (
    MicroBatch,
    Sample,
    check_samples,
    make_micro_batches,
)
from services.trainer.learner.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from services.trainer.learner.distributed import SOLO, DataParallel
from services.trainer.config import TrainerConfig

if TYPE_CHECKING:
    from services.trainer.learner.critic import Critic

__all__ = ["LoraPolicy", "Sample", "StepMetrics"]

log = logging.getLogger(__name__)


@dataclass
class StepMetrics:
    """One `train_step`. Loss-side values are token means over the whole batch."""

    step: int  # optimizer steps applied so far, this one included
    loss: float
    grad_norm: float  # before clipping
    tokens: int  # completion tokens
    sequences: int
    micro_batches: int  # summed over the data-parallel ranks
    seconds: float
    lr: float
    skipped: bool = False
    skip_reason: str | None = None
    extra: dict[str, float] = field(default_factory=dict)  # pg_loss, kl, clip_frac, ...

    def as_dict(self) -> dict[str, float]:
        """Flat numeric view (for TrainerStatus.last_metrics, logs)."""
        d = {k: float(v) for k, v in asdict(self).items() if isinstance(v, (int, float, bool))}
        d.update(self.extra)
        return d


def target_modules(base: torch.nn.Module, configured: str | list[str],
                   top_layers: int | None) -> str | list[str]:
    """`[trainer.lora] target_modules` as peft takes it. peft selects layers only among named
    modules, so with `top_layers` "all-linear" becomes the names of the body's linear layers
    (every `nn.Linear` but the output head, as peft's own "all-linear" picks)."""
    if configured != "all-linear" or top_layers is None:
        return configured
    head = base.get_output_embeddings()
    return sorted({name.rpartition(".")[2] for name, m in base.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def adapted_layers(model_config: Any, top_layers: int | None) -> list[int] | None:
    """The decoder layers `[trainer.lora] top_layers` adapts: the top N, as peft's
    `layers_to_transform` takes them (None: every layer). Nothing below the lowest of them
    requires a gradient, so the backward stops there (`LoraSettings.top_layers`)."""
    if top_layers is None:
        return None
    n = int(model_config.num_hidden_layers)
    if top_layers > n:
        raise ValueError(f"[trainer.lora] top_layers = {top_layers}, but the model has {n} "
                         "decoder layers")
    return list(range(n - top_layers, n))


class Interrupted(Exception):
    """`train_step` was asked to stop before it applied its update (nothing changed)."""


@dataclass
class _Base:
    """The colocated reference inside one `train_step` (`reference=True`, with `split` set,
    or for `kl_estimator = "full"`): the layers below the split run once per micro-batch
    without a graph, the layers above (every layer without a split) run with the adapter off
    for the reference, then with it on (and a graph) for the policy."""

    seconds: float = 0.0  # in the reference's forwards, trunk excluded
    prompts: PromptTrunk | None = None
    base_prompts: PromptStates | None = None

    def prompts_of(self, policy: LoraPolicy, shared: PromptSet) -> PromptTrunk | None:
        """The shared prompts' trunk (None without a split: the whole body differs), and their
        states under the base (kept for `score`)."""
        with torch.no_grad(), policy.autocast():
            if policy.split is not None:
                self.prompts = prompt_trunk(policy.model, shared, policy.split)
            t = time.perf_counter()
            with policy.model.disable_adapter():
                self.base_prompts = prompt_states(policy.model, shared, self.prompts)
            self.seconds += time.perf_counter() - t
        return self.prompts

    def score(self, policy: LoraPolicy, mb: MicroBatch
              ) -> tuple[Trunk | None, torch.Tensor, torch.Tensor | None]:
        """(the micro-batch's trunk, its reference logprobs [B, Tc], and with
        `kl_estimator = "full"` the reference's whole distributions [N, V]). Without a split
        (LoRA on every layer) the trunk is None and the reference runs the whole body."""
        cfg = policy.cfg
        full = cfg.loss.kl_estimator == "full"
        with torch.no_grad(), policy.autocast():
            trunk = (None if policy.split is None else
                     trunk_states(policy.model, mb.batch, policy.split, self.prompts))
            t = time.perf_counter()
            with policy.model.disable_adapter():
                ref = completion_logprobs(policy.model, mb.batch,
                                          chunk_tokens=cfg.logprob_chunk_tokens,
                                          temperature=cfg.temperature, prompts=self.base_prompts,
                                          trunk=trunk, keep_distributions=full)
            self.seconds += time.perf_counter() - t
        return trunk, ref.logprobs, ref.distributions


class LoraPolicy:
    """Base model + LoRA adapter + AdamW. Not thread-safe: one caller drives it.

    `dp`: the data-parallel group this replica's `train_step` reduces over (distributed.py;
    build through `distributed.make_policy`, which starts the other ranks); one rank alone by
    default."""

    def __init__(self, cfg: TrainerConfig, model_dir: Path | None = None,
                 dp: DataParallel = SOLO) -> None:
        # `auto` becomes a concrete device and dtype once, here; everything below reads
        # self.cfg.device / self.cfg.dtype.
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device=device)
        log.info(describe("trainer", cfg.dtype, dtype) + f"; device {device}")
        self.cfg = cfg = cfg.model_copy(update={"dtype": dtype, "device": device})
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        if cfg.flush_denormal:
            torch.set_flush_denormal(True)  # process-wide; a no-op where unsupported
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        path = Path(model_dir) if model_dir is not None else resolve(cfg.model)
        # The frozen base is stored in the compute dtype (bf16 halves its memory and skips a
        # per-step cast); peft keeps the adapter in float32 (autocast_adapter_dtype), so the
        # trained weights and AdamW state are full precision.
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(cfg.dtype)).to(device)
        lora = LoraConfig(
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=target_modules(base, cfg.lora.target_modules, cfg.lora.top_layers),
            layers_to_transform=adapted_layers(base.config, cfg.lora.top_layers),
            task_type="CAUSAL_LM",
        )
        self.model: PeftModel = get_peft_model(base, lora)
        # named_parameters order is deterministic, so a rebuilt policy maps a saved optimizer
        # state onto the same tensors. Fixed here, not read from `requires_grad` later: peft's
        # `disable_adapter` turns that off on every adapter tensor while a reference runs.
        self._named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in self._named]
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self._params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
        )
        self.algorithm = make_algorithm(cfg)
        self.step = 0
        self.dp = dp
        mc = base.config
        pad = mc.pad_token_id if mc.pad_token_id is not None else mc.eos_token_id
        self.pad_id = int(pad if isinstance(pad, int) else 0)
        if cfg.share_prompts and not can_share_prompts(self.model):
            log.info("share_prompts: %s has sliding-window or hybrid attention; every row "
                     "runs its whole prompt", mc.model_type)
            self.cfg = cfg = cfg.model_copy(update={"share_prompts": False})
        # The first adapted layer, when LoRA leaves the ones below it the base's: a step that
        # computes its own reference runs them once for both forwards (`train_step`).
        adapted = adapted_layers(mc, cfg.lora.top_layers)
        self.split = adapted[0] if adapted and adapted[0] > 0 and can_split(self.model) else None
        self.base_model_path = path
        # What a saved critic is checked against: the base's shape, not its path (the same
        # model can live in another directory on another host).
        self.base_model_name = (f"{mc.model_type}:{mc.num_hidden_layers}x{mc.hidden_size}"
                                f":vocab{mc.vocab_size}")

    # ---------------------------------------------------------------------------- training

    def trainable_tensors(self) -> list[torch.Tensor]:
        """The policy adapter's parameters, in optimizer order."""
        return list(self._params)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The compute-dtype context every forward of this policy runs under."""
        if self.cfg.dtype == "float32":
            return contextlib.nullcontext()
        device = next(iter(self._params)).device.type
        return torch.autocast(device_type=device, dtype=torch_dtype(self.cfg.dtype))

    def train_step(self, samples: Sequence[Sample],
                   should_stop: Callable[[], bool] | None = None,
                   critic: Critic | None = None, reference: bool = False) -> StepMetrics:
        """One optimizer update on `samples` (an empty list is an error).

        `reference`: the step computes each sample's `ref_logprobs` itself, under the base
        (the adapter off: the colocated reference), in place of any given. With LoRA on the
        top layers only (`self.split`), each micro-batch runs the layers below them once, for
        both forwards (`hotloop.logprobs.trunk_states`); the result is the one
        `base_logprobs` then a step give. `StepMetrics.extra["reference_s"]`: the seconds the
        reference took (the trunk is counted with the step).

        `should_stop` is polled before each micro-batch and before the update: a run that is
        asked to stop (Ctrl-C) then raises `Interrupted` within one micro-batch with the
        policy unchanged, instead of finishing a step that can take minutes on a slow CPU.

        The loss of each micro-batch is divided by the whole batch's normalizer
        (`loss_normalizer`), so the accumulated gradient equals the full-batch gradient no
        matter how the token budget splits the batch.

        With a `critic` (PPO), each micro-batch also trains the critic's value loss (its head
        reads the hidden states this forward computed, or its own trunk's; `Critic.backward`
        runs the backward), and both optimizers step together. A value loss above
        `critic.cfg.max_value_loss` (divergence) skips the whole update, like a NaN does.

        With data-parallel ranks (`self.dp`, distributed.py) every rank runs this on the whole
        batch and trains its shard; the normalizer stays the whole batch's, gradients are
        summed before clipping, metrics are the whole batch's, and skips and stops are agreed,
        so the update and the returned metrics are the one-rank ones.
        """
        if not samples:
            raise ValueError("train_step needs at least one sample")
        full = self.cfg.loss.kl_beta > 0 and self.cfg.loss.kl_estimator == "full"
        if full and not (reference and self.dp.world == 1):
            raise ValueError(
                '[trainer.loss] kl_estimator = "full" needs the reference\'s whole distributions: '
                "the colocated reference ([online] reference = \"colocated\") on one rank")
        if reference and (self.dp.world > 1 or (self.split is None and not full)):
            # whole forwards: the base's, then the step's (the ranks take the samples as given)
            t = time.perf_counter()
            ref = self.base_logprobs([(s.prompt_ids, s.completion_ids) for s in samples])
            samples = [replace(s, ref_logprobs=r) for s, r in zip(samples, ref)]
            seconds = time.perf_counter() - t
            m = self.train_step(samples, should_stop, critic)
            m.extra["reference_s"] = seconds
            return m
        if reference:
            samples = [replace(s, ref_logprobs=None) for s in samples]
        elif self.cfg.loss.kl_beta > 0 and any(s.ref_logprobs is None for s in samples):
            raise ValueError("kl_beta > 0: every sample needs ref_logprobs")
        check_samples(samples)  # here, before the other ranks are handed the step
        update = functools.partial(self._update, reference=reference)  # one rank when set
        return self.dp.step(self, update, samples, should_stop, critic)

    def _update(self, samples: Sequence[Sample], should_stop: Callable[[], bool] | None,
                critic: Critic | None, reference: bool = False) -> StepMetrics:
        """`train_step` on this rank, after the checks (every rank runs it: `self.dp`);
        `reference`: with the trunk shared (one rank, `self.split` set)."""
        t0 = time.perf_counter()
        cfg, dp = self.cfg, self.dp
        self._schedule_lr()
        # The whole batch's, on every rank: the ranks' gradients then sum to the batch's.
        normalizer = loss_normalizer(
            [len(s.completion_ids) for s in samples], cfg.loss.aggregation, cfg.loss.norm_tokens
        )
        tokens = sum(len(s.completion_ids) for s in samples)
        mine = dp.shard(samples)
        micro, shared = (make_micro_batches(mine, cfg.micro_batch_tokens, self.pad_id,
                                            cfg.share_prompts) if mine else ([], None))
        counts = dp.counts(len(micro))

        def result(
            loss: float, grad_norm: float, extra: dict[str, float], reason: str | None
        ) -> StepMetrics:
            return StepMetrics(
                step=self.step,
                loss=loss,
                grad_norm=grad_norm,
                tokens=tokens,
                sequences=len(samples),
                micro_batches=sum(counts),
                seconds=time.perf_counter() - t0,
                lr=self.optimizer.param_groups[0]["lr"],
                skipped=reason is not None,
                skip_reason=reason,
                extra=extra,
            )

        self.model.train()
        self._zero_grad(critic)
        total = 0.0
        sums: dict[str, float] = {}  # token sums of the metrics
        prompts = leaves = None
        base = _Base() if reference else None
        self._check_stop(should_stop, critic)
        if shared is not None:
            # Each distinct prompt runs once; every micro-batch's backward stops at the leaves,
            # and one backward after the last carries their gradients through the prompts.
            trunk = None
            if base is not None:
                trunk = base.prompts_of(self, shared)
            with self.autocast():
                prompts = prompt_states(self.model, shared, trunk)
            leaves = prompts.leaves()
        # As many rounds on every rank, so that all of them poll and agree as often; a rank
        # with fewer micro-batches idles through the last rounds.
        for i in range(max(counts)):
            if i:
                self._check_stop(should_stop, critic)
            loss_value, m = (self._micro_step(micro[i], leaves, normalizer, tokens, critic, base)
                             if i < len(micro) else (0.0, {}))
            if dp.agree(not math.isfinite(loss_value)):
                self._zero_grad(critic)
                return result(loss_value if not math.isfinite(loss_value) else math.nan,
                              math.nan, {}, "non-finite loss")
            total += loss_value
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
        if prompts is not None:
            prompts.backward_into(leaves)
            prompts = leaves = None  # the prompts' graph is freed before the optimizer runs
        total, sums = dp.sum_metrics(total, sums)
        extra = {k: v / max(tokens, 1) for k, v in sums.items()}
        if base is not None:
            extra["reference_s"] = base.seconds
        if critic is not None and not extra["value_loss"] <= critic.cfg.max_value_loss:
            self._zero_grad(critic)
            return result(total, math.nan, extra,
                          f"value loss diverged ({extra['value_loss']:.3g} > "
                          f"{critic.cfg.max_value_loss:g})")

        # The whole batch's gradient on every rank: clipping and the optimizers then run
        # identically everywhere, and the replicas stay equal.
        dp.sum_gradients([*self._params, *(critic.params if critic is not None else [])])
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self._params, cfg.optimizer.max_grad_norm)
        )
        if critic is not None:
            extra["critic_grad_norm"] = float(
                torch.nn.utils.clip_grad_norm_(critic.params, cfg.optimizer.max_grad_norm))
            grad_norm = grad_norm if math.isfinite(extra["critic_grad_norm"]) else math.nan
        if not math.isfinite(grad_norm):
            self._zero_grad(critic)
            return result(total, grad_norm, extra, "non-finite gradient")
        self._check_stop(should_stop, critic)
        # Gradients stay on the parameters until the next step zeroes them (inspectable).
        self.optimizer.step()
        if critic is not None:
            critic.optimizer.step()
        self.step += 1
        return result(total, grad_norm, extra, None)

    def _micro_step(self, mb: MicroBatch, leaves: Any, normalizer: float, tokens: int,
                    critic: Critic | None, base: _Base | None = None,
                    ) -> tuple[float, dict[str, float]]:
        """Forward and backward of one micro-batch (none when its loss is not finite): its
        loss (its share of the batch's) and its metrics as token sums. With `base`, the
        micro-batch's reference logprobs first, from the trunk the policy's forward shares."""
        cfg = self.cfg
        trunk, ref, ref_dists = None, mb.ref_logprobs, None
        if base is not None:
            trunk, ref, ref_dists = base.score(self, mb)
        with self.autocast():
            hidden = completion_hidden(self.model, mb.batch, leaves, trunk)
            out = completion_logprobs(
                self.model,
                mb.batch,
                chunk_tokens=cfg.logprob_chunk_tokens,
                temperature=cfg.temperature,
                with_entropy=cfg.log_entropy,
                hidden=hidden,
                kl_to=ref_dists,
            )
        del ref_dists  # [N, V]: freed before the backward
        dev = out.logprobs.device  # the batch is assembled on the CPU
        loss, m = self.algorithm.loss(
            out.logprobs,
            mb.old_logprobs.to(dev),
            None if ref is None else ref.to(dev),
            mb.advantages.to(dev),
            out.mask,
            normalizer=normalizer,
            entropy=out.entropy,
            kl=out.kl,
        )
        n = m.pop("tokens")
        sums = {k: v * n for k, v in m.items()}
        if critic is None:
            loss_value = float(loss.detach())
            if math.isfinite(loss_value):
                loss.backward()
            return loss_value, sums
        # The critic runs the backward(s): its value loss joins this graph (shared trunk) or
        # follows it on its own trunk. Outside autocast: float32 head.
        loss_value, value_sums = critic.backward(mb, hidden, loss, float(max(tokens, 1)))
        return loss_value, {**sums, **value_sums}

    def optimizer_steps(self) -> int:
        """Steps the optimizer's state has taken (0 with no state: fresh, or reset); the most
        of any parameter's (AdamW skips one that had no gradient)."""
        return max((int(s["step"]) for s in self.optimizer.state.values() if "step" in s),
                   default=0)

    def _schedule_lr(self) -> None:
        """Set the learning rate of the next update (`[trainer.optimizer] decay_steps`)."""
        opt = self.cfg.optimizer
        if opt.decay_steps is None:
            return
        lr = opt.lr / math.sqrt(1.0 + self.optimizer_steps() / opt.decay_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _zero_grad(self, critic: Critic | None) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if critic is not None:
            critic.optimizer.zero_grad(set_to_none=True)

    def _check_stop(self, should_stop: Callable[[], bool] | None,
                    critic: Critic | None = None) -> None:
        # Polled on rank 0 (the others have no `should_stop`) and agreed by every rank.
        if self.dp.agree(should_stop is not None and should_stop()):
            self._zero_grad(critic)
            raise Interrupted("stop requested; the update was not applied")

    # ----------------------------------------------------------------------------- scoring

    @torch.inference_mode()
    def _score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        self.model.eval()
        return score_pairs(self.model, pairs, token_budget=self.cfg.micro_batch_tokens,
                           pad_id=self.pad_id, share_prompts=self.cfg.share_prompts,
                           chunk_tokens=self.cfg.logprob_chunk_tokens,
                           temperature=self.cfg.temperature, autocast=self.autocast)

    def logprobs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """Per-token logprobs of each (prompt_ids, completion_ids) under the current policy."""
        return self._score(pairs)

    def base_logprobs(
        self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[list[float]]:
        """The same under the frozen base (adapter disabled): the colocated reference."""
        with self.model.disable_adapter():
            return self._score(pairs)

    # ------------------------------------------------------------------------ persistence

    def save_adapter(self, directory: Path, weights: Sequence[torch.Tensor] | None = None) -> Path:
        """Write the adapter (adapter_config.json + adapter_model.safetensors) to `directory`,
        which must not exist yet; written under a temporary name and renamed, so a reader
        never sees a half-written adapter. Returns the directory. `weights`: tensors in
        `trainable_tensors` order to write in place of the trained ones (a lineage's served
        average, averaging.py); the policy's own are back when this returns."""
        directory = Path(directory)
        if directory.exists():
            raise FileExistsError(f"{directory} exists; adapter versions are immutable")
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.with_name(f".tmp-{directory.name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with self._weights(weights):
                self.model.save_pretrained(tmp, selected_adapters=["default"])  # not a critic's
            tmp.rename(directory)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return directory

    @contextlib.contextmanager
    def _weights(self, weights: Sequence[torch.Tensor] | None) -> Iterator[None]:
        """The adapter's parameters hold `weights` (None: their own) inside the block."""
        if weights is None:
            yield
            return
        params = self.trainable_tensors()
        if len(weights) != len(params):
            raise ValueError(f"{len(weights)} tensors for an adapter of {len(params)}")
        own = [p.data for p in params]
        try:
            for p, w in zip(params, weights):
                if w.shape != p.shape:
                    raise ValueError(f"a tensor of shape {tuple(w.shape)} for a parameter of "
                                     f"{tuple(p.shape)}")
                p.data = w.to(device=p.device, dtype=p.dtype)
            yield
        finally:
            for p, t in zip(params, own):
                p.data = t

    def read_adapter(self, files: dict[str, Any]) -> list[torch.Tensor]:
        """The tensors of an adapter this policy saved (`save_adapter`'s files, by name: an
        archive's members, `hotloop.adapters.read_archive`), in `trainable_tensors` order, on
        the policy's device and dtype. An adapter of another shape (another rank, other
        layers or modules) is a ValueError naming what differs."""
        from safetensors.torch import load

        data = files.get("adapter_model.safetensors")
        if data is None:
            raise ValueError("not an adapter: no adapter_model.safetensors")
        saved = load(bytes(data))
        out = []
        for name, p in self.trainable_parameters():
            key = name.replace(".default", "")  # how peft names a saved adapter's tensors
            t = saved.pop(key, None)
            if t is None or t.shape != p.shape:
                got = "missing" if t is None else f"shape {tuple(t.shape)}"
                raise ValueError(f"{key}: {got}, this policy's is {tuple(p.shape)}")
            out.append(t.to(device=p.device, dtype=p.dtype))
        if saved:
            raise ValueError(f"{len(saved)} tensors this policy does not train, e.g. {next(iter(saved))}")
        return out

    def save_checkpoint(self, root: Path, data_position: dict[str, Any] | None = None,
                        extras: dict[str, Callable[[Path], None]] | None = None) -> Path:
        """Checkpoint adapter, optimizer, step and RNG states under `root` (checkpoint.py);
        `extras` write subdirectories of the same checkpoint (PPO's critic)."""
        return save_checkpoint(
            root,
            step=self.step,
            model=self.model,
            optimizer=self.optimizer,
            data_position=data_position,
            extras=extras,
        )

    def restore(self, path: Path) -> TrainerState:
        """Resume from a checkpoint directory; returns its step and data position."""
        state = load_checkpoint(path, model=self.model, optimizer=self.optimizer)
        self.step = state.step
        self.dp.state_changed()  # the other ranks take this state before the next step
        return state

    def close(self) -> None:
        """Stop the other data-parallel ranks, if any (nothing to do for one rank)."""
        self.dp.close()

    def trainable_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of the adapter parameters, in optimizer order (whether or not a
        reference pass has the adapter disabled just now)."""
        return iter(self._named)
