"""PPO's update on a CUDA GPU: device and dtype resolve to cuda/bf16, the colocated reference
agrees with the reference service's backend, a minibatch update with each critic runs, and the
trainer's measured peak memory stays within the memory plan's estimate (memplan.py).

Skipped without CUDA (CI has none); run on a GPU host with `pytest -m gpu -s`. Random weights
in real model shapes, so no download is needed."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model(tmp_path, name):
    from transformers import AutoConfig

    from hotloop.models import build_shaped_model

    path = build_shaped_model(tmp_path, name, device="cuda", dtype="bfloat16")
    return path, AutoConfig.from_pretrained(path)


@pytest.mark.parametrize("name, mode, micro_batch_tokens", [
    ("smollm2-135m", "shared", 8192), ("smollm2-135m", "lora", 8192),
    ("llama-3.2-1b", "shared", 4096)])
def test_ppo_update_on_cuda_within_the_memory_plan(tmp_path, name, mode, micro_batch_tokens):
    from services.reference.config import ReferenceConfig
    from services.reference.core import TorchBackend
    from services.rollout.config import RolloutConfig
    from services.trainer.learner.batching import Sample
    from services.trainer.config import TrainerConfig
    from services.trainer.learner.critic import make_critic
    from services.trainer.learner.memplan import GIB, ModelShape, plan_for
    from services.trainer.learner.policy import LoraPolicy
    from services.trainer.learner.algorithms import ppo_targets

    path, hf_cfg = _model(tmp_path, name)
    tc = TrainerConfig(model=str(path), algorithm="ppo", micro_batch_tokens=micro_batch_tokens,
                       critic={"mode": mode}, lora={"r": 16, "alpha": 32})
    torch.cuda.reset_peak_memory_stats()
    policy = LoraPolicy(tc, path)
    assert policy.cfg.device == "cuda" and policy.cfg.dtype == "bfloat16"
    critic = make_critic(policy, tc.critic)

    g = torch.Generator().manual_seed(1)
    vocab = hf_cfg.vocab_size
    pairs = [(torch.randint(3, vocab, (64,), generator=g).tolist(),
              torch.randint(3, vocab, (256,), generator=g).tolist()) for _ in range(64)]
    old = policy.logprobs(pairs)
    ref = policy.base_logprobs(pairs)
    values = critic.values(pairs)
    # The colocated reference is the reference service's computation (same code, same dtype).
    service = TorchBackend(ReferenceConfig(model=str(path), dtype="bfloat16", device="cuda"), path)
    diff = max(abs(a - b) for r1, r2 in zip(ref, service.score(pairs[:8])) for a, b in zip(r1, r2))
    del service
    torch.cuda.empty_cache()
    assert diff < 1e-3

    est = ppo_targets(
        [{"score": float(i % 2), "logprobs": o, "ref": r, "values": v}
         for i, (o, r, v) in enumerate(zip(old, ref, values))], 0.05, tc.ppo)
    samples = [Sample(prompt_ids=p, completion_ids=c, old_logprobs=o, advantage=a, returns=rt,
                      old_values=v)
               for (p, c), o, a, rt, v in zip(pairs, old, est["advantages"], est["returns"], values)]
    torch.cuda.reset_peak_memory_stats()
    for part in (samples[:32], samples[32:]):
        m = policy.train_step(part, critic=critic)
        assert not m.skipped and math.isfinite(m.loss) and math.isfinite(m.extra["value_loss"])
    peak = torch.cuda.max_memory_allocated()

    plan = plan_for(tc, ModelShape.from_hf(hf_cfg), 141.0, RolloutConfig(gpu_memory_utilization=0.1))
    print(f"\n[cuda {name} {mode} mb={micro_batch_tokens}] trainer peak {peak / GIB:.2f} GiB, plan "
          f"{plan.trainer_total / GIB:.2f} GiB ({peak / plan.trainer_total:.0%} of the plan); "
          f"reference agreement {diff:.2e}; step {m.seconds:.2f} s\n{plan.table()}")
    assert peak <= plan.trainer_total
