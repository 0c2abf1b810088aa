"""RL algorithm units: advantages and the policy objective, as small pure tensor functions.

Owns: group-relative advantages (GRPO / Dr.GRPO), the REINFORCE advantage and its running
(EMA) baseline, the clipped importance-ratio objective with a k3 KL term and three aggregation
modes, the truncated-importance-sampling REINFORCE objective of the online loop, and PPO's
pieces (the KL-penalised per-token reward, GAE, whitening, the clipped value loss, explained
variance, the adaptive KL controller), and `make_algorithm` / `make_online_algorithm` /
`make_offpolicy_algorithm`, the only places that pick an objective.

Does not own: models, batching, optimizers (policy.py), or where rewards come from.
Shapes: B sequences, T completion tokens (right-padded, `mask` marks real tokens),
num_groups x G for GRPO groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from services.trainer.config import LossSettings, PpoSettings, TrainerConfig

# exp(ref - logp) in the k3 estimator overflows float32 past ~88; a log-ratio of 20 already
# means the policy is e^20 times likelier than the reference on that token.
_MAX_LOG_RATIO = 20.0


def group_advantages(rewards: Tensor, *, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group's std (+ eps).

    rewards: [num_groups, G] -> advantages [num_groups, G] (float32).
    `scale_by_std=False` is Dr.GRPO (the std division re-weights groups by how easy they are).
    A group whose rewards are all equal carries no signal and gets exactly zero advantage;
    the std is the unbiased one (torch default, as in TRL and torchtune).
    """
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # [num_groups, G]
    if scale_by_std:
        centred = centred / (rewards.std(dim=1, keepdim=True) + eps)
    constant = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)  # [num_groups, 1]
    # Exact zero: float rounding of mean() could otherwise leave +-1e-8 / eps-sized values.
    return torch.where(constant, torch.zeros_like(centred), centred)


def reinforce_advantages(rewards: Tensor, *, baseline: float = 0.0) -> Tensor:
    """REINFORCE with a constant baseline: rewards [N] -> advantages [N] (float32)."""
    return rewards.float() - baseline


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate, k3 = exp(d) - d - 1 with d = ref - logp. [B, T].

    Schulman's k3 is unbiased for KL(pi || pi_ref) under samples from pi, always >= 0, and 0
    exactly where the two logprobs agree.
    """
    d = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


def loss_normalizer(lengths: Sequence[int], aggregation: str, norm_tokens: int = 1) -> float:
    """The denominator of a whole batch: its token count ("token"), its non-empty sequences
    ("sequence"), or those sequences times `norm_tokens` ("constant"). Pass it to every
    micro-batch's `policy_loss` so that summing micro-batch losses gives the full-batch loss
    exactly (not a mean of micro-batch means)."""
    if aggregation == "token":
        return float(max(sum(lengths), 1))
    sequences = max(sum(1 for n in lengths if n > 0), 1)
    return float(sequences * (norm_tokens if aggregation == "constant" else 1))


def aggregate(
    per_token: Tensor, mask: Tensor, aggregation: str, normalizer: float | None = None,
    norm_tokens: int = 1,
) -> Tensor:
    """per_token, mask: [B, T] -> scalar.

    "token": sum over all real tokens / normalizer (default: their count).
    "sequence": sum over sequences of each sequence's token mean / normalizer (default: the
    number of non-empty sequences).
    "constant": sum over all real tokens / normalizer (default: the non-empty sequences times
    `norm_tokens`), so a sequence's weight does not depend on its own length or its batch's.
    """
    masked = torch.where(mask, per_token, torch.zeros_like(per_token))  # pads may hold nan
    lengths = mask.sum(dim=1)  # [B]
    if normalizer is None:
        normalizer = loss_normalizer(lengths.tolist(), aggregation, norm_tokens)
    if aggregation in ("token", "constant"):
        return masked.sum() / normalizer
    per_seq = masked.sum(dim=1) / lengths.clamp(min=1)  # [B]
    return per_seq.sum() / normalizer


def _with_kl(pg: Tensor, logprobs: Tensor, ref_logprobs: Tensor | None,
             cfg: LossSettings, kl: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The per-token loss [B, T]: `pg` plus kl_beta * the KL term, and that term [B, T] (None
    when kl_beta is 0). `kl`: the exact per-token KL the forward computed
    (`kl_estimator = "full"`); else k3 from `ref_logprobs`."""
    if cfg.kl_beta <= 0:
        return pg, None
    if cfg.kl_estimator == "full":
        if kl is None:
            raise ValueError('kl_estimator "full" needs the exact per-token KL (the colocated '
                             "reference's distributions)")
    elif ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs")
    else:
        kl = k3_kl(logprobs, ref_logprobs)
    return pg + cfg.kl_beta * kl, kl


