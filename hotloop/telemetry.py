"""OpenTelemetry setup, once per process, and trace-context helpers for the bus.

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
_state: dict = {"provider": None, "memory": None}


def setup(service: str, cfg: TelemetryConfig, run_dir: str = ".hotloop/run") -> None:
    """Install the global tracer provider for `service` (idempotent per process)."""
    if _state["provider"] is not None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if cfg.exporter == "jsonl":
        from opentelemetry.exporter.otlp.json.file import FileSpanExporter

        path = Path(cfg.jsonl_path or Path(run_dir) / "traces" / f"{service}.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        provider.add_span_processor(BatchSpanProcessor(FileSpanExporter(path=str(path))))
    elif cfg.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint)))
    elif cfg.exporter == "memory":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        mem = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(mem))
        _state["memory"] = mem
    trace.set_tracer_provider(provider)
    _state["provider"] = provider
    if cfg.exporter != "none":
        from hotloop.grpcutil import instrument_grpc

        instrument_grpc()


def memory_spans() -> list:
    """Finished spans of the `memory` exporter (tests)."""
    mem = _state["memory"]
    return list(mem.get_finished_spans()) if mem is not None else []


def shutdown() -> None:
    provider = _state["provider"]
    if provider is not None:
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Current trace context as W3C headers (for NATS messages)."""
    headers = dict(headers or {})
    propagate.inject(headers)
    return headers


def extract_context(headers: dict[str, str] | None) -> context.Context:
    return propagate.extract(headers or {})
