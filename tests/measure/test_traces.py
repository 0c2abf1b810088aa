"""Reading trace files (`measure.traces`): where a user's time to first token went, hop by hop."""

from __future__ import annotations

import json

import pytest

from measure.traces import read_trace_spans, ttft_hops


def _span(name, trace, span_id, parent, start, end, **attrs):
    return {"traceId": trace, "spanId": span_id, "parentSpanId": parent, "name": name,
            "startTimeUnixNano": str(int(start * 1e9)), "endTimeUnixNano": str(int(end * 1e9)),
            "attributes": [{"key": k, "value": {"intValue": str(v)}} for k, v in attrs.items()]}


def test_ttft_hops_split_a_users_first_token_along_its_trace(tmp_path):
    gen = "/hotloop.v1.Rollout/Generate"
    gw = _span("gateway.generate", "t1", "g", "", 10.02, 10.5)
    gw["attributes"] = [{"key": "hotloop.response_id", "value": {"stringValue": "chatcmpl-1"}}]
    server = _span(gen, "t1", "rs", "gc", 10.03, 10.4)
    server["events"] = [{"name": "first_token", "timeUnixNano": str(int(10.13 * 1e9))}]
    other = _span(gen, "t2", "rs2", "", 10.0, 10.1)  # a trace no user request belongs to
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": [gw, server, other]}]}]}
    (tmp_path / "t.jsonl").write_text(json.dumps(doc) + "\n")
    spans = read_trace_spans([tmp_path / "t.jsonl"])
    sent = {"response_id": "chatcmpl-1", "ts": 10.0, "ttft_ms": 150.0}
    hops = ttft_hops(spans, [sent, {"response_id": "chatcmpl-2", "ts": 11.0, "ttft_ms": 90.0}])
    assert list(hops) == ["chatcmpl-1"]  # no trace for the second: left out, not guessed
    got = {k: round(v) for k, v in hops["chatcmpl-1"].items()}
    assert got == {"to_gateway": 20, "to_replica": 10, "replica": 100, "to_client": 20}
    assert sum(hops["chatcmpl-1"].values()) == pytest.approx(150.0)  # the hops add up to the TTFT
    server["events"] = []  # a replica that recorded no first token: nothing to split
    (tmp_path / "t.jsonl").write_text(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [gw, server]}]}]}))
    assert ttft_hops(read_trace_spans([tmp_path / "t.jsonl"]), [sent]) == {}
