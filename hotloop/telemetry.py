"""OpenTelemetry setup (one global provider per process, its exporter switchable per job) and
trace-context helpers for the bus.

Owns: the tracer provider and its exporter (JSON lines, OTLP, memory, none), gRPC
instrumentation, and inject/extract of W3C trace context into NATS headers.
Does not own: where spans are opened (services open spans on coarse stages only).
"""

from __future__ import annotations

import logging
from pathlib import Path

from opentelemetry import context, propagate, trace

from hotloop.config import TelemetryConfig

log = logging.getLogger(__name__)
_state: dict = {"provider": None, "switch": None, "target": None, "memory": None}


def setup(service: str, cfg: TelemetryConfig, run_dir: str = ".hotloop/run") -> None:
    """Install the global tracer provider for `service`, or point it at a new exporter.

    OpenTelemetry lets a process set its global provider once, so the provider is installed on
    the first call and its spans go through one switchable processor. A later call with the
    same exporter and destination changes nothing; one with another (a second job in the same
    process with its own run directory, as tests and notebooks run them) flushes the spans so
    far to the old exporter and sends the rest to the new one, instead of silently writing the
    second job's spans into the first one's files. The resource's `service.name` stays the
    first call's: a service is one process, and only in-process jobs call this twice.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    path = (str(cfg.jsonl_path or Path(run_dir) / "traces" / f"{service}.jsonl")
            if cfg.exporter == "jsonl" else "")
    target = (cfg.exporter, path, cfg.otlp_endpoint if cfg.exporter == "otlp" else "")
    if _state["target"] == target:
        return
    if _state["provider"] is None:
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        switch = _switch()
        provider.add_span_processor(switch)
        trace.set_tracer_provider(provider)
        _state.update(provider=provider, switch=switch)
    _state["memory"] = None
    _state["switch"].use(_processor(cfg, path))
    _state["target"] = target
    if cfg.exporter != "none":
        from hotloop.grpcutil import instrument_grpc

        instrument_grpc()


def _processor(cfg: TelemetryConfig, path: str):  # -> SpanProcessor | None
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if cfg.exporter == "jsonl":
        from opentelemetry.exporter.otlp.json.file import FileSpanExporter

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return BatchSpanProcessor(FileSpanExporter(path=path))
    if cfg.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint))
    if cfg.exporter == "memory":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        mem = InMemorySpanExporter()
        _state["memory"] = mem
        return SimpleSpanProcessor(mem)
    return None  # "none": spans are made (context still propagates) and dropped


def _switch():  # -> SpanProcessor
    """A span processor that forwards to one replaceable processor (see `setup`). Built on
    first use: the SDK is imported only by processes that trace."""
    from opentelemetry.sdk.trace import SpanProcessor

    class Switch(SpanProcessor):
        def __init__(self) -> None:
            self._inner: SpanProcessor | None = None

        def use(self, inner: SpanProcessor | None) -> None:
            old, self._inner = self._inner, inner
            if old is not None:
                old.shutdown()  # flushes what it still holds to its own exporter

        def on_start(self, span, parent_context=None) -> None:
            if self._inner is not None:
                self._inner.on_start(span, parent_context=parent_context)

        def _on_ending(self, span) -> None:
            if self._inner is not None:
                self._inner._on_ending(span)

        def on_end(self, span) -> None:
            if self._inner is not None:
                self._inner.on_end(span)

        def shutdown(self) -> None:
            self.use(None)

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True if self._inner is None else self._inner.force_flush(timeout_millis)

    return Switch()


def memory_spans() -> list:
    """Finished spans of the `memory` exporter (tests)."""
    mem = _state["memory"]
    return list(mem.get_finished_spans()) if mem is not None else []


def shutdown() -> None:
    """Flush and close the current exporter. The provider stays installed (it is global for
    the process's life); spans until the next `setup` are dropped, and that `setup` opens its
    exporter afresh even with the same destination (a second job in the same run directory)."""
    if _state["switch"] is not None:
        _state["switch"].use(None)
    _state["target"] = None


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Current trace context as W3C headers (for NATS messages)."""
    headers = dict(headers or {})
    propagate.inject(headers)
    return headers


def extract_context(headers: dict[str, str] | None) -> context.Context:
    return propagate.extract(headers or {})
