"""Typed configuration of the trainer service (pydantic; no torch import here).

Owns: every knob of the trainer core (algorithm, loss, optimizer, LoRA, batching, precision,
checkpoints) and the GRPO loop sizes the trainer reports. Does not own: addresses, ports and
bus settings (the server and shared config layers add those).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from hotloop.config import Section, from_mesh
from hotloop.hardware import Dtype
from hotloop.tenants import DEFAULT, TenantId


class LoraSettings(Section):
    """The LoRA adapter that is trained and published as a policy version."""

    r: int = Field(16, ge=1, le=256)
    """Adapter rank."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter input. Default 0: with dropout the trainer's logprobs are a noisy
    estimate of the policy the rollout sampled, so the importance ratio is not 1 even before the
    first update."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """Modules to adapt: "all-linear" (every linear layer but the output head) or names such as
    ["q_proj", "v_proj"]."""
    top_layers: int | None = Field(None, ge=1)
    """Adapt only the top N decoder layers (None: every layer). The layers below hold no
    trainable weight, so autograd records nothing there: a step runs them forward only and
    its backward stops at the lowest adapted layer; the adapter, its optimizer state, the
    push and the replicas' merge shrink in proportion. More than the model has is an error
    when the policy is built."""


class OptimizerSettings(Section):
    """AdamW over the LoRA parameters only."""

    lr: float = Field(1e-5, gt=0, le=1.0)
    """Learning rate (constant unless `decay_steps` is set)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay on the LoRA parameters."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this value before each step."""
    decay_steps: int | None = Field(None, gt=0)
    """Inverse-square-root decay: the adapter's learning rate in an update is
    lr / sqrt(1 + k / decay_steps), k the steps its optimizer state has taken so far (a lineage
    reset to the base or to a stored version has none and starts again at `lr`; a checkpoint
    keeps it). None: constant (the critic's `lr` is always constant).
    For updates of one or two ratings: Adam moves every parameter by about `lr` per update
    whatever the rating, so at a constant rate a lineage's noise adds up like a random walk
    and its share of a preference swings (the tenant demo's lineages by 0.4 between adjacent
    updates at 2e-3); a step falling as 1/sqrt(k) keeps the sum of steps growing (the signal)
    and the sum of their squares slowing (the noise). Half of `lr` after 3 x decay_steps.
    Measured there (decay_steps 50): lineages still swung, at half the rate, and each run
    missed one target, so the demo keeps a constant rate."""

    @model_validator(mode="after")
    def _betas_in_range(self) -> OptimizerSettings:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        return self


class LossSettings(Section):
    """The clipped policy-gradient objective shared by every algorithm (algorithms.py)."""

    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """PPO clip: the ratio is clipped below at 1 - clip_eps_low (matters for A < 0)."""
    clip_eps_high: float = Field(0.2, ge=0.0)
    """PPO clip: the ratio is clipped above at 1 + clip_eps_high (matters for A > 0); a larger
    value than clip_eps_low is DAPO's "clip-higher"."""
    ratio_cap: float | None = Field(None, gt=1.0)
    """Dual-clip / truncated importance sampling: for A < 0 an importance ratio above this cap
    stops growing the loss. None disables it. Must exceed 1 + clip_eps_high."""
    kl_beta: float = Field(0.0, ge=0.0)
    """Coefficient of the KL term to the reference (frozen base) model (`kl_estimator`); 0
    turns the KL term (and the need for reference logprobs) off."""
    kl_estimator: Literal["k3", "full"] = "k3"
    """How the KL term to the reference is computed at each completion token. "k3": Schulman's
    estimate from the sampled token's two logprobs (what a reference service returns). Its
    value estimates KL(policy || reference), but as a loss its gradient is, in expectation
    over the sampled tokens, that of the other direction, KL(reference || policy): it pulls up
    what the reference finds likely and the policy does not, and hardly resists the policy
    putting mass where the reference puts little (an end-of-answer token at every position, a
    style the base rarely writes) unless that very token is sampled. "full": the exact
    KL(policy || reference) over the whole vocabulary at every position, differentiated
    exactly: every token the policy made likelier than the base costs, sampled or not. Needs
    the reference's whole distributions, so the colocated reference on one rank (`[online]
    reference = "colocated"`); ~25 MB per 128 tokens of a 49k vocabulary held during a step."""
    aggregation: Literal["token", "sequence", "constant"] = "token"
    """How per-token losses become one number: "token" sums over all tokens of the batch and
    divides by their count (long completions weigh more); "sequence" averages each sequence,
    then averages sequences (GRPO paper); "constant" sums over all tokens and divides by the
    batch's sequences times `norm_tokens` (Dr. GRPO), so how far an update moves a
    sequence's own probability does not depend on its length. "token" and "sequence" divide
    a batch of one sequence by its own length: a short answer then moves its probability
    `norm_tokens / length` times as far as a long one with the same advantage, a pull toward
    short answers in updates of one or two feedback (the online trainer's)."""
    norm_tokens: int = Field(128, ge=1)
    """The "constant" aggregation's tokens per sequence: the generation budget (the
    requests' `max_tokens`), so a full-length sequence weighs as it does under "token"."""
    scale_advantages_by_std: bool = True
    """GRPO: divide group-centred rewards by the group's std. False is Dr.GRPO."""
    reinforce_baseline: float = 0.0
    """REINFORCE: advantage = reward - this constant (user feedback of +-1 is already
    centred)."""

    @model_validator(mode="after")
    def _cap_above_clip(self) -> LossSettings:
        if self.ratio_cap is not None and self.ratio_cap <= 1.0 + self.clip_eps_high:
            raise ValueError("ratio_cap must exceed 1 + clip_eps_high")
        return self


