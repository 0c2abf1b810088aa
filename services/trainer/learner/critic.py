"""PPO's critic: a value head on a trunk the policy already holds.

Owns: the value head (one linear layer, float32, on the hidden state that predicts each
completion token, so V(s_t) is read at exactly the position whose output head gives
log pi(c_t | s_t)), the critic's optimizer, its value loss per micro-batch, inference of
rollout-time values, and its checkpoint (with a fingerprint that must match the policy).
`make_critic` is the one place that maps `[trainer.critic] mode` to code:
- `SharedCritic`: the head reads the policy's own trunk and adapter. The policy's forward
  already computed those hidden states, so the value loss costs one small matmul, and its
  gradient also trains the policy's LoRA (scaled by vf_coef).
- `LoraCritic`: the head reads the same frozen base through an adapter of its own ("critic"
  in the policy's PeftModel), so the base weights stay loaded once, and the critic's fit
  never pushes on the policy; it costs a second forward and backward per micro-batch.
docs/architecture.md ("PPO") records the measurement that chose the default.

Does not own: GAE or the loss math (algorithms.py), micro-batching and the update itself
(policy.py drives both optimizers in one `train_step`), or when to checkpoint (ppo.py).
Shapes: B sequences, Tc completion tokens, N real completion tokens, H hidden size.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from hotloop.logprobs import CompletionHidden, completion_hidden, plan_batches, prompt_states
from services.trainer.learner.algorithms import value_loss
from services.trainer.config import CriticSettings

if TYPE_CHECKING:
    from services.trainer.learner.batching import MicroBatch
    from services.trainer.learner.policy import LoraPolicy

CRITIC_ADAPTER = "critic"
POLICY_ADAPTER = "default"  # peft's name for the first adapter
_FINGERPRINT = "critic.json"
_WEIGHTS = "critic.pt"


class CriticMismatch(ValueError):
    """A critic checkpoint that does not fit this policy (another base, width or mode)."""


class Critic:
    """The value head and its optimizer. Subclasses choose the trunk; build with `make_critic`."""

    mode: str

    def __init__(self, policy: LoraPolicy, cfg: CriticSettings) -> None:
        self.policy, self.cfg = policy, cfg
        base_cfg = policy.model.get_base_model().config
        self.hidden_size = int(base_cfg.hidden_size)
        device = next(policy.model.parameters()).device
        # float32 whatever the trunk's dtype, like the adapter: values are regression targets of
        # order 1 and bf16 would round them to 1e-2. Zero init: V = 0 until it has learned.
        self.head = nn.Linear(self.hidden_size, 1).to(device=device, dtype=torch.float32)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def _build_optimizer(self) -> None:
        opt = self.policy.cfg.optimizer
        self.optimizer = torch.optim.AdamW(self.params, lr=self.cfg.lr, betas=opt.betas,
                                           weight_decay=opt.weight_decay)

    @property
    def params(self) -> list[Tensor]:
        """What the critic's optimizer steps (the shared trunk's adapter is the policy's)."""
        return list(self.head.parameters())

    @contextlib.contextmanager
    def trunk(self) -> Iterator[None]:
        """Make the critic's trunk the active one for the forwards inside (shared: no-op)."""
        yield

    def head_values(self, hidden: CompletionHidden) -> Tensor:
        """[N, H] gathered states -> V per completion token, [B, Tc] float32 (0 on padding)."""
        return hidden.scatter(self.head(hidden.hidden.float())[:, 0])

    def micro_loss(self, mb: MicroBatch, policy_hidden: CompletionHidden,
                   normalizer: float) -> tuple[Tensor, dict[str, float]]:
        """vf_coef x the clipped value loss of one micro-batch (its share of the batch's token
        mean), differentiable, and metrics (token sums over this micro-batch)."""
        if mb.returns is None or mb.old_values is None:
            raise ValueError("PPO samples carry returns and old_values")
        hidden = self._hidden(mb, policy_hidden)
        values = self.head_values(hidden)  # [B, Tc]
        mask = hidden.mask
        returns, old = mb.returns.to(values.device), mb.old_values.to(values.device)
        loss = value_loss(values, old, returns, mask, clip_eps=self.cfg.value_clip,
                          normalizer=normalizer)
        with torch.no_grad():
            clipped = ((values - old).abs() > self.cfg.value_clip) & mask
            metrics = {"value_loss": float(loss.detach()) * normalizer,  # token sum, un-normalised
                       "value_clip_frac": float(clipped.sum()),
                       "value_mean": float(torch.where(mask, values, 0.0).sum())}
        return self.cfg.vf_coef * loss, metrics

    def _hidden(self, mb: MicroBatch, policy_hidden: CompletionHidden) -> CompletionHidden:
        return policy_hidden

    def backward(self, mb: MicroBatch, policy_hidden: CompletionHidden, policy_loss: Tensor,
                 normalizer: float) -> tuple[float, dict[str, float]]:
        """Backward of one micro-batch's policy loss plus this critic's value loss; returns
        their sum (nothing is backpropagated when it is not finite) and the value metrics.
        Here (shared trunk) both losses read one graph, so one backward serves both."""
        vloss, metrics = self.micro_loss(mb, policy_hidden, normalizer)
        total = policy_loss + vloss
        value = float(total.detach())
        if math.isfinite(value):
            total.backward()
        return value, metrics

    @torch.inference_mode()
    def values(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """V at each completion token of each (prompt_ids, completion_ids), under the current
        critic: the rollout-time values GAE starts from."""
        model = self.policy.model
        model.eval()
        out: list[list[float]] = [[] for _ in pairs]
        cfg = self.policy.cfg
        plan = plan_batches(pairs, cfg.micro_batch_tokens, self.policy.pad_id, cfg.share_prompts)
        with self.trunk(), self.policy.autocast():
            prompts = None if plan.prompts is None else prompt_states(model, plan.prompts)
        for idx, batch in plan.batches:
            with self.trunk(), self.policy.autocast():
                hidden = completion_hidden(model, batch, prompts)
            v = self.head_values(hidden).cpu()
            for i, row, m in zip(idx, v, hidden.mask.cpu()):
                out[i] = row[m].tolist()
        return out

    # ------------------------------------------------------------------------- checkpoint

    def fingerprint(self) -> dict:
        """What a saved critic must share with this policy to be loaded into it."""
        lora = self.policy.cfg.lora
        return {"mode": self.mode, "hidden_size": self.hidden_size,
                "base_model": self.policy.base_model_name, "r": self.cfg.r, "alpha": self.cfg.alpha,
                "target_modules": lora.target_modules}

    def _adapter_state(self) -> dict[str, Tensor]:
        return {}

    def _load_adapter_state(self, state: dict[str, Tensor]) -> None:
        pass

    def save(self, directory: Path) -> None:
        """Write the critic into `directory` (part of a checkpoint being assembled)."""
        directory.mkdir(parents=True, exist_ok=True)
        torch.save({"head": self.head.state_dict(), "adapter": self._adapter_state(),
                    "optimizer": self.optimizer.state_dict()}, directory / _WEIGHTS)
        (directory / _FINGERPRINT).write_text(json.dumps(self.fingerprint(), indent=2))

    def load(self, directory: Path) -> None:
        """Restore from `save`'s directory; `CriticMismatch` (nothing loaded) when it was saved
        for another policy shape or critic mode."""
        fp_path = directory / _FINGERPRINT
        if not fp_path.exists():
            raise CriticMismatch(f"{directory} holds no critic ({_FINGERPRINT} missing): the "
                                 "checkpoint was written by another algorithm")
        saved, mine = json.loads(fp_path.read_text()), self.fingerprint()
        diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: saved {a!r}, configured {b!r}" for k, (a, b) in diff.items())
            raise CriticMismatch(f"the critic in {directory} does not match this policy ({what}); "
                                 "start a new run_id, or configure the critic as it was saved")
        state = torch.load(directory / _WEIGHTS, map_location="cpu", weights_only=True)
        self.head.load_state_dict(state["head"])
        self._load_adapter_state(state["adapter"])
        self.optimizer.load_state_dict(state["optimizer"])


class SharedCritic(Critic):
    """The head on the policy's own trunk and adapter (one forward serves both losses)."""

    mode = "shared"

    def __init__(self, policy: LoraPolicy, cfg: CriticSettings) -> None:
        super().__init__(policy, cfg)
        self._build_optimizer()


class LoraCritic(Critic):
    """The head on the frozen base through the critic's own adapter."""

    mode = "lora"

    def __init__(self, policy: LoraPolicy, cfg: CriticSettings) -> None:
        from peft import LoraConfig

        super().__init__(policy, cfg)
        model = policy.model
        model.add_adapter(CRITIC_ADAPTER, LoraConfig(
            r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=0.0,
            target_modules=policy.cfg.lora.target_modules, task_type="CAUSAL_LM"))
        self._adapter_params = [p for n, p in model.named_parameters()
                                if f".{CRITIC_ADAPTER}." in n]
        if not self._adapter_params:
            raise RuntimeError("peft added no parameters for the critic's adapter")
        self._activate(POLICY_ADAPTER)
        self._build_optimizer()

    @property
    def params(self) -> list[Tensor]:
        return [*self._adapter_params, *self.head.parameters()]

    def _activate(self, name: str) -> None:
        # peft's set_adapter also freezes every other adapter; both stay trainable here, so
        # that switching never changes which parameters a later backward may reach (each
        # graph reaches only the adapter that was active in its forward).
        self.policy.model.set_adapter(name)
        for p in [*self.policy.trainable_tensors(), *self._adapter_params]:
            p.requires_grad_(True)

    @contextlib.contextmanager
    def trunk(self) -> Iterator[None]:
        self._activate(CRITIC_ADAPTER)
        try:
            yield
        finally:
            self._activate(POLICY_ADAPTER)

    def _hidden(self, mb: MicroBatch, policy_hidden: CompletionHidden) -> CompletionHidden:
        with self.trunk(), self.policy.autocast():
            return completion_hidden(self.policy.model, mb.batch)

    def backward(self, mb: MicroBatch, policy_hidden: CompletionHidden, policy_loss: Tensor,
                 normalizer: float) -> tuple[float, dict[str, float]]:
        """The policy's backward first, then the critic's forward and backward on its own
        trunk: the two graphs never coexist, so the peak is one graph's, not two."""
        value = float(policy_loss.detach())
        if not math.isfinite(value):
            return value, {}
        policy_loss.backward()
        vloss, metrics = self.micro_loss(mb, policy_hidden, normalizer)
        v = float(vloss.detach())
        if math.isfinite(v):
            vloss.backward()
        return value + v, metrics

    def _adapter_state(self) -> dict[str, Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu() for k, v in
                get_peft_model_state_dict(self.policy.model, adapter_name=CRITIC_ADAPTER).items()}

    def _load_adapter_state(self, state: dict[str, Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.policy.model, state, adapter_name=CRITIC_ADAPTER)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise CriticMismatch(f"critic adapter weights do not fit: unexpected {unexpected[:3]}")


def make_critic(policy: LoraPolicy, cfg: CriticSettings) -> Critic:
    """The one place that maps `[trainer.critic] mode` to a critic."""
    match cfg.mode:
        case "shared":
            return SharedCritic(policy, cfg)
        case "lora":
            return LoraCritic(policy, cfg)
        case other:  # unreachable through a validated config
            raise ValueError(f"unknown critic mode {other!r}")
