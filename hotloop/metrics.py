"""Prometheus metrics: the process's registry, its HTTP endpoint, and metrics read from state.

Owns: `registry()`, the one `CollectorRegistry` of a service process (with prometheus_client's
process and platform collectors: CPU seconds, resident memory, open files, the Python
version); `serve`, the `GET /metrics` endpoint that the service runner (`hotloop.service`)
starts on a service's `metrics_port`; and `StateCollector` with the family builders
(`counter`, `gauge`, `info`) for metrics read from a service's own state when scraped.
Does not own: what a service measures. Each core defines its metrics on the registry it is
given (a private one when it is given none, as in tests, so two cores in one process neither
share nor collide), and each service's `__main__` gives it `registry()`.

A service feeds its registry in one of two ways:
- events that nothing else records (a push and how long it took, a sample scored) are
  prometheus_client `Counter`s and `Histogram`s, updated where they happen: O(1), thread-safe,
  never inside loss math;
- what the service already keeps as plain state (the gateway's request counters and replica
  table, the online loop's feedback counters, the rollout's held versions) is read when
  scraped, by a `StateCollector` the core registers. Its hot path stays a plain `+= 1`, and
  Status, metrics.jsonl and `/metrics` cannot disagree.

Scrapes run in the endpoint's thread, beside the service's event loop. A state reader must
therefore read ints and take copies (`len`, `list(...)`: atomic under the GIL) and never
iterate a live dict or set that the loop may resize meanwhile.

Why not prometheus_client's global `REGISTRY`: tests run several cores of one service in one
process, and a second metric of the same name on one registry raises; and in the rollout's
process the global registry is vLLM's: its Prometheus stat logger registers `vllm:*` there and
unregisters every `vllm:` collector from it whenever an engine starts. The rollout runs its
engine with `disable_log_stats` (vLLM registers nothing) and exports its own numbers here, so
a later change to vLLM's stats cannot double or drop what hotloop serves.

Names follow Prometheus conventions: `hotloop_<service>_<what>[_<unit>]`, counters end in
`_total`, durations are histograms in seconds; docs/architecture.md ("Observability") lists
them per service.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

__all__ = ["CollectorRegistry", "Endpoint", "StateCollector", "counter", "gauge", "info",
           "registry", "serve", "LATENCY_BUCKETS", "STEP_BUCKETS"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds, for what a user or a caller waits on: a first token, a score, a swap."""
STEP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds, for training steps and the feedback-to-version loop (seconds to minutes on CPUs)."""

_registry: CollectorRegistry | None = None
_lock = threading.Lock()


def registry() -> CollectorRegistry:
    """This process's registry, created on first use with the process and platform
    collectors. A service's `__main__` gives it to its core; `hotloop.service` serves it."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = CollectorRegistry()
            ProcessCollector(registry=_registry)
            PlatformCollector(registry=_registry)
            GCCollector(registry=_registry)
        return _registry


@dataclass
class Endpoint:
    """A running `/metrics` endpoint; `close()` stops it (idempotent)."""

    host: str
    port: int
    _server: object

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()  # returns once its serving thread left its loop
            server.server_close()


def serve(reg: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> Endpoint:
    """Serve `reg` over HTTP (`GET /metrics`, also at any other path, as prometheus_client
    does) from a daemon thread; port 0 picks a free one (`Endpoint.port`)."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=reg)
    return Endpoint(host, server.server_port, server)


class StateCollector(Collector):
    """Metrics read from a service's state at scrape time: `read()` yields metric families
    (build them with `counter`, `gauge`, `info`). See the module docstring for what `read`
    may touch (it runs in the endpoint's thread)."""

    def __init__(self, read: Callable[[], Iterable[Metric]], reg: CollectorRegistry | None = None):
        self._read = read
        if reg is not None:
            reg.register(self)

    def collect(self) -> Iterable[Metric]:
        yield from self._read()

    def describe(self) -> Iterable[Metric]:
        # Read once at registration, so a name that clashes with another metric on the
        # registry fails there, as it does for prometheus_client's own metrics.
        return list(self._read())


Samples = Iterable[tuple[Sequence[str], float]]


def counter(name: str, doc: str, value: float | None = None, *, labels: Sequence[str] = (),
            samples: Samples = ()) -> CounterMetricFamily:
    """A counter family: one unlabelled `value`, or `samples` of (label values, value)."""
    fam = CounterMetricFamily(name, doc, value=value, labels=list(labels) if labels else None)
    for values, v in samples:
        fam.add_metric(list(values), v)
    return fam


def gauge(name: str, doc: str, value: float | None = None, *, labels: Sequence[str] = (),
          samples: Samples = ()) -> GaugeMetricFamily:
    """A gauge family: one unlabelled `value`, or `samples` of (label values, value)."""
    fam = GaugeMetricFamily(name, doc, value=value, labels=list(labels) if labels else None)
    for values, v in samples:
        fam.add_metric(list(values), v)
    return fam


def info(name: str, doc: str, value: dict[str, str]) -> InfoMetricFamily:
    """An info family (`<name>_info{...} 1`): facts that do not change while it runs."""
    return InfoMetricFamily(name, doc, value=value)
