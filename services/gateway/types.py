"""Plain data of the gateway: what the edges hand to the core and what it hands back, and the
narrow interface to a rollout replica (which answers in `hotloop.completion.Completion`, the
rollout's one result type). No protos, no HTTP types."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from hotloop.completion import Completion
from hotloop.tenants import DEFAULT, TenantId


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass
class GenerateIn:
    """One user request: chat `messages`, or raw `prompts` (`/v1/completions`)."""

    messages: list[Message] | None = None
    prompts: list[str] | None = None
    model: str = ""  # "": the served model
    n: int = 1
    max_tokens: int = 0  # 0: the gateway's default
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False  # return each sampled token's logprob
    top_logprobs: int = 0  # and this many alternatives per position


@dataclass
class UpstreamRequest:
    """What one replica is asked: one Generate call in stream mode."""

    chats: list[list[Message]] | None
    texts: list[str] | None
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    top_logprobs: int
    request_id: str
    timeout_s: float
    tenant: TenantId = DEFAULT  # whose adapter lineage serves it


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]  # alternatives, most likely first (empty unless asked)


@dataclass
class Delta:
    """One step of one choice, as the edges render it."""

    choice: int
    text: str
    policy_version: int  # version of these tokens (the newest, if several)
    logprobs: list[TokenLogprob] | None = None  # None unless the request asked for logprobs
    finish_reason: str = ""  # set on the choice's last delta: "stop" | "length"
    num_tokens: int = 0


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class FeedbackIn:
    response_id: str
    score: float | None = None
    label: str = ""
    text: str = ""
    choice: int = 0


FeedbackOutcome = Literal["accepted", "duplicate", "unknown_response", "invalid"]


@dataclass
class FeedbackResult:
    """`accepted` is true for a new or a duplicate feedback; `outcome` says which, or why it
    was refused (the edges map it: HTTP 404 for `unknown_response`, 400 for `invalid`)."""

    accepted: bool
    outcome: FeedbackOutcome
    reason: str = ""


@dataclass(frozen=True)
class ReplicaStatus:
    """What a replica said at a poll."""

    running: int  # requests running on it now (all callers)
    version: int  # the version new requests run on
    known_latest: int = 0  # the newest version it knows the mesh announced (>= version)
    # per tenant: the version of its lineage the tenant's requests run on (absent: none),
    # and the newest one the replica knows the mesh announced (>= that)
    tenants: dict[str, int] = field(default_factory=dict)
    tenants_known: dict[str, int] = field(default_factory=dict)


class Replica(ABC):
    """A rollout replica as the gateway uses it. Errors are `hotloop.errors` types:
    `Unavailable` when the replica cannot serve (the router then skips it), `InvalidArgument`
    and the like when it refused the request."""

    address: str

    @abstractmethod
    def generate(self, req: UpstreamRequest) -> AsyncIterator[Completion]: ...

    @abstractmethod
    async def probe(self, timeout_s: float) -> ReplicaStatus | None:
        """Its load and versions when it is healthy; None when it says it is not serving;
        raises when it cannot be asked (the message becomes the reason)."""

    @abstractmethod
    async def close(self) -> None: ...


@dataclass
class ServedChoice:
    """One finished choice, as forked to TRAFFIC (and as read back for a feedback check)."""

    response_id: str
    choice: int
    user: str  # the key id
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    temperature: float = 1.0
    finish_reason: str = ""
    served_at: float = 0.0
    tenant: TenantId = DEFAULT  # the user's tenant