class CriticSettings(Section):
    """PPO's critic: a value head (a linear layer on the last hidden state) and which trunk
    it reads. docs/architecture.md ("PPO") has the measurement behind the default."""

    mode: Literal["shared", "lora"] = "shared"
    """`shared`: the value head reads the policy's own trunk and adapter, so one forward and
    one backward serve both losses (the value loss also trains the policy's LoRA, scaled by
    `vf_coef`). `lora`: the critic has its own LoRA adapter on the same frozen base (the base
    weights are still loaded once), decoupled from the policy at the cost of a second forward
    and backward per micro-batch."""
    vf_coef: float = Field(0.1, gt=0.0)
    """Weight of the value loss. In `shared` mode it trades the critic's fit against the
    policy's gradient on the same adapter; in `lora` mode it only scales the critic's step."""
    value_clip: float = Field(0.2, gt=0.0)
    """PPO's value clip: a new value moves at most this far from the rollout-time value per
    update before the clipped term takes over (in reward units)."""
    lr: float = Field(1e-4, gt=0, le=1.0)
    """Learning rate of the critic's own parameters (the value head, and in `lora` mode its
    adapter)."""
    r: int = Field(16, ge=1, le=256)
    """Rank of the critic's adapter (`lora` mode)."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator of the critic's adapter (`lora` mode)."""
    max_value_loss: float = Field(100.0, gt=0.0)
    """Divergence guard: a minibatch whose value loss is non-finite or above this (rewards of
    order 1 give losses well under 1) is skipped, policy and critic unchanged, and reported."""


class PpoSettings(Section):
    """PPO's advantage estimation, KL control and update schedule (`[trainer.ppo]`)."""

    gamma: float = Field(1.0, gt=0.0, le=1.0)
    """Discount per token. 1: a completion's reward counts fully at every token (episodes are
    at most max_new_tokens long)."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda: 1 is Monte-Carlo returns (no bias, high variance), 0 one-step TD (the
    critic's bias, low variance)."""
    epochs: int = Field(2, ge=1, le=16)
    """Passes over each rollout batch."""
    minibatches: int = Field(2, ge=1, le=256)
    """Optimizer steps per epoch: the batch is shuffled and split this many ways."""
    whiten_advantages: bool = True
    """Normalise advantages to zero mean and unit variance over the batch's tokens."""
    kl_coef: float = Field(0.05, ge=0.0)
    """Initial weight of the per-token KL penalty folded into the reward:
    r_t = -kl_coef * (logp_old - logp_ref), plus the score at the last token."""
    kl_target: float | None = Field(None, gt=0.0)
    """Adaptive KL (Ziegler et al. 2019): steer kl_coef so the measured per-token KL stays
    near this target. None keeps kl_coef fixed."""
    kl_horizon: int = Field(10_000, ge=1)
    """Adaptive KL: samples over which the coefficient may change by a factor of e at most."""


