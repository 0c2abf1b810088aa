"""Configuration of the rollout service (section `[rollout]`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hotloop.config import ServiceSection


class RolloutConfig(ServiceSection):
    """The `[rollout]` section: the serving engine, how a new version becomes live, request
    limits, and how a replica catches up on versions it missed."""

    host: str = "127.0.0.1"
    """Interface to listen on."""
    port: int = Field(0, ge=0, le=65535)
    """Port to listen on; 0 picks a free one (written to the port file)."""
    update_mode: Literal["auto", "merged", "lora"] = "auto"
    """How a new version becomes live. `merged`: the adapter is merged into the engine's
    weights (full-speed generation; one live version, swapped between requests). `lora`: each
    version is a LoRA slot (any held version can be pinned per request; on the CPU backend
    generation runs several times slower). `auto`: merged on CPU, lora on CUDA."""
    max_lora_rank: int = Field(16, ge=1, le=256)
    """Largest adapter rank a push may carry."""
    max_loras: int = Field(2, ge=1, le=64)
    """LoRA slots in one engine step (lora mode)."""
    tenant_slots: int = Field(4, ge=0, le=64)
    """CPU, merged mode: tenants' adapter versions resident in the worker at once, served in
    the same batch as the default lineage (a low-rank term per slot over its requests' rows).
    More tenants than slots: loaded on demand, the least recently used one nobody runs on
    evicted. 0: tenants refused. (lora mode: vLLM's `max_loras` slots do this.)"""
    engine_stall_s: float = Field(60.0, ge=0.0)
    """An engine that holds requests (or a call into its core) and makes no step for this
    long is hung: its requests fail with UNAVAILABLE (the gateway re-routes those without a
    token yet) and the service stops with exit code 1, to be restarted (services/rollout/
    heartbeat.py). 0: never. Keep it well above the longest stretch in which no request gets a
    token (a long prompt's whole prefill, on a slow CPU with nothing else decoding: seconds at
    `max_model_len` 1024 here) and the longest weight swap."""
    tenant_slot_wait_s: float = Field(30.0, gt=0)
    """Longest a tenant's request waits for a slot while every slot is held by running
    requests of other versions; then it fails with RESOURCE_EXHAUSTED."""
    tenant_fetch_wait_s: float = Field(10.0, gt=0, le=3600)
    """Longest a tenant's request waits on a replica that holds no version of the tenant's
    lineage while the mesh announced one (the replica restarted, or the tenant is new to it)
    for catch-up to fetch it; then it fails with UNAVAILABLE (the gateway tries another
    replica). The tenant is never served the base model in its place."""
    keep_versions: int = Field(3, ge=1, le=100)
    """Versions kept on this replica (newest first), per lineage (the default one and each
    tenant's); older unused ones are retired."""
    max_prompt_tokens: int = Field(1536, ge=1)
    """Longest prompt accepted, in tokens."""
    max_n: int = Field(64, ge=1, le=1024)
    """Most samples per prompt."""
    max_new_tokens: int = Field(1024, ge=1)
    """Most new tokens per sample."""
    max_prompts: int = Field(256, ge=1)
    """Most prompts in one Generate call."""
    default_max_tokens: int = Field(128, ge=1)
    """max_tokens when a request leaves it 0."""
    swap: Literal["auto", "drain", "inflight"] = "auto"
    """merged mode: how a new version goes live while requests are running. `drain`: close
    admission, let in-flight requests finish on their version, swap, reopen (every completion
    has one version; push-to-first-token waits for the longest running request). `inflight`:
    pause the engine between two steps, swap, resume: running sequences continue on the new
    weights and their `version_spans` say from which token (per-token logprobs stay the
    serving policy's, which is what the trainer's importance ratio needs). `auto`: the measured
    default (docs/architecture.md, "The rollout service and the version rule")."""
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    """vLLM scheduler policy. `priority`: a request's `priority` orders admission (lower first:
    users before training rollouts); `fcfs` ignores it."""
    max_num_batched_tokens: int | None = Field(None, ge=8)
    """Most tokens one engine step computes (vLLM's chunked-prefill budget): the running
    requests' next tokens first, then chunks of waiting prompts. Every user whose answer is
    streaming waits for the whole step, so this bounds how long a training batch's prefill can
    stall them: admitted whole, a PPO batch's prompts made one step of about a second on one
    core. None: vLLM's default (2,048 on the CPU). At least `max_num_seqs`."""
    training_prompts_beside_users: int = Field(0, ge=0)
    """Most training prompts (priority > 0) the engine runs at once while any user's request
    is in flight, entering one prefill at a time; 0: no limit. Users share every engine step
    with the training samples beside them and a step's time grows with its sequences, so this
    bounds what training adds to users' time to first token and to their streams' stalls; and
    the engine serves prompts in mid-prefill before a waiting user's, so one prefill at a time
    bounds a user's wait behind training prompts by one prompt's chunks. With no user on the
    replica a training batch runs whole (`rollout.core.TrainingGate`)."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Most sequences the engine runs at once (vLLM's; None: its default, 128 on the CPU)."""
    swap_drain_timeout_s: float = Field(120.0, gt=0)
    """merged mode: longest wait for in-flight requests to finish before a version swap."""
    enforce_eager: bool = True
    """Skip torch.compile. Measured on the AVX512 (no AMX) CPU, fp32, SmolLM2-135M, 8 x 8 x 128
    tokens: compiled 418 tok/s vs eager 387 (1.08x) for 76 s of start-up vs 16 s, which a
    15-minute run does not win back; on the AMX machine compiled ran ~1.35x (docs/results.md)."""
    kv_cache_gib: int = Field(2, ge=1)
    """CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    cpu_omp_threads_bind: str = "auto"
    """VLLM_CPU_OMP_THREADS_BIND: `auto`, `nobind`, or a core list like `0-1`. With a core
    list the engine core process starts pinned there too (it busy-waits for the worker, and
    on a core of its own it would take most of that core from other work)."""
    omp_wait_policy: Literal["default", "passive", "active"] = "default"
    """OMP_WAIT_POLICY for the engine's OpenMP threads. `default` leaves OpenMP's own (spin a
    while, then sleep): measured 2-9% faster generation than `passive`, with no slowdown of a
    trainer beside an idle engine (`hotloop bench threads`)."""
    cpu_reserved_cpus: int = Field(0, ge=0)
    """VLLM_CPU_NUM_OF_RESERVED_CPU: cores left to other work (vLLM reserves 1 by default;
    on a 2-core box that halves generation speed)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """CUDA: share of GPU memory the engine takes (leave room for trainer/reference)."""
    storage_dir: str = ""
    """Where received adapters are unpacked; empty: `<run_dir>/rollout-<port>/adapters`."""
    catchup_timeout_s: float = Field(60.0, ge=0, le=3600)
    """Start-up: longest wait to fetch and load the mesh's latest announced version of every
    lineage (bus KV `latest` and each tenant's `latest.tenant.<name>`, from the trainers'
    FetchAdapter; all lineages at once) before the replica reports SERVING. Past it, or at
    once for a lineage whose trainer address is unknown (`[endpoints] trainer`, and for a
    tenant `[tenants.<name>] trainer`, unset and no announcement heard: waiting could not
    help), the replica serves what it has and reports itself behind (Status
    `known_latest_version` above `latest_version`, per tenant too; the gateway skips a replica
    more than its `max_version_lag` behind) while it keeps catching up in the background. Bounded
    rather than unbounded so that a trainer that is gone for good leaves a replica that says
    so, not one that never starts; 60 s covers a trainer restarting (~10-30 s here)."""
    catchup_poll_s: float = Field(30.0, gt=0, le=3600)
    """How often each lineage's latest version is re-read from the bus, and the tenants'
    lineages listed again, besides the announcements, which trigger a look at once, and
    reconnects: core NATS delivers an announcement at most once."""
    catchup_retry_max_s: float = Field(30.0, gt=0, le=3600)
    """Longest wait between two failed catch-up attempts (the wait doubles from 0.5 s)."""

    @model_validator(mode="after")
    def _step_budget(self) -> "RolloutConfig":
        # vLLM refuses a step budget below its running-sequence limit, whose CPU default is 128
        if self.max_num_batched_tokens is not None and \
                self.max_num_batched_tokens < (self.max_num_seqs or 256):
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below "
                             f"max_num_seqs ({self.max_num_seqs or 'vLLM default, up to 256'}): "
                             "set max_num_seqs to at most max_num_batched_tokens")
        return self
