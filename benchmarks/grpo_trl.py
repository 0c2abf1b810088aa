"""The peer of `hotloop bench grpo --peer trl`: TRL's GRPOTrainer for a few steps of the demo
configuration, in a process of its own (`python -m benchmarks.grpo_trl`).

Owns: the TRL side of the comparison, on equal terms with hotloop's demo step: the same model
directory, the same first training tasks as chat prompts, 8 prompts x 8 samples per optimizer
step (TRL's generation batch of 64: 16 per micro-batch x 4 accumulation steps), 128 new tokens
at temperature 1, LoRA r=16 / alpha 32 on all linear layers, lr 1e-4, beta 0.04 (TRL's
reference is the adapter-disabled base, as hotloop's reference service), fp32 on the CPU with
HF generate, and the same rewards (the reward service at `--reward`: sandboxed tests).
Its figure: samples/s from the median wall time of an optimizer step (steps after the first,
which carries TRL's warm-up), timed by a callback at each step's end.

Does not own: hotloop's own figures (grpo.py). TRL is an optional extra
(`pip install 'hotloop[peer]'`); without it this exits with code 3 and says how to install it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

INSTALL_HINT = ("TRL is not installed: `.venv/bin/pip install -e '.[peer]'` "
                "(or `.venv/bin/pip install trl==1.16.0`)")
MISSING_TRL = 3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grpo_trl")
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--stop", action="append", default=[],
                   help="a stop string, as hotloop's [grpo] stop (repeatable)")
    p.add_argument("--reward", required=True, help="the reward service's address")
    p.add_argument("--json", required=True, help="write the result here")
    args = p.parse_args(argv)
    try:
        import trl
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(f"{INSTALL_HINT} ({e})", file=sys.stderr, flush=True)
        return MISSING_TRL
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from hotloop.clients import Completion, RewardClient
    from hotloop.tasks import load_tasks

    from services.trainer.recipes.grpo import TaskStream, chat, score_item

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # the tasks hotloop's first steps train on (the same seed and order)
    tasks = TaskStream(load_tasks("builtin", "train"), 0).take(args.prompts * (args.steps + 1))
    data = Dataset.from_list([{"prompt": chat(t), "task_index": i} for i, t in enumerate(tasks)])
    loop = asyncio.new_event_loop()

    async def connect() -> RewardClient:  # a grpc.aio channel belongs to the loop it is made in
        return RewardClient(args.reward)

    client = loop.run_until_complete(connect())
    scored: list[float] = []

    def reward(prompts, completions, task_index, **_) -> list[float]:
        items = []
        for n, (c, i) in enumerate(zip(completions, task_index)):
            text = c[-1]["content"] if isinstance(c, list) else c
            items.append(score_item(tasks[i], Completion(0, 0, text, [], [], "", 0), n))
        out = [s.reward for s in loop.run_until_complete(client.score(items))]
        scored.extend(out)
        return out

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())
            print(f"[trl] step {len(ends)}/{args.steps}: "
                  f"{ends[-1] - (ends[-2] if len(ends) > 1 else t0):.1f} s", flush=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    if args.stop:
        # HF generate stops on strings only when handed the tokenizer, which TRL's generate
        # call does not pass; the peft wrapper TRL adds reaches this model's `generate`.
        model.generate = functools.partial(model.generate, tokenizer=tok)
    micro = max(1, args.prompts * args.group // 4)
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-peer-"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=args.prompts * args.group // micro,
        num_generations=args.group, max_completion_length=args.max_tokens, temperature=1.0,
        learning_rate=args.lr, beta=args.beta, max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, shuffle_dataset=False,
        generation_kwargs={"stop_strings": args.stop} if args.stop else None,
    )
    trainer = GRPOTrainer(
        model=model, processing_class=tok, reward_funcs=reward, args=cfg, train_dataset=data,
        peft_config=LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear",
                               task_type="CAUSAL_LM"),
        callbacks=[Clock()],
    )
    t0 = time.perf_counter()
    trainer.train()
    loop.run_until_complete(client.close())
    walls = [b - a for a, b in zip([t0, *ends[:-1]], ends)]
    steady = walls[1:] or walls
    samples = args.prompts * args.group
    result = {
        "name": f"trl {trl.__version__} GRPOTrainer",
        "samples_per_s": samples / statistics.median(steady) if steady else 0.0,
        "samples_per_s_method": "prompts x group / median wall s of the optimizer steps after the first",
        "step_seconds": walls,
        "samples_per_step": samples,
        "reward_mean": statistics.fmean(scored) if scored else None,
        "threads": torch.get_num_threads(),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
    }
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
