"""Hot LoRA updates inside a vLLM worker, at base generation speed (a ``worker_extension_cls``).

Owns: the rollout engine's side of "a new adapter version is on disk -> the next engine step
uses base + scale * B @ A". vLLM mixes this class into its worker when the engine is built with
``worker_extension_cls="services.rollout.worker_ext.HotloopWorkerExtension"``; its methods are
then called by name with ``collective_rpc("hotloop_...", args=(...), kwargs={...})`` on ``LLM``
(sync) or ``AsyncLLM`` (``await``); each returns a list with one result per worker (one here).
Arguments and results are small (paths, ints, dicts of numbers): they cross the client ->
engine-core (msgpack) and engine-core -> worker (pickle) process boundaries.

Why not a LoRA slot: on the CPU backend a LoRA slot generates at about a quarter of base speed.
Why not ``load_weights``: the CPU backend repacks every linear weight into an opaque oneDNN / AMX
handle at load time and leaves ``layer.weight`` empty, so an in-place copy has nowhere to go.
What works is what vLLM itself does after loading: give a module a plain ``weight`` and call
``dispatch_cpu_unquantized_gemm(module, remove_weight=True)``, which builds a new packed handle
and a ``module.cpu_linear`` closure over it. We do that on a *throwaway* module, so the handle
for the next version is built while the live layers keep serving the current one; going live is
then two attribute writes per layer.

Two ways to build a version (``hotloop_prepare(..., mode=)``):
  merged    base + delta merged and packed per layer: generation afterwards runs at exactly base
            speed; building costs two passes over all linear weights (SmolLM2-135M: ~0.1 s on an
            idle core, several times that on a contended one).
  factored  (CPU only) the load-time base handles plus ``y += scale (x @ A^T) @ B^T`` in the
            closure: building is reading the adapter and a few small copies for the fused
            layers (SmolLM2-135M, r=16: under 10 ms), generation runs ~10-20 % below base. A
            version can go live factored and later be replaced by its merged build under the
            same version number.

An adapter is read from its peft directory or from the archive the rollout service stores
(``hotloop.adapters.pack``'s tar): one read into memory, the factors view that buffer.

The building blocks of each path live in ``services/rollout/updates/`` (``merged``, ``factored``,
``device``; what they share in ``common``); this module owns the worker-side state, the RPCs and
the only code that touches live layers.

Protocol (one pending version at a time):
  hotloop_init(model_dir)                read base weights of every linear layer from safetensors
  hotloop_prepare(v, dir, background=, mode=)  validate + build a pending set; live untouched
  hotloop_commit(v)                      swap pending into the live layers (attribute writes)
  hotloop_swap(v, adapter, mode=)        build and commit in one call (engine paused meanwhile)
  hotloop_reset()                        back to the base weights (version 0)
  hotloop_discard() / hotloop_status() / hotloop_live_version()
  hotloop_slots_init(n)                  tenants: n adapter slots served beside the live version,
                                         in the same batch (updates/slots.py)
  hotloop_slot_load(k, label, adapter) / hotloop_slot_free(k) / hotloop_slots_status()

Invariants:
  * The worker keeps its own copy of the base weights (engine dtype, fused layout); merges are
    always base + delta, never incremental, so numerical error does not accumulate over versions.
  * ``hotloop_commit``, ``hotloop_swap`` and ``hotloop_reset`` are the only code that touches
    live layers. They run in the worker's main thread, which also runs forward passes, so a
    swap never lands inside a step: every forward pass sees one version in all layers. A
    background prepare only builds.
  * A failed prepare raises ``ValueError`` and leaves the live layers and any earlier pending
    version untouched (the pending slot is replaced only by a fully built version).
  * The packed handles vLLM built at load time are kept as version 0, so a reset is a swap too.

Not owned here: the KV prefix cache. It lives in the engine core's scheduler, which a worker
cannot reach. With prefix caching on (vLLM's default; commit reports ``prefix_caching``), blocks
computed under an old version can be reused by requests that run under a new one. The caller
either calls ``reset_prefix_cache()`` on the engine after a commit (it succeeds only when no
request holds KV blocks, i.e. after a drain; it returns False otherwise), or tags every request
with ``cache_salt=f"v{version}"`` so versions never share blocks (no reset needed).

With ``enable_lora=True`` the layers are wrapped; this extension works on their ``base_layer``. A
LoRA-slot request served while a merged version is live gets its adapter on top of the merged
weights: use slots only while version 0 is live.

Supported: Llama-style decoder models (q/k/v fused to ``qkv_proj``, gate/up to ``gate_up_proj``,
via the model's ``packed_modules_mapping``), tensor parallel size 1, plain peft LoRA (``lora_alpha
/ r`` or rsLoRA ``lora_alpha / sqrt(r)``, ``rank_pattern`` / ``alpha_pattern``). Refused with a
clear error: adapters on embeddings / ``lm_head`` (tied to the embeddings in small models), DoRA,
LoRA biases, ``modules_to_save`` and other non-LoRA tensors, ranks above ``max_rank``.

Other platforms (CUDA; untested here, import-checked): linear layers keep a real ``weight``.
Prepare only validates and moves the small factors to the device; commit writes base + delta
straight into ``layer.weight`` in place (``addmm(..., out=weight rows)``; reset uses
``weight.data.copy_(base)``), which keeps CUDA-graph captured pointers valid and needs no pending
full copy. The usual GPU path elsewhere is ``model.load_weights`` of merged tensors; LoRA slots
are fast on GPUs, so there the merged path is optional.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .tenants import LABEL_KEY
from .updates import device, factored
from .updates import merged as merged_path
# Re-exported: the shared pieces are part of this module's tested surface.
from .updates.common import (  # noqa: F401
    LinearSpec,
    LoraFactor,
    _Packed,
    build_hf_index,
    discover_linear_specs,
    load_base_weights,
    merge_layer,
    plan_merge,
    read_peft_adapter,
)
from .updates.factored import factor_layer, factored_linear  # noqa: F401
from .updates.merged import pack_cpu  # noqa: F401
from .updates.slots import SlotTable, build_slot


@dataclass
class _Prepared:
    version: int
    adapter_dir: str
    packed: dict[str, _Packed]  # vllm_name -> packed; layers the adapter misses use version 0
    timings: dict[str, float]
    mode: str  # "merged" | "factored"


@dataclass
class _State:
    model_dir: str
    dtype: torch.dtype
    is_cpu: bool
    max_rank: int
    specs: dict[str, LinearSpec]  # vllm_name -> spec
    layers: dict[str, torch.nn.Module]  # vllm_name -> live module (LoRA base_layer if wrapped)
    base: dict[str, torch.Tensor]  # vllm_name -> (N, K) base weight, engine dtype
    v0: dict[str, _Packed]  # the handles vLLM built at load time
    hf_index: dict[str, tuple[str, int]]  # hf module name -> (vllm_name, shard index)
    live_version: int = 0
    live_adapter: str | None = None
    live_mode: str | None = None
    live_packed: dict[str, _Packed] = field(default_factory=dict)  # non-v0 entries that are live
    # A set swapped out by hotloop_swap, freed later (by the next prepare, commit or reset):
    # freeing a merged set (~0.5 GB for a 135M model) took 5-10 ms that the paused engine
    # would otherwise wait for.
    retired: dict[str, _Packed] | None = None
    pending: _Prepared | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    job: threading.Thread | None = None
    job_version: int | None = None
    job_error: BaseException | None = None
    # Tenants' adapters resident beside the live version (hotloop_slots_init); None: off.
    slots: SlotTable | None = None


# --------------------------------------------------------------------------------------------
# The extension (mixed into vLLM's worker; every attribute name is prefixed to avoid clashes)


class HotloopWorkerExtension:
    """Methods vLLM adds to its worker; call them with ``collective_rpc("hotloop_...")``.

    ``self`` is the vLLM worker (CPUWorker / Worker): ``self.get_model()`` and
    ``self.vllm_config`` come from it.
    """

    # ---- helpers -----------------------------------------------------------------------------

    def _hotloop_state(self) -> _State:
        st: _State | None = getattr(self, "_hotloop", None)
        if st is None:
            raise RuntimeError("hotloop_init has not been called on this worker")
        return st

    # ---- RPCs ------------------------------------------------------------------------------------

    def hotloop_init(self, model_dir: str | None = None, max_rank: int = 64) -> dict[str, Any]:
        """Read and keep the base weight of every linear layer; remember load-time handles as v0.

        ``model_dir``: the HF directory the engine serves (default: the engine's model path).
        Checks each loaded base weight against the live layer's output on a probe input, so a
        wrong directory or a wrong shard order fails here, not as silently wrong generations.
        Idempotent: a second call returns the summary without re-reading.
        """
        from vllm.platforms import current_platform

        st0: _State | None = getattr(self, "_hotloop", None)
        if st0 is not None:
            return self._hotloop_summary(st0, {})
        t0 = time.perf_counter()
        model = self.get_model()  # type: ignore[attr-defined]
        model_dir = model_dir or self.vllm_config.model_config.model  # type: ignore[attr-defined]
        dtype: torch.dtype = self.vllm_config.model_config.dtype  # type: ignore[attr-defined]
        specs, layers = discover_linear_specs(model)
        base = load_base_weights(model_dir, specs, dtype)
        t_load = time.perf_counter() - t0
        is_cpu = current_platform.is_cpu()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if not is_cpu:
            base = {k: v.to(device) for k, v in base.items()}
        v0: dict[str, _Packed] = {}
        worst = 0.0
        with torch.no_grad():
            for vname, layer in layers.items():
                # CPU: the load-time handle + its (empty) weight. Elsewhere commit writes in place
                # into layer.weight, so v0 means "copy st.base back", never the live tensor.
                v0[vname] = (
                    _Packed(layer.cpu_linear, layer.weight) if is_cpu else _Packed(None, None)
                )
                worst = max(worst, _probe_error(layer, base[vname], is_cpu))
        if worst > 2e-2:
            raise ValueError(
                f"base weights read from {model_dir} do not match the served model "
                f"(relative error {worst:.3g}); pass the directory the engine was started with"
            )
        self._hotloop = _State(  # type: ignore[attr-defined]
            model_dir=str(model_dir),
            dtype=dtype,
            is_cpu=is_cpu,
            max_rank=max_rank,
            specs=specs,
            layers=layers,
            base=base,
            v0=v0,
            hf_index=build_hf_index(specs),
        )
        return self._hotloop_summary(
            self._hotloop,
            {"init_s": time.perf_counter() - t0, "load_s": t_load, "probe_rel_err": worst},
        )

    def hotloop_prepare(
        self, version: int, adapter_dir: str, background: bool = False, mode: str = "merged"
    ) -> dict[str, Any]:
        """Validate + build ``adapter_dir`` (a peft directory or an adapter archive) as pending
        ``version``; live layers untouched.

        ``mode="merged"``: base + delta merged and packed per layer; generation afterwards runs
        at exactly base speed. Costs about two passes over all linear weights (SmolLM2-135M:
        0.1-0.6 s on one busy core). ``mode="factored"`` (CPU only): keeps the load-time packed
        base GEMMs and adds ``scale (x @ A^T) @ B^T`` in the closure; prepare is reading the
        adapter (ms), generation runs ~10-20 % below base. A version can go
        live factored first and be replaced by its merged build later (same version number).
        ``background=False``: runs here and returns the timing breakdown (the engine does not step
        meanwhile: an RPC runs between steps in the worker's main thread).
        ``background=True``: starts a thread and returns at once; the engine keeps stepping while
        it works (sharing the CPU). Poll ``hotloop_status()`` or just call ``hotloop_commit``,
        which waits for it. A failure is raised by the commit / reported by status.
        Replaces any earlier pending version only once the new one is fully built.
        """
        st = self._hotloop_state()
        if int(version) <= 0:
            raise ValueError("version must be a positive int (0 is the base model)")
        version = int(version)
        if mode not in ("merged", "factored"):
            raise ValueError(f"mode must be 'merged' or 'factored', not {mode!r}")
        if mode == "factored" and not st.is_cpu:
            raise ValueError("mode='factored' is CPU-only; on GPUs use LoRA slots or 'merged'")
        if background:
            with st.lock:
                if st.job is not None and st.job.is_alive():
                    raise RuntimeError(f"prepare of version {st.job_version} is still running")
                st.job_error = None
                st.job_version = version
                st.job = threading.Thread(
                    target=self._hotloop_prepare_job, args=(st, version, adapter_dir, mode),
                    name=f"hotloop-prepare-v{version}", daemon=True,
                )
                st.job.start()
            return {"version": version, "background": True, "mode": mode}
        prepared = _build_prepared(st, version, adapter_dir, mode)
        with st.lock:
            st.pending = prepared
        return {"version": version, "background": False, "mode": mode, **prepared.timings}

    def _hotloop_prepare_job(self, st: _State, version: int, adapter_dir: str, mode: str) -> None:
        if st.is_cpu:
            _off_engine_cores()
        st.retired = None  # freed here, off the engine's thread
        try:
            prepared = _build_prepared(st, version, adapter_dir, mode)
        except BaseException as e:  # reported through status / commit
            st.job_error = e
            return
        with st.lock:
            st.pending = prepared

    def hotloop_commit(
        self, version: int, wait_s: float = 60.0, snapshot: bool = False
    ) -> dict[str, Any]:
        """Make pending ``version`` live: per layer, assign its ``cpu_linear`` and ``weight``.

        Waits up to ``wait_s`` for a background prepare
        of this version. Drops the previously live merged handles. The caller owns the prefix
        cache (see module docstring); ``prefix_caching`` in the result says whether it is on.
        ``snapshot=True`` adds ``tokens_at_commit``: {engine request id: output tokens so far}
        for every request the model runner holds, taken between the same two steps as the swap,
        so token ``n`` of such a request is the first one the new weights sample (an
        independent record of the in-flight boundary; the engine labels steps itself).
        """
        st = self._hotloop_state()
        version = int(version)
        t0 = time.perf_counter()
        job = st.job
        if job is not None and st.job_version == version:
            job.join(timeout=wait_s)
            if job.is_alive():
                raise TimeoutError(f"prepare of version {version} still running after {wait_s}s")
            st.job = None
            if st.job_error is not None:
                err, st.job_error = st.job_error, None
                raise err
        t_wait = time.perf_counter() - t0
        with st.lock:
            if st.pending is None or st.pending.version != version:
                if version == st.live_version:
                    return {"version": version, "already_live": True}
                have = None if st.pending is None else st.pending.version
                raise ValueError(f"version {version} is not prepared (pending: {have})")
            prepared, st.pending = st.pending, None
        return {**self._hotloop_make_live(st, prepared, snapshot), "wait_s": t_wait}

    def hotloop_swap(
        self, version: int, adapter: str, mode: str = "factored", snapshot: bool = False
    ) -> dict[str, Any]:
        """Build ``adapter`` as ``version`` here and now, then make it live: prepare and commit
        in one call, for an engine paused between two steps (in-flight swaps). One call
        instead of two: a caller that sends it right behind the pause (both queue in order,
        and a paused engine runs no step in between) pays for no round trip, and a failed build
        raises before any live layer is touched, with no pending version left to commit by
        mistake. ``snapshot``: as in ``hotloop_commit``. Refused while a background prepare
        runs (its result would become pending behind this version).
        """
        st = self._hotloop_state()
        version = int(version)
        if version <= 0:
            raise ValueError("version must be a positive int (0 is the base model)")
        if mode not in ("merged", "factored"):
            raise ValueError(f"mode must be 'merged' or 'factored', not {mode!r}")
        if mode == "factored" and not st.is_cpu:
            raise ValueError("mode='factored' is CPU-only; on GPUs use LoRA slots or 'merged'")
        with st.lock:
            if st.job is not None and st.job.is_alive():
                raise RuntimeError(f"prepare of version {st.job_version} is still running")
        prepared = _build_prepared(st, version, adapter, mode)
        return {**self._hotloop_make_live(st, prepared, snapshot, defer_free=True),
                **prepared.timings}

    def _hotloop_make_live(self, st: _State, prepared: _Prepared, snapshot: bool,
                           defer_free: bool = False) -> dict[str, Any]:
        t1 = time.perf_counter()
        new_set = {**st.v0, **prepared.packed}
        _swap_in(st, new_set)
        t2 = time.perf_counter()
        # Unless retired, the old set loses its last reference here (and is freed).
        st.retired = st.live_packed if defer_free else None
        st.live_packed = prepared.packed
        t_free = time.perf_counter() - t2
        st.live_version, st.live_adapter = prepared.version, prepared.adapter_dir
        st.live_mode = prepared.mode
        extra: dict[str, Any] = {}
        if snapshot:
            runner = self.model_runner  # type: ignore[attr-defined]
            extra["tokens_at_commit"] = {
                rid: len(r.output_token_ids) for rid, r in runner.requests.items()
            }
        return {
            **extra,
            "version": prepared.version,
            "mode": prepared.mode,
            "swap_s": t2 - t1,
            "free_s": t_free,
            "layers_merged": len(prepared.packed),
            "prefix_caching": self._hotloop_prefix_caching(),
        }

    def hotloop_reset(self) -> dict[str, Any]:
        """Back to the base weights (version 0) by swapping the load-time handles back in."""
        st = self._hotloop_state()
        t0 = time.perf_counter()
        _swap_in(st, st.v0)
        t1 = time.perf_counter()
        st.live_packed, st.retired = {}, None
        st.live_version, st.live_adapter, st.live_mode = 0, None, None
        return {"version": 0, "swap_s": t1 - t0, "free_s": time.perf_counter() - t1,
                "prefix_caching": self._hotloop_prefix_caching()}

    def hotloop_discard(self) -> dict[str, Any]:
        """Drop the pending version (if any) to free its memory."""
        st = self._hotloop_state()
        with st.lock:
            had = None if st.pending is None else st.pending.version
            st.pending = None
        return {"discarded": had}

    def hotloop_live_version(self) -> int:
        return self._hotloop_state().live_version

    # ---- tenants: several adapters in one batch (CPU) ----------------------------------------

    def hotloop_slots_init(self, n: int) -> dict[str, Any]:
        """Give the worker ``n`` adapter slots served in the same batch as the live version
        (services/rollout/updates/slots.py). Each forward's rows are mapped to slots from the
        requests themselves: the model runner's ``_prepare_inputs`` is wrapped, and there the
        batch order (``input_batch.req_ids``, ``num_scheduled_tokens`` per request) is final;
        each request's ``SamplingParams.extra_args["hotloop_adapter"]`` names its adapter. The
        plan is cleared after every ``execute_model``, so a forward that did not go through
        ``_prepare_inputs`` (a dummy run) runs on the live weights only. CPU only. Idempotent."""
        st = self._hotloop_state()
        if st.slots is not None:
            return st.slots.status()
        if not st.is_cpu:
            raise ValueError("adapter slots are CPU-only; on GPUs use vLLM's LoRA slots")
        runner = self.model_runner  # type: ignore[attr-defined]
        if not hasattr(runner, "_prepare_inputs") or not hasattr(runner, "input_batch"):
            raise ValueError(f"{type(runner).__name__} has no _prepare_inputs / input_batch "
                             "(vLLM's V2 model runner?): adapter slots need the V1 runner")
        table = SlotTable(int(n))
        prepare, execute = runner._prepare_inputs, runner.execute_model

        def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            out = prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)
            batch = runner.input_batch
            k = batch.num_reqs
            labels = []
            for rid in batch.req_ids[:k]:
                sp = runner.requests[rid].sampling_params
                extra = sp.extra_args if sp is not None else None
                labels.append(extra.get(LABEL_KEY) if extra else None)
            table.plan(labels, [int(t) for t in num_scheduled_tokens[:k]])
            return out

        def execute_model(*args, **kwargs):
            try:
                return execute(*args, **kwargs)
            finally:
                table.plan([], [])

        runner._prepare_inputs, runner.execute_model = prepare_inputs, execute_model
        st.slots = table
        _swap_in(st, {**st.v0, **st.live_packed})  # the live layers now go through the table
        return table.status()

    def hotloop_slot_load(self, slot: int, label: str, adapter: str) -> dict[str, Any]:
        """Read ``adapter`` (a peft directory or archive) into ``slot`` under ``label``,
        replacing what the slot held. Runs between two engine steps; the caller guarantees no
        running request names the label the slot held (the core's slot manager counts them).
        Returns the slot, the label, the seconds it took and the bytes of its factors."""
        st = self._hotloop_state()
        if st.slots is None:
            raise ValueError("hotloop_slots_init has not been called")
        t0 = time.perf_counter()
        factors = read_peft_adapter(adapter, st.max_rank)
        plan = plan_merge(factors, st.specs, st.hf_index)
        with torch.no_grad():
            built = build_slot(plan, st.specs, st.dtype)
        st.slots.load(int(slot), str(label), built)
        nbytes = sum(f.a.nbytes + f.bt.nbytes for f in built.values())
        return {"slot": int(slot), "label": label, "load_s": time.perf_counter() - t0,
                "bytes": nbytes}

    def hotloop_slot_free(self, slot: int) -> dict[str, Any]:
        st = self._hotloop_state()
        if st.slots is None:
            raise ValueError("hotloop_slots_init has not been called")
        st.slots.free(int(slot))
        return st.slots.status()

    def hotloop_slots_status(self) -> dict[str, Any]:
        st = self._hotloop_state()
        return {"slots": 0, "labels": []} if st.slots is None else st.slots.status()

    def hotloop_status(self) -> dict[str, Any]:
        st = self._hotloop_state()
        job = st.job
        return self._hotloop_summary(st, {
            "job_version": st.job_version if job is not None else None,
            "job_running": bool(job is not None and job.is_alive()),
            "job_error": None if st.job_error is None else repr(st.job_error),
        })

    def _hotloop_prefix_caching(self) -> bool:
        cache_config = self.vllm_config.cache_config  # type: ignore[attr-defined]
        return bool(cache_config.enable_prefix_caching)

    def _hotloop_summary(self, st: _State, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "layers": len(st.specs),
            "base_bytes": sum(t.numel() * t.element_size() for t in st.base.values()),
            "dtype": str(st.dtype).removeprefix("torch."),
            "platform": "cpu" if st.is_cpu else "device",
            "max_rank": st.max_rank,
            "live_version": st.live_version,
            "live_adapter": st.live_adapter,
            "live_mode": st.live_mode,
            "pending_version": None if st.pending is None else st.pending.version,
            "prefix_caching": self._hotloop_prefix_caching(),
            **extra,
        }


# --------------------------------------------------------------------------------------------
# Internals shared by the RPCs


def _off_engine_cores() -> None:
    """Move the calling (build) thread off the cores the engine's threads are bound to, when
    they are bound to a core list and other cores exist. A merged build is ~0.1-0.6 s of CPU:
    on the engine's own core it slowed every step meanwhile, and users who arrived during a
    push waited ~400 ms for a first token instead of ~240 (`hotloop bench joint`, split cores).
    The other cores are the trainer's there, and a trainer is the one that can wait."""
    import os

    from hotloop.threads import bound_cores

    try:
        engine = bound_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
        if engine is None:
            return
        others = set(range(os.cpu_count() or 1)) - engine
        if others:
            os.sched_setaffinity(0, others)
    except (ValueError, OSError):  # an unparsable list or an offline core: build where we are
        return


def _probe_error(layer: torch.nn.Module, base: torch.Tensor, is_cpu: bool) -> float:
    """Relative error between the live layer and ``x @ base.T`` on a fixed probe input."""
    if not is_cpu:
        w = layer.weight
        return float((w.float() - base.float()).norm() / base.float().norm().clamp_min(1e-12))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, base.shape[1], generator=gen).to(base.dtype)
    got = layer.cpu_linear(x, layer.weight, None).float()
    ref = (x.float() @ base.float().T)
    return float((got - ref).norm() / ref.norm().clamp_min(1e-12))


def _build_prepared(st: _State, version: int, adapter_dir: str, mode: str) -> _Prepared:
    """Read, validate and build one adapter version (merged or factored). Never touches live
    layers."""
    t0 = time.perf_counter()
    factors = read_peft_adapter(adapter_dir, st.max_rank)
    plan = plan_merge(factors, st.specs, st.hf_index)
    t1 = time.perf_counter()
    packed: dict[str, _Packed] = {}
    t_merge = t_pack = 0.0
    with torch.no_grad():
        for vname, shards in plan.items():
            ta = time.perf_counter()
            if mode == "factored":
                packed[vname] = factored.build_layer(st.specs[vname], shards, st.dtype, st.v0[vname])
                t_merge += time.perf_counter() - ta
                continue
            if not st.is_cpu:
                packed[vname] = device.prepare_layer(st.base[vname], shards, st.dtype)
                t_merge += time.perf_counter() - ta
                continue
            merged = merge_layer(st.base[vname], st.specs[vname], shards)
            tb = time.perf_counter()
            packed[vname] = merged_path.pack_cpu(merged)
            t_merge += tb - ta
            t_pack += time.perf_counter() - tb
    return _Prepared(
        version, str(adapter_dir), packed,
        {"read_s": t1 - t0, "merge_s": t_merge, "pack_s": t_pack,
         "prepare_s": time.perf_counter() - t0, "layers_merged": float(len(packed))},
        mode,
    )


def _swap_in(st: _State, new_set: dict[str, _Packed]) -> None:
    """Point every live layer at ``new_set`` (all layers, so no layer keeps a stale version)."""
    with torch.no_grad():
        for vname, layer in st.layers.items():
            p = new_set[vname]
            if st.is_cpu:
                # Plain attribute writes: vLLM's CPU linear calls layer.cpu_linear(x, layer.weight,
                # bias) on every forward, so the next forward uses the new handle.
                layer.cpu_linear = (p.cpu_linear if st.slots is None
                                    else st.slots.wrap(vname, p, st.v0[vname]))
                layer._parameters["weight"] = p.weight
            else:
                device.write_layer(layer, st.base[vname], st.specs[vname], p)
