"""`hotloop bench threads`: A/B of the OpenMP and thread settings the mesh sets for speed.

Owns the measurement behind the defaults in `services/rollout/config.py` (`omp_wait_policy`,
`cpu_omp_threads_bind`) and the trainer's `torch_threads`: on a 2-core host the vLLM engine
and the trainer share the cores, so a setting that speeds one up can slow the other.

For each engine setting it runs, as real processes:
  1. an engine process (vLLM, the real small model): generation tokens/s, then it stays up
     idle, as the rollout does between GRPO generations;
  2. a trainer process beside it: seconds per LoRA step (fwd+bwd+AdamW) while the engine idles.
plus, once, the trainer alone (no engine) as the baseline the ratios are taken against.
Every engine is torn down before the next starts; a killed benchmark takes its engine with it
(PR_SET_PDEATHSIG through hotloop.enginewatch and the process group).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

# (OMP_WAIT_POLICY, VLLM_CPU_OMP_THREADS_BIND) pairs; None leaves the variable unset.
ENGINE_SETTINGS = [("PASSIVE", "auto"), (None, "auto"), ("PASSIVE", "nobind"), (None, "nobind")]
PROMPT = "Write a Python function `add(a, b)` that returns the sum of a and b."


def _engine_main(model_dir: str, dtype: str, prompts: int, n: int, max_tokens: int) -> None:
    """Child: build the engine, measure generation, print one JSON line, idle until killed."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=512,
              disable_log_stats=True)
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    chats = [[{"role": "user", "content": PROMPT}]] * prompts
    llm.chat(chats, params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(2):
        t0 = time.perf_counter()
        outs = llm.chat(chats, params, use_tqdm=False)
        rates.append(sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t0))
    print(json.dumps({"tokens_per_s": statistics.median(rates)}), flush=True)
    signal.pause()  # idle like a rollout between generations, until the parent kills us


def _trainer_main(model_dir: str, dtype: str, threads: int, steps: int) -> None:
    """Child: seconds per LoRA step on a GRPO-sized batch, median of `steps`."""
    import torch

    from services.trainer.learner.batching import Sample
    from services.trainer.config import TrainerConfig
    from services.trainer.learner.policy import LoraPolicy

    cfg = TrainerConfig(model=model_dir, dtype=dtype, torch_threads=threads, micro_batch_tokens=4096)
    policy = LoraPolicy(cfg)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=torch.randint(10, 4000, (40,), generator=g).tolist(),
                      completion_ids=torch.randint(10, 4000, (96,), generator=g).tolist(),
                      old_logprobs=[-1.0] * 96, advantage=1.0 if i % 2 else -1.0)
               for i in range(8)]
    policy.train_step(samples)  # warm-up
    secs = []
    for _ in range(steps):
        t0 = time.perf_counter()
        policy.train_step(samples)
        secs.append(time.perf_counter() - t0)
    print(json.dumps({"step_s": statistics.median(secs)}), flush=True)


def _child_env(wait: str | None, bind: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if wait is not None:
        env["OMP_WAIT_POLICY"] = wait
    env.update(VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE="1", HOTLOOP_ENGINE_PDEATHSIG="1")
    return env


def _json_line(proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited ({proc.poll()}) before reporting")
        if line.startswith("{"):
            return json.loads(line)
    raise TimeoutError("child did not report in time")


def _trainer(model_dir: str, dtype: str, threads: int, steps: int, env: dict) -> float:
    out = subprocess.run([sys.executable, "-m", __name__, "trainer", model_dir, dtype, str(threads), str(steps)],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"trainer child failed: {out.stderr[-2000:]}")
    return json.loads(lines[-1])["step_s"]


def run(model_dir: str, dtype: str, threads: int = 2, steps: int = 3, prompts: int = 8, n: int = 4,
        max_tokens: int = 64, settings=ENGINE_SETTINGS, say=print) -> dict:
    # The trainer's own environment is the same in every run: only the engine's settings vary.
    trainer_env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    say(f"[threads] trainer alone ({dtype}, {threads} threads)...")
    alone = _trainer(model_dir, dtype, threads, steps, trainer_env)
    say(f"[threads]   {alone:.2f} s/step")
    rows = []
    for wait, bind in settings:
        label = f"OMP_WAIT_POLICY={wait or 'unset'} bind={bind}"
        say(f"[threads] engine with {label}: starting...")
        env = _child_env(wait, bind)
        eng = subprocess.Popen([sys.executable, "-m", __name__, "engine", model_dir, dtype, str(prompts),
                                str(n), str(max_tokens)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, env=env, start_new_session=True)
        try:
            gen = _json_line(eng, 600)["tokens_per_s"]
            say(f"[threads]   generation {gen:.0f} tok/s; trainer beside the idle engine...")
            beside = _trainer(model_dir, dtype, threads, steps, trainer_env)
        finally:
            os.killpg(eng.pid, signal.SIGKILL)  # the engine and its worker: one process group
            eng.wait()
        say(f"[threads]   {beside:.2f} s/step ({beside / alone:.2f}x of trainer alone)")
        rows.append({"omp_wait_policy": wait or "unset", "bind": bind, "gen_tokens_per_s": gen,
                     "train_step_s_beside_idle_engine": beside, "train_slowdown": beside / alone})
    return {"dtype": dtype, "torch_threads": threads, "train_step_s_alone": alone, "settings": rows}


def main(args) -> int:
    from hotloop import models
    from hotloop.hardware import cpu_capability, resolve_dtype

    model_dir = str(models.resolve(args.model))
    dtype = resolve_dtype(args.dtype)
    from benchmarks.common import report

    report({"cpu": str(cpu_capability()), **run(model_dir, dtype, threads=args.threads, steps=args.steps)},
           args.json)
    return 0


if __name__ == "__main__":
    role, rest = sys.argv[1], sys.argv[2:]
    if role == "engine":
        _engine_main(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]))
    elif role == "trainer":
        _trainer_main(rest[0], rest[1], int(rest[2]), int(rest[3]))