class TrainerConfig(Section):
    """The trainer core: LoRA policy, algorithm, batching, precision and checkpoints."""

    model: str = from_mesh("model.name", "smollm2-135m-instruct")
    """Base model: `[model] name`, the one the rollout serves (not set in `[trainer]`)."""
    algorithm: Literal["grpo", "reinforce", "ppo"] = "grpo"
    """Advantage estimator; all use the clipped objective. `ppo`: a critic (`[trainer.critic]`)
    and GAE over a KL-penalised reward (`[trainer.ppo]`); run it with `hotloop train ppo`."""
    critic: CriticSettings = Field(default_factory=CriticSettings)
    """PPO's critic (ignored by the other algorithms)."""
    ppo: PpoSettings = Field(default_factory=PpoSettings)
    """PPO's advantages, KL control and update schedule (ignored by the other algorithms)."""
    loss: LossSettings = Field(default_factory=LossSettings)
    """Policy objective settings."""
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings)
    """Optimizer settings."""
    lora: LoraSettings = Field(default_factory=LoraSettings)
    """Adapter settings."""
    micro_batch_tokens: int = Field(2048, ge=16)
    """Padded tokens (rows x longest prompt+completion) per forward/backward; gradients are
    accumulated across micro-batches, so this bounds memory without changing the update. With
    shared prompts: the prompts' tokens plus rows x longest completion."""
    share_prompts: bool = True
    """Run each distinct prompt of a batch once, its completions attending to its cached
    states (`hotloop.logprobs.plan_batches`): a group of G samples repeats its prompt G
    times. Exact, gradients included; off: every row runs its whole prompt."""
    logprob_chunk_tokens: int = Field(512, ge=1)
    """Completion positions per output-head chunk (each chunk holds a [chunk, vocab] fp32
    block)."""
    dtype: Dtype = from_mesh("model.dtype", "auto")
    """Compute dtype: `[model] dtype`, the one every copy of the base model uses (not set in
    `[trainer]`). `auto`: bf16 on CUDA and AMX CPUs, where it measured faster, else fp32
    (`hotloop.hardware.resolve_dtype`; on an AVX2-only CPU bf16 is 40x slower, on
    AVX512-BF16 without AMX 1.7x). bfloat16 stores the frozen base in bf16 and runs under
    CPU/CUDA autocast; the LoRA weights, optimizer state and log-softmax stay float32."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the policy (and PPO's critic and colocated reference) computes. `auto`: the first
    CUDA device when torch sees one, else the CPU; `dtype = "auto"` follows the device."""
    torch_threads: int | None = Field(None, ge=1)
    """torch intra-op threads (None: torch's default). vLLM on the same host competes for the
    same cores; set both deliberately."""
    cpus: str = ""
    """Cores the `hotloop train` process runs on, a Linux CPU list ("1", "2-7"); empty: all it
    may use. Pinned at start, before torch starts a thread (`hotloop.threads`). Beside a
    serving engine, give each its own cores (the engine's: `[rollout] cpu_omp_threads_bind`)
    and set `torch_threads` to match: on a core where vLLM's worker runs, another process was
    measured getting under 1% of it."""
    flush_denormal: bool = True
    """Flush float denormals to zero on the CPU (process-wide). Measured on the tiny model:
    fp32 steps took 2.8-3.3 s instead of 0.12 s until LoRA B grew out of the denormal range."""
    seed: int = 0
    """Seed for torch / python / numpy RNGs at start (a resume restores saved RNG states)."""
    data_parallel: int = Field(1, ge=1, le=64)
    """Ranks that share each train step (`learner/distributed.py`): the trainer process is rank
    0 and starts the others as child processes, each with its own copy of the base model;
    every rank trains a share of the batch and their gradients are summed, so the update is
    the one rank's. gloo on the CPU (set `torch_threads` to the cores / ranks), NCCL on CUDA
    with one GPU per rank (`cuda:<rank>`; more ranks than GPUs is refused at start).
    Checkpoints do not depend on it: a run resumes at another value."""
    data_parallel_timeout_s: float = Field(600.0, gt=0.0)
    """With `data_parallel` > 1: the longest any rank waits for the others inside a step (at
    a collective). A rank that died or hangs fails the step with an error after at most this
    long, instead of blocking the trainer. Must exceed the longest micro-batch."""
    log_entropy: bool = False
    """Report the mean policy entropy per step (costs an extra pass over the [chunk, vocab]
    block)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the rollouts. The trainer scores logits / temperature, so the
    rollout's old_logprobs must describe the same distribution: vLLM's default
    `logprobs_mode="raw_logprobs"` reports T=1 logprobs whatever the sampling temperature;
    `"processed_logprobs"` reports the tempered ones (and also applies top_p/top_k, which the
    trainer does not model: sample training rollouts with top_p=1, top_k off)."""
    checkpoint_dir: Path | None = None
    """Where checkpoints go (None: no checkpoints)."""
    checkpoint_interval: int = Field(50, ge=1)
    """Optimizer steps between checkpoints."""
    group_size: int = Field(8, ge=1)
    """GRPO: completions sampled per prompt (G)."""
    batch_prompts: int = Field(8, ge=1)
    """Prompts per training step (the batch is batch_prompts x group_size samples)."""
    max_new_tokens: int = Field(128, ge=1)
    """Completion length limit for rollouts."""
    num_steps: int = Field(100, ge=1)
    """Training steps for a batch run."""

    @model_validator(mode="after")
    def _cpu_list(self) -> TrainerConfig:
        if self.cpus:
            from hotloop.threads import parse_cpus

            parse_cpus(self.cpus)  # a typo fails at load, not after the model is loaded
        return self

    @model_validator(mode="after")
    def _full_kl_on_one_rank(self) -> TrainerConfig:
        if self.loss.kl_beta > 0 and self.loss.kl_estimator == "full" and self.data_parallel > 1:
            raise ValueError('loss.kl_estimator = "full" needs the reference\'s whole '
                             "distributions in the step, which the ranks do not share: use "
                             'data_parallel = 1 or kl_estimator = "k3"')
        return self

    @model_validator(mode="after")
    def _ppo_kl_in_reward(self) -> TrainerConfig:
        if self.algorithm == "ppo" and self.loss.kl_beta > 0:
            raise ValueError("PPO folds the KL penalty into the reward ([trainer.ppo] kl_coef, "
                             "kl_target): leave [trainer.loss] kl_beta at 0")
        return self


