"""The rollout's result as every caller sees it: `Completion`, a whole completion or one streamed
delta of a sample.

One type for the trainer's recipes, the gateway and the benchmarks; `hotloop.clients` fills it
from the wire. Plain data with no grpc import, so a service core can hold it without a
transport (the gateway's core streams these to its edges).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Completion:
    """A whole completion, or (`RolloutClient.stream`) one delta of a sample: then `text`,
    `token_ids`, `logprobs`, `top_logprobs` and `token_texts` are what is new, `final` marks
    the last delta and `version_spans` is the full list so far. `num_prompt_tokens` is set on
    every message; `prompt_token_ids` (when asked for) on a sample's first."""

    prompt_index: int
    sample_index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    prompt_token_ids: list[int] = field(default_factory=list)
    # (version, first token index), ascending: more than one only when an in-flight weight
    # update landed mid-completion; tokens from first_token on came from that version.
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    final: bool = True
    num_prompt_tokens: int = 0
    # When top_logprobs > 0: per token, [(token id, logprob, text)] most likely first.
    top_logprobs: list[list[tuple[int, float, str]]] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    tenant: str = ""  # the lineage whose version served it ("": the default one)