def _token_mean(mask: Tensor) -> Callable[[Tensor], float]:
    """The mean of a [B, T] tensor over the real tokens of `mask` [B, T]."""
    n = mask.sum().clamp(min=1)

    def mean(x: Tensor) -> float:
        return float(torch.where(mask, x, torch.zeros_like(x)).sum() / n)

    return mean


def _watch(metrics: dict[str, float], mean: Callable[[Tensor], float], logprobs: Tensor,
           ref_logprobs: Tensor | None, kl: Tensor | None, entropy: Tensor | None) -> None:
    """Add to `metrics` the KL to the reference (still worth watching when kl_beta is 0, so
    computed here when the loss did not) and the entropy, when there is one. Call it under
    no_grad."""
    if kl is None and ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)
    if kl is not None:
        metrics["kl"] = mean(kl)
    if entropy is not None:
        metrics["entropy"] = mean(entropy)


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None, advantages: Tensor,
    mask: Tensor, cfg: LossSettings, *, normalizer: float | None = None,
    entropy: Tensor | None = None, kl: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped importance-ratio policy-gradient loss plus beta * KL. Returns (loss, metrics).

    logprobs:      [B, T] current policy, differentiable.
    old_logprobs:  [B, T] the rollout engine's logprobs of the sampled tokens (no recompute:
                   any sampler/trainer mismatch and staleness live in the ratio and are
                   bounded by the clip and `ratio_cap`).
    ref_logprobs:  [B, T] frozen reference, or None (required when cfg.kl_beta > 0).
    advantages:    [B] per sequence (broadcast over tokens) or [B, T] per token.
    mask:          [B, T] bool, real completion tokens.
    normalizer:    the whole batch's denominator (`loss_normalizer`) when this call sees one
                   micro-batch of it.

    Per token, with r = exp(logp - old):
        pg = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
        (A < 0 and ratio_cap: pg = min(pg, -ratio_cap * A), the dual clip)
        kl = exp(ref - logp) - (ref - logp) - 1      (k3, >= 0; or `kl`, the exact one)
        loss_t = pg + kl_beta * kl
    and `cfg.aggregation` turns loss_t into a scalar. Metrics are token means over this call.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # [B, 1] broadcasts over tokens
    advantages = advantages.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)  # [B, T]
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg = -torch.minimum(ratio * advantages, clipped * advantages)  # [B, T]
    if cfg.ratio_cap is not None:
        # Only A < 0 needs it: for A > 0 the min above already stops at 1 + eps_high.
        pg = torch.where(advantages < 0, torch.minimum(pg, -cfg.ratio_cap * advantages), pg)

    per_token, kl = _with_kl(pg, logprobs, ref_logprobs, cfg, kl)
    loss = aggregate(per_token, mask, cfg.aggregation, normalizer, cfg.norm_tokens)

    with torch.no_grad():
        mean = _token_mean(mask)
        # A token is clipped when the clip, not the ratio, sets its gradient (to zero).
        is_clipped = ((advantages > 0) & (ratio > 1.0 + cfg.clip_eps_high)) | (
            (advantages < 0) & (ratio < 1.0 - cfg.clip_eps_low)
        )
        metrics = {
            "pg_loss": mean(pg),
            "ratio_mean": mean(ratio),
            "clip_frac": mean(is_clipped.float()),
            "tokens": float(mask.sum()),
        }
        if cfg.ratio_cap is not None:
            metrics["capped_frac"] = mean(((advantages < 0) & (ratio > cfg.ratio_cap)).float())
        _watch(metrics, mean, logprobs, ref_logprobs, kl, entropy)
    return loss, metrics


