"""The process-global tracer provider follows each job's exporter (telemetry.setup)."""

from __future__ import annotations

import json
from pathlib import Path

from hotloop import telemetry
from hotloop.config import TelemetryConfig


def span_names(path: Path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line).get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                names += [s["name"] for s in ss.get("spans", [])]
    return names


def test_a_second_job_in_the_process_writes_its_spans_to_its_own_run_dir(tmp_path: Path) -> None:
    """OpenTelemetry sets the global provider once per process. Before, a second in-process
    job (tests, notebooks) kept writing into the first job's files, or into an exporter the
    first job's end had shut down, and its trace budget came out empty."""
    cfg = TelemetryConfig(exporter="jsonl")
    first, second = tmp_path / "first", tmp_path / "second"

    telemetry.setup("trainer", cfg, str(first))
    with telemetry.tracer("test").start_as_current_span("first.job"):
        pass
    telemetry.shutdown()  # as run_job ends

    telemetry.setup("trainer", cfg, str(second))
    with telemetry.tracer("test").start_as_current_span("second.job"):
        pass
    telemetry.shutdown()

    telemetry.setup("trainer", cfg, str(second))  # the same run dir again, after a shutdown
    with telemetry.tracer("test").start_as_current_span("second.again"):
        pass
    telemetry.setup("trainer", TelemetryConfig(exporter="memory"), str(second))  # re-pointed
    with telemetry.tracer("test").start_as_current_span("in.memory"):
        pass
    telemetry.shutdown()

    assert span_names(first / "traces/trainer.jsonl") == ["first.job"]
    assert span_names(second / "traces/trainer.jsonl") == ["second.job", "second.again"]
    assert [s.name for s in telemetry.memory_spans()] == ["in.memory"]


def test_setting_up_the_same_exporter_twice_keeps_one_stream(tmp_path: Path) -> None:
    cfg = TelemetryConfig(exporter="jsonl")
    telemetry.setup("trainer", cfg, str(tmp_path))
    telemetry.setup("trainer", cfg, str(tmp_path))  # e.g. the service and its job: no-op
    with telemetry.tracer("test").start_as_current_span("once"):
        pass
    telemetry.shutdown()
    assert span_names(tmp_path / "traces/trainer.jsonl") == ["once"]
