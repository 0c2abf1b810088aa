"""Typed configuration of the reference service core (pydantic; no torch import here).

Owns: the model, backend choice, precision and batching of reference logprobs. Does not own:
the listen address or telemetry (the server and shared config layers).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hotloop.config import Section, from_mesh
from hotloop.hardware import Dtype


class ReferenceConfig(Section):
    """Frozen base-model logprobs for the KL term."""

    model: str = from_mesh("model.name", "smollm2-135m-instruct")
    """Base model: `[model] name`, the trainer's base model, or the KL anchors to the wrong
    distribution (not set in `[reference]`)."""
    backend: Literal["torch"] = "torch"
    """Scoring engine. "torch": HF model, completion-only chunked logprobs (the trainer's own
    code, so both agree by construction). A "vllm" backend (prompt_logprobs, engine built
    without LoRA) plugs in at `core.make_backend`."""
    dtype: Dtype = from_mesh("model.dtype", "auto")
    """Compute dtype: `[model] dtype`, the trainer's too, or the KL picks up the bf16/fp32 gap
    (~1e-2 per token on logprobs) as if it were policy drift (not set in `[reference]`)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model computes: `auto` is the first CUDA device when torch sees one, else the
    CPU (`dtype = "auto"` follows it, as in the trainer)."""
    token_budget: int = Field(4096, ge=16)
    """Padded tokens (rows x longest prompt+completion) per forward pass, or with shared prompts
    the prompts' tokens plus rows x longest completion; also the most tokens (prompt +
    completion, counted per request) the streaming path groups into one batch."""
    share_prompts: bool = True
    """Run each distinct prompt of a batch once (a GRPO group repeats its prompt G times);
    the completions attend to its cached states. Exact; the trainer's `share_prompts` too."""
    chunk_tokens: int = Field(512, ge=1)
    """Completion positions per output-head chunk (a [chunk, vocab] fp32 block each)."""
    temperature: float = Field(1.0, gt=0)
    """Logits are divided by this before the log-softmax; match the trainer's temperature so
    the KL compares like with like."""
    torch_threads: int | None = Field(None, ge=1)
    """torch intra-op threads (None: torch's default)."""
    flush_denormal: bool = True
    """Flush float denormals to zero on the CPU (process-wide); denormal arithmetic is
    10-100x slower there and changes nothing a logprob can resolve."""