def truncated_is_weights(logprobs: Tensor, behaviour_logprobs: Tensor, cap: float) -> Tensor:
    """Per-token importance weights min(pi / mu, cap), without gradient. [B, T] -> [B, T].

    logprobs:           [B, T] the policy being trained (pi).
    behaviour_logprobs: [B, T] the logprob each token was sampled with (mu), per token, so a
                        completion whose tokens came from several versions is weighted per
                        token.
    Truncation only from above (IMPALA's rho-bar, PipelineRL, AReaL): a token the current
    policy finds much likelier than the sampler did would otherwise dominate the batch.
    """
    log_ratio = (logprobs.detach() - behaviour_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio).clamp(max=cap)


def tis_reinforce_loss(
    logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None, advantages: Tensor,
    mask: Tensor, cfg: LossSettings, *, is_cap: float, normalizer: float | None = None,
    entropy: Tensor | None = None, kl: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE with truncated importance sampling plus beta * k3 KL. Returns (loss, metrics).

    logprobs:      [B, T] current policy, differentiable.
    old_logprobs:  [B, T] behaviour logprobs (what the serving version reported per token).
    ref_logprobs:  [B, T] frozen reference, or None (required when cfg.kl_beta > 0).
    advantages:    [B] per sequence or [B, T] per token.
    mask:          [B, T] bool, real completion tokens.

    Per token, with w = min(exp(logp - old), is_cap) held constant:
        loss_t = -w * A * logp + kl_beta * k3(logp, ref)
    so the gradient is -w * A * grad(logp): an off-policy estimate of the policy gradient,
    biased only where the cap bites. Unlike the PPO clip there is no trust region: with one
    update per batch (the online loop never re-uses a batch) the clip would never be active.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # [B, 1] broadcasts over tokens
    advantages = advantages.to(logprobs.dtype)
    w = truncated_is_weights(logprobs, old_logprobs, is_cap)  # [B, T]
    pg = -w * advantages * logprobs  # [B, T]
    per_token, kl = _with_kl(pg, logprobs, ref_logprobs, cfg, kl)
    loss = aggregate(per_token, mask, cfg.aggregation, normalizer, cfg.norm_tokens)

    with torch.no_grad():
        mean = _token_mean(mask)
        ratio = torch.exp((logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        metrics = {
            "pg_loss": mean(pg),
            "ratio_mean": mean(ratio),
            "is_weight_mean": mean(w),
            "capped_frac": mean((ratio > is_cap).float()),
            "tokens": float(mask.sum()),
        }
        _watch(metrics, mean, logprobs, ref_logprobs, kl, entropy)
    return loss, metrics


@dataclass
class EmaBaseline:
    """A running reward baseline for REINFORCE on a stream: advantage = score - value, then
    value <- decay * value + (1 - decay) * mean(scores). Starts at 0 (feedback in [-1, 1] is
    roughly centred already); its value belongs in the checkpoint.

    `leave_one_out`: a batch of two or more scores is baselined by its own other scores
    instead (RLOO: score_i - mean of the others), so its advantages sum to zero; a batch of
    one still by the running value. A running value lags the scores it follows, and while it
    sits above them every answer of every batch is pushed down: the sampled answers get
    less likely and the rest, the incoherent included, more (measured in the tenant demo:
    lineages wandered into incoherent text)."""

    decay: float
    value: float = 0.0
    leave_one_out: bool = False
    negative_weight: float = 1.0
    """Each negative advantage is multiplied by this (1: as taken): see `[online]
    negative_weight`."""

    def advantages(self, scores: Tensor) -> Tensor:
        """scores [N] -> advantages [N], against the baseline before this batch."""
        n = scores.numel()
        if self.leave_one_out and n >= 2:
            scores = scores.float()
            adv = scores - (scores.sum() - scores) / (n - 1)
        else:
            adv = reinforce_advantages(scores, baseline=self.value)
        if self.negative_weight != 1.0:
            adv = torch.where(adv < 0, adv * self.negative_weight, adv)
        return adv

    def update(self, scores: Tensor) -> None:
        self.value = self.decay * self.value + (1.0 - self.decay) * float(scores.float().mean())


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over right-padded token sequences.

    rewards, values, mask: [B, T]; values[t] = V(prefix before token t); the value after the
    last real token is 0 (the episode ends). Returns (advantages, returns), both [B, T], 0 on
    padding; returns = advantages + values are the value-function targets.
    """
    mask_f = mask.float()
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    running = torch.zeros(B, dtype=torch.float32, device=rewards.device)  # A_{t+1}
    for t in reversed(range(T)):
        alive_next = mask_f[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        next_value = values[:, t + 1] * alive_next if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * alive_next * running) * mask_f[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask_f


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip_eps: float = 0.2,
    normalizer: float | None = None,
) -> Tensor:
    """PPO's clipped value loss, token mean: 0.5 * max((v - R)^2, (clip(v, old +- eps) - R)^2).

    values (differentiable), old_values, returns, mask: [B, T]. `normalizer`: the whole
    batch's token count when this call sees one micro-batch of it (as for `policy_loss`).
    """
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return aggregate(per_token, mask, "token", normalizer)


def _identity(x: Tensor) -> Tensor:
    return x


def kl_penalised_rewards(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                         kl_coef: float) -> tuple[Tensor, Tensor]:
    """PPO-RLHF's per-token reward: -kl_coef * (logp - ref) at every token, plus the sequence's
    score at its last real token (Ziegler et al. 2019, InstructGPT).

    scores: [B]; logprobs (the sampler's), ref_logprobs, mask: [B, T].
    Returns (rewards [B, T], kl [B, T]) with kl = logp - ref (the k1 estimate, whose mean under
    the sampler is KL(pi || ref); per token it can be negative), both 0 on padding.
    """
    m = mask.float()
    kl = (logprobs - ref_logprobs) * m  # [B, T]
    rewards = -kl_coef * kl
    last = (mask.sum(dim=1) - 1).clamp(min=0)  # [B]
    has = mask.any(dim=1)
    rows = torch.arange(scores.shape[0], device=scores.device)
    rewards[rows[has], last[has]] += scores.float()[has]
    return rewards, kl


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Zero mean, unit variance over the real tokens of [B, T]; 0 on padding."""
    n = mask.sum().clamp(min=1)
    mean = torch.where(mask, x, torch.zeros_like(x)).sum() / n
    var = torch.where(mask, (x - mean) ** 2, torch.zeros_like(x)).sum() / n
    return torch.where(mask, (x - mean) / torch.sqrt(var + eps), torch.zeros_like(x))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over real tokens: 1 is a perfect critic, 0 one
    no better than a constant, negative one worse than a constant. NaN when the returns do not
    vary (nothing to explain)."""
    r, v = returns[mask].double(), values[mask].double()
    if r.numel() < 2 or float(r.var()) == 0.0:
        return math.nan
    return float(1.0 - (r - v).var() / r.var())


@dataclass
class AdaptiveKl:
    """Ziegler et al.'s proportional controller of the KL coefficient: after each batch,
    coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * samples / horizon, and never below
    `floor`. `target=None` keeps the coefficient fixed. Its `coef` belongs in the checkpoint."""

    coef: float
    target: float | None = None
    horizon: int = 10_000
    floor: float = 0.0

    def update(self, kl: float, samples: int) -> None:
        if self.target is None or not math.isfinite(kl):
            return
        error = max(-0.2, min(0.2, kl / self.target - 1.0))
        self.coef = max(self.floor, self.coef * (1.0 + error * samples / self.horizon))


def ppo_targets(samples_in: list[dict], kl_coef: float, cfg: PpoSettings) -> dict:
    """PPO's per-token targets for a step's samples: the KL-penalised reward, GAE, whitening.

    Each input dict: score (float), logprobs (the sampler's), ref, values (lists, one value per
    completion token). Returns per-sample "advantages" and "returns" (lists), the batch's mean
    per-token "kl" and the "explained_variance" of the values against the returns.
    """
    def pad(key: str) -> torch.Tensor:  # [B, T]
        width = max(1, max(len(s[key]) for s in samples_in))
        out = torch.zeros((len(samples_in), width), dtype=torch.float32)
        for i, s in enumerate(samples_in):
            out[i, : len(s[key])] = torch.tensor(s[key], dtype=torch.float32)
        return out

    lengths = torch.tensor([len(s["logprobs"]) for s in samples_in])
    mask = torch.arange(max(1, int(lengths.max())))[None, :] < lengths[:, None]  # [B, T]
    scores = torch.tensor([s["score"] for s in samples_in], dtype=torch.float32)  # [B]
    rewards, kl = kl_penalised_rewards(scores, pad("logprobs"), pad("ref"), mask, kl_coef)
    values = pad("values") * mask
    adv, returns = gae(rewards, values, mask, gamma=cfg.gamma, lam=cfg.lam)
    if cfg.whiten_advantages:
        adv = whiten(adv, mask)
    n = mask.sum().clamp(min=1)
    return {
        "advantages": [adv[i, : int(lengths[i])].tolist() for i in range(len(samples_in))],
        "returns": [returns[i, : int(lengths[i])].tolist() for i in range(len(samples_in))],
        "kl": float(kl.sum() / n),
        "explained_variance": explained_variance(values, returns, mask),
    }


@dataclass(frozen=True)
class Algorithm:
    """An advantage estimator paired with the policy objective. Build with `make_algorithm`."""

    name: str
    loss_cfg: LossSettings
    _advantages: Callable[[Tensor], Tensor]
    _loss: Callable[..., tuple[Tensor, dict[str, float]]] = policy_loss

    def advantages(self, rewards: Tensor) -> Tensor:
        """GRPO: rewards [num_groups, G] -> [num_groups, G]; REINFORCE: [N] -> [N]."""
        return self._advantages(rewards)

    def loss(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        ref_logprobs: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        *,
        normalizer: float | None = None,
        entropy: Tensor | None = None,
        kl: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """This algorithm's objective (`policy_loss` unless built otherwise); `kl`: the exact
        per-token KL to the reference (`kl_estimator = "full"`)."""
        return self._loss(
            logprobs,
            old_logprobs,
            ref_logprobs,
            advantages,
            mask,
            self.loss_cfg,
            normalizer=normalizer,
            entropy=entropy,
            kl=kl,
        )


def make_algorithm(cfg: TrainerConfig) -> Algorithm:
    """The one place that maps `cfg.algorithm` to code."""
    lc = cfg.loss
    adv: Callable[[Tensor], Tensor]
    match cfg.algorithm:
        case "grpo":
            adv = partial(group_advantages, scale_by_std=lc.scale_advantages_by_std)
        case "reinforce":
            adv = partial(reinforce_advantages, baseline=lc.reinforce_baseline)
        case "ppo":
            # Per-token GAE needs the critic's values, so the recipe (ppo.py) computes it with
            # `gae` and hands finished advantages to the loss; rewards pass through unchanged.
            adv = _identity
        case other:  # unreachable through a validated config
            raise ValueError(f"unknown algorithm {other!r}")
    return Algorithm(name=cfg.algorithm, loss_cfg=lc, _advantages=adv)


def make_online_algorithm(cfg: TrainerConfig, *, is_cap: float, kl_beta: float | None = None) -> Algorithm:
    """The online loop's objective: truncated-IS REINFORCE (`tis_reinforce_loss`). Its
    advantages come from a stateful `EmaBaseline` the loop keeps, so the advantage function
    here is the plain one (baseline 0). `kl_beta`: the KL coefficient in place of
    `[trainer.loss] kl_beta` (the loop's `AdaptiveKl`)."""
    return Algorithm(
        name="reinforce_tis",
        loss_cfg=cfg.loss if kl_beta is None else cfg.loss.model_copy(update={"kl_beta": kl_beta}),
        _advantages=reinforce_advantages,
        _loss=partial(tis_reinforce_loss, is_cap=is_cap),
    )


def make_offpolicy_algorithm(cfg: TrainerConfig, *, is_cap: float) -> Algorithm:
    """Asynchronous GRPO's objective (grpo_async.py): `make_algorithm`'s advantages (group
    advantages for `grpo`) with the truncated-IS objective of the online loop
    (`tis_reinforce_loss`) against the rollout's per-token logprobs.

    Its samples are up to `max_staleness` versions old, so the clipped objective would zero
    the gradient of every token whose ratio drifted past the clip, however informative;
    min(pi / mu, is_cap) * A * grad(log pi) keeps them, weighted. On-policy (ratio 1) the two
    give the same gradient, so the synchronous baseline and this one learn the same thing."""
    base = make_algorithm(cfg)
    return Algorithm(
        name=f"{base.name}_tis",
        loss_cfg=cfg.loss,
        _advantages=base._advantages,
        _loss=partial(tis_reinforce_loss, is_cap=is_cap),
    )
