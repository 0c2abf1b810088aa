"""The memory plan of a colocated PPO host: what each process holds on one CUDA GPU.

Owns: an upper-bound estimate, from a model's shape and the configuration, of the memory of
- the rollout (vLLM reserves `gpu_memory_utilization` of the device: its own copy of the base
  weights, the merged or LoRA-slot adapters, and the KV cache);
- the trainer: the base weights *once* (policy, colocated reference with the adapter
  disabled, and the critic all read the same tensors), the LoRA adapters in float32 with
  gradients and AdamW's two moments, the value head, the activations a backward keeps for one
  micro-batch, and the float32 logits block of one log-softmax chunk;
- an optional reward model (weights plus one batch's activations).
and `check`, which says whether they fit the device with headroom. A configuration test
checks the shipped CUDA config against it (tests/trainer/learner/test_memplan.py), and a GPU run
measured the trainer's real peak beside the estimate (docs/architecture.md).

Why two copies of the base remain: vLLM allocates its weights inside its own process and
offers no way to adopt tensors from another, so the trainer and the engine each hold one. What
colocation removes is the reference service's copy and a separate critic model's copy.

Does not own: the configuration (config.py, the rollout's config) or any allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
# AdamW over float32 LoRA weights: the weight, its gradient and two moments.
_ADAM_BYTES_PER_PARAM = 4 * 4


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the plan needs (a Llama-style decoder)."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    tied_embeddings: bool = True

    @classmethod
    def from_hf(cls, config) -> ModelShape:
        """From a transformers config object (LlamaConfig and lookalikes)."""
        return cls(hidden=config.hidden_size, layers=config.num_hidden_layers,
                   intermediate=config.intermediate_size, vocab=config.vocab_size,
                   heads=config.num_attention_heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                   tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        """Base parameters (norms ignored: they are < 0.1%)."""
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * self.hidden * 2 + self.hidden * kv * 2  # q, o; k, v
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (attn + mlp) + embed

    def lora_params(self, r: int) -> int:
        """LoRA on every linear layer of every block ("all-linear"): r x (in + out) each."""
        kv = self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        per_layer = r * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h))
        return self.layers * per_layer

    def activation_bytes_per_token(self, dtype_bytes: int) -> int:
        """What a backward keeps per token: per layer, the inputs of every linear layer and
        its LoRA branch, the attention and MLP intermediates, and RMSNorm's float32 copies.
        Calibrated on an H200 (bf16, SDPA, tests/trainer/learner/test_ppo_cuda.py): the measured peaks
        of the 135M and 1B shapes were 75-80% of this plan's trainer total."""
        per_layer = (12 * self.hidden + 8 * self.intermediate) * dtype_bytes
        return self.layers * per_layer + 4 * self.hidden * dtype_bytes


@dataclass(frozen=True)
class Plan:
    """Bytes per holder; `total` and `fits` against a device of `device_bytes`."""

    rollout: int
    trainer: dict[str, int]
    reward_model: int
    device_bytes: int
    headroom: float

    @property
    def trainer_total(self) -> int:
        return sum(self.trainer.values())

    @property
    def total(self) -> int:
        return self.rollout + self.trainer_total + self.reward_model

    @property
    def fits(self) -> bool:
        return self.total <= (1.0 - self.headroom) * self.device_bytes

    def table(self) -> str:
        """Markdown: holder, GiB, share of the device."""
        rows = [("rollout (vLLM: base copy, adapters, KV cache)", self.rollout)]
        rows += [(f"trainer: {k}", v) for k, v in self.trainer.items()]
        if self.reward_model:
            rows.append(("reward model", self.reward_model))
        rows.append(("total", self.total))
        out = ["| holder | GiB | share |", "|---|---|---|"]
        out += [f"| {k} | {v / GIB:.2f} | {v / self.device_bytes:.1%} |" for k, v in rows]
        return "\n".join(out)


def plan(shape: ModelShape, *, device_gib: float, gpu_memory_utilization: float,
         dtype_bytes: int, lora_r: int, critic_mode: str, critic_r: int,
         micro_batch_tokens: int, logprob_chunk_tokens: int,
         reward_model: ModelShape | None = None, reward_batch_tokens: int = 0,
         headroom: float = 0.05) -> Plan:
    """The memory plan of one colocated PPO host (see the module docstring)."""
    device = int(device_gib * GIB)
    adapters = shape.lora_params(lora_r) * _ADAM_BYTES_PER_PARAM
    trainer = {
        "base weights (once: policy, reference, critic)": shape.params * dtype_bytes,
        "policy LoRA + grads + AdamW": adapters,
        "critic (value head; its own LoRA in `lora` mode)": (
            shape.hidden * _ADAM_BYTES_PER_PARAM
            + (shape.lora_params(critic_r) * _ADAM_BYTES_PER_PARAM if critic_mode == "lora" else 0)),
        # One graph at a time: a `lora` critic runs its forward and backward after the
        # policy's backward (critic.py).
        "activations of one micro-batch": micro_batch_tokens
        * shape.activation_bytes_per_token(dtype_bytes),
        # fp32 logits, their log-softmax and its gradient for one chunk of completion tokens.
        "logits of one log-softmax chunk": logprob_chunk_tokens * shape.vocab * 4 * 3,
    }
    rm = 0
    if reward_model is not None:
        rm = reward_model.params * dtype_bytes + reward_batch_tokens * reward_model.hidden * dtype_bytes * 4
    return Plan(rollout=int(gpu_memory_utilization * device), trainer=trainer, reward_model=rm,
                device_bytes=device, headroom=headroom)


def plan_for(trainer_cfg, shape: ModelShape, device_gib: float, rollout_cfg,
             dtype_bytes: int = 2) -> Plan:
    """The plan of a loaded configuration (bf16 on CUDA: `auto` resolves to it there)."""
    return plan(shape, device_gib=device_gib,
                gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
                dtype_bytes=dtype_bytes, lora_r=trainer_cfg.lora.r,
                critic_mode=trainer_cfg.critic.mode, critic_r=trainer_cfg.critic.r,
                micro_batch_tokens=trainer_cfg.micro_batch_tokens,
                logprob_chunk_tokens=trainer_cfg.logprob_chunk_tokens)
