"""Reading trace files: a latency budget (stage, time, share of the loop; `hotloop trace
budget` prints it), and where a user's time to first token went, hop by hop (`ttft_hops`).

Reads the OTLP JSON-lines files that the `jsonl` exporter writes (one ExportTraceServiceRequest
per line), finds the loop's root spans (by name, or the longest roots), and attributes time
to their direct children by name. Works for the GRPO step (`grpo.step`) and any other loop
that opens one span per iteration. Does not own the command (`apps/tracebudget.py`).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path


def read_spans(paths: list[str]) -> list[dict]:
    """The spans of trace files, or of every `*.jsonl` under a directory."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    return read_trace_spans(files)


def budget(spans: list[dict], root: str = "grpo.step") -> dict:
    roots = [s for s in spans if s["name"] == root]
    if not roots:
        raise SystemExit(f"no spans named {root!r} in the traces")
    ids = {s["span_id"] for s in roots}
    per_stage: dict[str, list[float]] = defaultdict(list)
    for s in spans:
        if s["parent"] in ids:
            per_stage[s["name"]].append(s["end"] - s["start"])
    loop = [s["end"] - s["start"] for s in roots]
    total = sum(loop)
    stages = {
        name: {"median_s": statistics.median(v), "total_s": sum(v), "share": sum(v) / total}
        for name, v in sorted(per_stage.items(), key=lambda kv: -sum(kv[1]))
    }
    covered = sum(v["total_s"] for v in stages.values())
    return {"root": root, "iterations": len(roots), "median_s": statistics.median(loop),
            "stages": stages, "unattributed_share": 1 - covered / total}


def read_trace_spans(paths: list[Path]) -> list[dict]:
    """Spans of OTLP JSON-lines files: name, trace, span_id, parent, start and end (unix
    seconds), attributes and events (name -> unix seconds of its first occurrence)."""
    spans = []
    for f in paths:
        if not f.exists():
            continue
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            doc = json.loads(line)
            for rs in doc.get("resourceSpans", doc.get("resource_spans", [])):
                for ss in rs.get("scopeSpans", rs.get("scope_spans", [])):
                    for s in ss.get("spans", []):
                        attrs = {}
                        for a in s.get("attributes", []):
                            val = a.get("value", {})
                            attrs[a["key"]] = next(iter(val.values()), None) if val else None
                        events = {}
                        for e in s.get("events") or []:
                            t = int(e.get("timeUnixNano", e.get("time_unix_nano", 0))) / 1e9
                            events.setdefault(e["name"], t)
                        spans.append({
                            "name": s["name"], "trace": s.get("traceId", s.get("trace_id")),
                            "span_id": s.get("spanId", s.get("span_id")),
                            "parent": s.get("parentSpanId", s.get("parent_span_id")) or "",
                            "start": int(s.get("startTimeUnixNano", s.get("start_time_unix_nano"))) / 1e9,
                            "end": int(s.get("endTimeUnixNano", s.get("end_time_unix_nano"))) / 1e9,
                            "attrs": attrs, "events": events,
                        })
    return spans


GATEWAY_SPAN = "gateway.generate"
REPLICA_SPAN = "/hotloop.v1.Rollout/Generate"  # the replica's gRPC server span
TTFT_HOPS = ("to_gateway", "to_replica", "replica", "to_client")


def ttft_hops(spans: list[dict], requests: list[dict]) -> dict[str, dict[str, float]]:
    """Each request's time to first token split into the hops the traces can see, in ms, by
    response id. `requests` holds the client's view: response_id, ts (unix seconds at send)
    and ttft_ms. The hops follow each other, so they add up to the client's TTFT:
    - to_gateway: sent -> the gateway began the request (client, network, HTTP, auth);
    - to_replica: -> the replica's server span began (routing, the gRPC hop);
    - replica: -> the replica produced the first token (queueing behind other work, prefill);
    - to_client: -> the client read it (the stream back through the gateway).
    A request whose trace lacks a hop (a span not exported, a replica that recorded no
    first token) is left out. Clocks: one host's, as in `hotloop bench joint`."""
    gateway: dict[str, dict] = {}
    replica: dict[str, dict] = {}  # trace -> the replica's server span with its first token
    for s in spans:
        if s["name"] == GATEWAY_SPAN and s["attrs"].get("hotloop.response_id"):
            gateway[s["attrs"]["hotloop.response_id"]] = s
        elif s["name"] == REPLICA_SPAN and "first_token" in s["events"]:
            replica.setdefault(s["trace"], s)
    out = {}
    for r in requests:
        g = gateway.get(r.get("response_id") or "")
        rep = replica.get(g["trace"]) if g else None
        if rep is None or r.get("ttft_ms") is None:
            continue
        sent, first = r["ts"], rep["events"]["first_token"]
        out[r["response_id"]] = {
            "to_gateway": (g["start"] - sent) * 1e3,
            "to_replica": (rep["start"] - g["start"]) * 1e3,
            "replica": (first - rep["start"]) * 1e3,
            "to_client": r["ttft_ms"] - (first - sent) * 1e3,
        }
    return out
