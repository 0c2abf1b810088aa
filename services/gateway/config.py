"""Configuration of the gateway (section `[gateway]`).

Owns the typed knobs of the user-facing edge: where it listens (gRPC and HTTP), request limits,
the deadline, routing, the traffic fork's queue and the memory of served responses.
Does not own: the API keys (`[security] user_tokens` / `user_tokens_file`, shared with
`hotloop up`) or the replica list (`[endpoints] rollout`; discovery.py resolves its names).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hotloop.bus import TRAFFIC_MAX_AGE_S
from hotloop.config import ServiceSection


class GatewayConfig(ServiceSection):
    """The `[gateway]` section: the user-facing edge (gRPC and OpenAI-style HTTP), its request
    limits, routing among rollout replicas, and the traffic and feedback it records."""

    host: str = "127.0.0.1"
    """Interface both servers listen on."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 picks a free one (written to the port file)."""
    http_port: int = Field(0, ge=0, le=65535)
    """OpenAI-compatible HTTP port; 0 picks a free one (written to `http_port_file`)."""
    http_port_file: str = ""
    """Write `{"port": N}` here once the HTTP server listens (`hotloop up` reads it)."""
    served_model: str = ""
    """The model name clients send and `/v1/models` lists; empty: `[model] name`."""
    request_timeout_s: float = Field(120.0, gt=0, le=3600)
    """Deadline of one generation request, from arrival to its last token (HTTP 504 /
    DEADLINE_EXCEEDED past it; the rollout request is cancelled too)."""
    default_max_tokens: int = Field(128, ge=1)
    """New tokens per choice when a request does not say."""
    max_tokens: int = Field(1024, ge=1)
    """Most new tokens a request may ask for (the rollout has its own, possibly lower, limit)."""
    max_n: int = Field(8, ge=1, le=128)
    """Most choices per request."""
    max_prompts: int = Field(16, ge=1, le=1024)
    """Most prompts in one `/v1/completions` request (chat has one)."""
    max_messages: int = Field(256, ge=1)
    """Most chat messages in one request."""
    max_prompt_chars: int = Field(32768, ge=1)
    """Longest prompt in characters (all messages together); the rollout also bounds tokens."""
    max_request_bytes: int = Field(1 << 20, ge=1024)
    """Largest HTTP request body (HTTP 413 beyond it): a declared Content-Length over it is
    refused before reading, and the bytes actually received are counted, chunked or not."""
    request_body_timeout_s: float = Field(30.0, gt=0, le=600)
    """Longest time a request body may take to arrive (HTTP 408 beyond it), so a client
    trickling bytes cannot hold a connection and its buffer indefinitely."""
    max_stop: int = Field(4, ge=0, le=64)
    """Most stop strings (OpenAI allows 4)."""
    max_feedback_text_chars: int = Field(4096, ge=0)
    """Longest feedback comment."""
    feedback_wait_s: float = Field(5.0, gt=0, le=300)
    """Longest wait, on feedback, for the response's traffic record to be stored first (the
    trainer joins feedback to it); past it the feedback is refused as retryable (503)."""
    routing: Literal["least_loaded", "round_robin"] = "least_loaded"
    """How a healthy replica is chosen. `least_loaded`: fewest requests in flight (this
    gateway's own, plus the others' the replica reported at its last poll), ties in turn.
    `round_robin`: in turn."""
    health_interval_s: float = Field(2.0, gt=0, le=300)
    """How often each replica's health and status are polled."""
    health_timeout_s: float = Field(1.0, gt=0, le=60)
    """A poll slower than this counts as missed."""
    max_version_lag: int = Field(0, ge=0)
    """Most versions a replica may be behind the newest version seen (the highest any replica
    serves or knows announced) and still get users. 0: users are answered only by the newest
    policy while any replica serves it; a replica that missed an update or restarted on an
    older one gets no user until it has caught up, and with none current users get 503 /
    UNAVAILABLE saying why. A replica whose push is still landing is skipped until the next
    poll (`health_interval_s`) sees it done."""
    discovery_interval_s: float = Field(10.0, gt=0, le=3600)
    """How often the `dns:///host:port` entries of `[endpoints] rollout` are resolved again
    (a compose service scaled with `--scale`, a Kubernetes headless Service): a replica that
    appears gets users within this plus one health poll. Plain addresses are never resolved
    again."""
    health_failures: int = Field(3, ge=1, le=100)
    """Missed polls in a row before a replica is skipped. A replica that says it is not
    serving, or fails a request, is skipped at once."""
    traffic_queue: int = Field(1024, ge=1, le=1 << 20)
    """Served choices waiting to be published to TRAFFIC; beyond it they are dropped and
    counted (`traffic_dropped`), so a slow bus never slows users."""
    response_ttl_s: float = Field(TRAFFIC_MAX_AGE_S, gt=0)
    """How long feedback on a served response is accepted from memory; older ones are
    looked up on the bus (TRAFFIC keeps them as long as its max age)."""
    max_remembered_responses: int = Field(100_000, ge=1)
    """Bound on the served-response memory (oldest forgotten first; the bus still has them)."""

    @model_validator(mode="after")
    def _limits(self) -> "GatewayConfig":
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens ({self.max_tokens})"
            )
        return self
