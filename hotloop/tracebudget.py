"""`hotloop trace budget`: a latency budget (stage, time, share of the loop) from trace files.

Reads the OTLP JSON-lines files that the `jsonl` exporter writes (one ExportTraceServiceRequest
per line), finds the loop's root spans (by name, or the longest roots), and attributes time
to their direct children by name. Works for the GRPO step (`grpo.step`) and any other loop
that opens one span per iteration.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path


def read_spans(paths: list[str]) -> list[dict]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    spans = []
    for f in files:
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            doc = json.loads(line)
            for rs in doc.get("resourceSpans", doc.get("resource_spans", [])):
                for ss in rs.get("scopeSpans", rs.get("scope_spans", [])):
                    for s in ss.get("spans", []):
                        spans.append({
                            "name": s["name"],
                            "span_id": s.get("spanId", s.get("span_id")),
                            "parent": s.get("parentSpanId", s.get("parent_span_id")) or "",
                            "start": int(s.get("startTimeUnixNano", s.get("start_time_unix_nano"))),
                            "end": int(s.get("endTimeUnixNano", s.get("end_time_unix_nano"))),
                        })
    return spans


def budget(spans: list[dict], root: str = "grpo.step") -> dict:
    roots = [s for s in spans if s["name"] == root]
    if not roots:
        raise SystemExit(f"no spans named {root!r} in the traces")
    ids = {s["span_id"] for s in roots}
    per_stage: dict[str, list[float]] = defaultdict(list)
    for s in spans:
        if s["parent"] in ids:
            per_stage[s["name"]].append((s["end"] - s["start"]) / 1e9)
    loop = [(s["end"] - s["start"]) / 1e9 for s in roots]
    total = sum(loop)
    stages = {
        name: {"median_s": statistics.median(v), "total_s": sum(v), "share": sum(v) / total}
        for name, v in sorted(per_stage.items(), key=lambda kv: -sum(kv[1]))
    }
    covered = sum(v["total_s"] for v in stages.values())
    return {"root": root, "iterations": len(roots), "median_s": statistics.median(loop),
            "stages": stages, "unattributed_share": 1 - covered / total}


def main(args) -> int:
    result = budget(read_spans(args.paths), args.root or "grpo.step")
    print(f"{result['root']}: {result['iterations']} iterations, median {result['median_s']:.2f} s")
    print(f"{'stage':<14}{'median s':>10}{'share':>8}")
    for name, v in result["stages"].items():
        print(f"{name:<14}{v['median_s']:>10.3f}{v['share']:>8.1%}")
    print(f"{'(other)':<14}{'':>10}{result['unattributed_share']:>8.1%}")
    return 0