class OnlineConfig(Section):
    """The `[online]` section: the online loop that learns from user feedback (online.py).
    The optimizer, LoRA, dtype and kl_beta stay in `[trainer]`."""

    batch_size: int = Field(8, ge=1, le=1024)
    """Most feedback one update trains on (1: one update per feedback). An update takes the
    newest queued feedback first."""
    batch_window_s: float = Field(2.0, ge=0.0, le=3600.0)
    """How long an update waits for `batch_size` feedback after the oldest queued one arrived
    (0: it trains on whatever is queued when it starts)."""
    max_batch_tokens: int | None = Field(None, ge=1)
    """Most prompt + completion tokens one update trains on (None: only `batch_size` bounds
    it). An update takes feedback newest first until it holds this many tokens; the one that
    crosses the bound is still taken, so whether a feedback trains never depends on its own
    length. Bounds an update's time, and so the loop of what it trains, when arrivals exceed
    what the trainer computes."""
    max_wait_s: float = Field(30.0, gt=0.0)
    """Feedback that waited longer than this in the trainer's queue when an update starts is
    shed: acked unused and counted (reason "shed"). The newest is always taken, so the loop
    trains at its capacity however slow it is. Bounds the queue to what arrives in this long,
    and the trained feedback's wait with it."""
    max_staleness_versions: int = Field(8, ge=0)
    """Drop feedback on a completion served by a version more than this many versions behind
    the trainer's (its oldest token's version counts). prime-rl drops past 8, AReaL bounds
    staleness at 4-8: further back, the truncated ratio discards most of the signal anyway."""
    max_staleness_s: float = Field(3600.0, gt=0.0)
    """Drop feedback on a completion served longer ago than this (seconds)."""
    is_cap: float = Field(2.0, ge=1.0, le=10.0)
    """Truncation of the per-token importance weight pi/mu (pi: the trainer's policy, mu: the
    serving version's logprob). The anchors cap it between 1.02 (PipelineRL) and 5 (AReaL):
    lower is less variance and more bias toward the serving policy."""
    baseline_ema: float = Field(0.9, ge=0.0, lt=1.0)
    """Decay of the running reward baseline: b <- ema * b + (1 - ema) * mean(batch scores),
    updated after the batch's advantages are taken (a score never baselines itself)."""
    leave_one_out: bool = False
    """Baseline a batch of two or more feedback by its own other scores (RLOO: each score
    minus the mean of the rest, so the batch's advantages sum to zero); a batch of one by the
    running baseline. The running baseline lags, and while it sits above the scores every
    update pushes every answer down, which raises what the model rarely says, incoherent text
    included (measured with batches of 4-6). The more updates hold two or more
    feedback (`batch_size`, `batch_window_s`), the more it does."""
    negative_weight: float = Field(1.0, ge=0.0, le=1.0)
    """Multiply each negative advantage by this (1: REINFORCE as it is; 0: learn from the
    answers that beat the baseline only). An answer pushed down moves its probability onto
    everything else the model could say, the target among it only in proportion; where most
    ratings are below the baseline (a preference the base model rarely meets), updates of one
    answer are mostly such pushes (the tenant demo's `bullets`, three ratings in four at -1,
    wandered for 242 updates). AsymRE (Arnal et al. 2025)
    lowers the baseline for the same reason; this weights the negative side only. Below 1 the
    advantages of a leave-one-out batch no longer sum to 0."""
    serve_average: float = Field(0.0, ge=0.0, lt=1.0)
    """Publish a running average of the lineage's adapter instead of the adapter as trained:
    after each update s <- serve_average * s + (1 - serve_average) * theta (Polyak averaging,
    learner/averaging.py), and each version is s. 0: each version is the trained adapter.
    Updates of one or two rated answers move every parameter by about the learning rate, so
    adjacent versions can differ as much as distant ones (the tenant demo: a window of 30
    answers held 0.47 of its preference, the next version 0.04). At 0.8 a version moves a
    fifth of an update and follows the trained adapter ~4 updates behind. Users are served s,
    and the trainer learns from answers sampled from s (the truncated importance weight,
    `is_cap`, corrects for the difference). The average is checkpointed with the lineage; a
    reset starts it over at the base (or at the version it goes back to). The tenant demo
    serves 0.8: there a check holds one of the tens of versions a block of answers spans, and
    without the average adjacent versions differ by up to 0.4 in a preference's share
    (docs/results.md, "Many tenants (`make demo-tenants`)"); with the k3 estimate it slowed
    the fastest lineage instead."""
    kl_target: float | None = Field(None, gt=0.0)
    """Adaptive KL per lineage (Ziegler et al. 2019, as PPO's `kl_target`): raise the KL
    coefficient above `[trainer.loss] kl_beta` (> 0; never below it) while the per-token KL of
    the lineage's updates to the base model is above this target, and ease it back while
    below. None keeps kl_beta fixed. Why: a fixed 0.1 let lineages of the tenant demo drift to
    a per-token KL of 0.3-0.7 over ~90 updates, where their answers were incoherent (coherent
    ones reached their targets at 0.03-0.1). Why the floor: a lineage starts at the base model,
    where the KL stays near 0 for tens of updates, and a controller free to go lower had taken
    the coefficient to 0.013 by the time the KL rose past the target."""
    kl_horizon: int = Field(2, ge=1)
    """Adaptive KL: feedback over which the coefficient may change by a factor of e^0.2 at
    most (each update moves it by its error, clipped to +-20%, times feedback / horizon). A
    lineage learns from tens to hundreds of feedback, not PPO's thousands of samples, mostly
    one per update: at 10 it rose only to 0.1-0.3 while lineages drifted to a KL of 0.3-0.4;
    2 moves it by up to 10% per feedback."""
    reference: Literal["service", "colocated"] = "service"
    """Where the KL term's reference logprobs come from (with `[trainer.loss] kl_beta` > 0).
    `service`: the mesh's reference service, asked before the update waits for its turn.
    `colocated`: this process's own base model with the adapter disabled, in the update's
    turn (no reference process, no second copy of the base weights). On a few shared cores
    colocated is the faster: a reference process computes beside the engine and the trainer
    and slows both (measured in the tenant demo on 2 cores)."""
    tenant: TenantId = DEFAULT
    """The tenant whose lineage this loop trains (`[tenants.<name>]`; "": the default tenant).
    It reads only that tenant's feedback subject, and dead-letters (reason `other_tenant`) a
    feedback or traffic record that names another tenant. A named tenant's hold and reset
    through the admin API apply to it (the registry's, tenants/follow.py `FollowedLineage`):
    a reset publishes the base model as its next version and training goes on from there."""
    tenants: list[TenantId] = Field(default_factory=list)
    """The tenants this process trains, each in a lane of its own on one shared base model
    (services/trainer/tenants/lanes.py): its own adapter, optimizer state, baseline, versions,
    consumer (`<durable>-<tenant>`), checkpoints and store under `<run_id>/tenants/<tenant>/`
    (the default tenant "" keeps `<run_id>/` itself), time-shared by a fair rule on trained
    tokens. Empty (the default): the one lineage of `tenant`, exactly as before. When set,
    leave `tenant` at its default. Split the tenants between processes by config: a process
    that lists a tenant another live trainer learns is refused at start (`hotloop.leases`:
    two would share its durable consumer and publish competing versions)."""
    follow_registry: bool = False
    """Also train every tenant created through the admin API (the tenant registry,
    `hotloop.tenants.Registry`): a lane starts when a tenant is created, starts over from the
    base when it is reset, and stops when it is deleted (tenants/follow.py). Beside them it
    trains the lanes of `tenants`, or the default lineage's when `tenants` is empty. A reset of
    a config tenant resets its lane where this process trains it (as in every process with
    `tenants`, following or not, which applies the resets and holds of its lanes and starts
    or stops none). Several processes may follow
    the registry: each created tenant is learned by the first that claims its lineage
    (`hotloop.leases`), and the others leave it alone."""
    durable: str = Field("hotloop-online-trainer", min_length=1, pattern=r"^[A-Za-z0-9_-]+$")
    """Name of the durable JetStream consumer on FEEDBACK: its position survives restarts.
    A tenant's loop uses `<durable>-<tenant>` (`consumer_name`), so that each tenant's
    trainer keeps its own position."""
    ack_wait_s: float = Field(300.0, ge=1.0)
    """JetStream redelivers a fetched, un-acked feedback after this long. Feedback is acked
    only after its version is published and checkpointed, so keep this well above
    checkpoint_interval x the step time, or feedback in flight is delivered twice (the loop
    deduplicates it, but redelivery is wasted work)."""
    max_queue: int = Field(256, ge=1)
    """Fetched feedback waiting for a batch. When full the loop stops fetching (JetStream
    keeps the rest); the consumer's max_ack_pending is sized from this as well."""
    checkpoint_interval: int = Field(1, ge=1)
    """Updates between checkpoints. Acks wait for the checkpoint that covers them, so a
    larger interval means fewer checkpoint writes but more un-acked feedback in flight."""
    keep_checkpoints: int = Field(2, ge=1)
    """Older checkpoints are deleted (one is about 3x the adapter's size)."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many updates (0: run until stopped)."""
    out_dir: str = "runs"
    """Metrics, checkpoints and the version store go under `<out_dir>/<run_id>/`."""
    run_id: str = "online"
    """Reusing an id resumes from its last checkpoint and the consumer's position."""
    users_first: Literal["none", "nice", "pause"] = "none"
    """How the trainer yields the CPU to the users the engine serves meanwhile
    (services/trainer/pacing/usersfirst.py): `nice` runs its threads at the lowest OS priority;
    `pause` holds its forward and backward passes between layers while a user waits for a
    first token (at most `max_pause_s` per busy spell), as `[ppo] users_first` does."""
    max_pause_s: float = Field(2.0, gt=0.0, le=60.0)
    """`pause`: the longest one busy spell of users stops training, so training progresses."""

    @field_validator("tenants")
    @classmethod
    def _tenants(cls, names: list[TenantId]) -> list[TenantId]:
        if (twice := sorted({n for n in names if names.count(n) > 1})):
            raise ValueError(f"[online] tenants lists {', '.join(map(repr, twice))} more than once")
        return names

    @model_validator(mode="after")
    def _one_way_to_name_tenants(self) -> "OnlineConfig":
        if self.follow_registry and self.tenant:
            raise ValueError(f"[online] follow_registry trains a lane per tenant: leave tenant "
                             f"unset ({self.tenant!r}) and list config tenants in tenants")
        if self.tenants and self.tenant:
            raise ValueError(f"[online] tenants and tenant are both set ({self.tenants!r} and "
                             f"{self.tenant!r}): with tenants, list every tenant there and leave "
                             "tenant unset")
        return self

    def for_tenant(self, tenant: TenantId) -> "OnlineConfig":
        """This section as one lane of `tenants` runs it: its `tenant`, no `tenants`."""
        return self.model_copy(update={"tenant": tenant, "tenants": [], "follow_registry": False})

    @property
    def lane_tenants(self) -> list[str]:
        """The tenants whose lanes start with the process (the registry's come and go)."""
        return list(self.tenants) or [self.tenant]

    @property
    def lanes(self) -> bool:
        """Whether this job runs a lane per tenant (tenants/lanes.py)."""
        return bool(self.tenants) or self.follow_registry

    @property
    def consumer_name(self) -> str:
        """The durable consumer: `durable`, with the tenant's name for a named tenant."""
        return f"{self.durable}-{self.tenant}" if self.tenant else self.durable
