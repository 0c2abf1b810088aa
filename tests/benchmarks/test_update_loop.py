"""`hotloop bench update-loop`: the stage budget from trace spans and its table directly, and a
short real run on the tiny model through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from measure.traces import read_trace_spans
from benchmarks.update_loop import loop_stages, markdown
from tests.apps.test_online_demo import REPO, _config, _left_behind
from tests.measure.test_traces import _span


def test_stage_budget_of_one_loop_from_otlp_json_lines(tmp_path):
    push = "/hotloop.v1.Rollout/PushAdapter"
    trainer = [_span("online.step", "t1", "s", "", 10.0, 13.0),
               _span("consume", "t1", "c", "s", 10.0, 10.1),
               _span("train", "t1", "tr", "s", 10.2, 12.0),
               _span("publish", "t1", "p", "s", 12.1, 12.9, **{"hotloop.version": 4}),
               _span(push, "t1", "pc", "p", 12.2, 12.8)]
    rollout = [_span(push, "t1", "ps", "pc", 12.3, 12.7)]
    for name, spans in (("trainer", trainer), ("rollout", rollout)):
        doc = {"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(doc) + "\n")
    spans = read_trace_spans(sorted(tmp_path.glob("*.jsonl")))
    assert len(spans) == 6
    assert [s["attrs"] for s in spans if s["name"] == "publish"] == [{"hotloop.version": "4"}]
    loop = {"response_id": "r", "version": 4, "sent": 9.5, "first_token": 13.4, "loop_ms": 3900}
    st = {k: [round(x) for x in v] for k, v in loop_stages(spans, [loop]).items()}
    assert st == {"ingest": [500], "consume": [100], "train": [1800], "push": [200], "load": [400],
                  "first_token": [700]}  # from the end of the replica's load
    # in-flight swap: a user got a token from v4 before PushAdapter returned
    early = loop_stages(spans, [{**loop, "first_token": 12.5, "loop_ms": 3000}])
    assert round(early["load"][0]) == 200 and early["first_token"] == [0.0]
    # a loop whose version has no publish span in the traces contributes nothing
    assert loop_stages(spans, [{**loop, "version": 5}]) == {}


def test_the_table_shares_the_stages_and_names_the_largest_past_the_aim():
    summary = {"loop_ms": {"p50": 1500.0, "p95": 1800.0}, "loops": 3, "lost_feedback": 1,
               "stages_ms": {"train": 900.0, "load": 300.0, "push": 300.0},
               "stages_p95_ms": {"train": 1000.0, "load": 400.0, "push": 350.0}}
    text = markdown(summary)
    assert "3 loops, lost feedback 1: p50 1500 ms, p95 1800 ms" in text
    assert "| train | 900 | 60% | 1000 |" in text and "| push | 300 | 20% | 350 |" in text
    over = text[text.index("over the 1000 ms aim"):]
    assert over.index("- train: 900 ms") < over.index("- load: 300 ms")
    within = markdown({**summary, "loop_ms": {"p50": 800.0, "p95": 900.0}})
    assert "aim" not in within
    empty = markdown({"loop_ms": {"p50": None, "p95": None}, "loops": 0, "lost_feedback": 0,
                      "stages_ms": {}, "stages_p95_ms": {}})
    assert "p50 - ms" in empty


@pytest.mark.slow
def test_bench_update_loop_times_each_loop_and_its_stages(tiny_model, tmp_path):
    out = tmp_path / "runs"
    result = tmp_path / "loop.json"
    cmd = [sys.executable, "-m", "apps.cli", "bench", "update-loop", "--config",
           str(_config(tmp_path, tiny_model)), "--loops", "2", "--max-tokens", "16",
           "--out-dir", str(out), "--json", str(result)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("loop ") >= 2  # progress, one line per loop
    data = json.loads(result.read_text())
    assert data["loops"] == 2 and data["lost_feedback"] == 0
    assert 0 < data["loop_ms"]["p50"] <= data["loop_ms"]["p95"]
    stages = data["stages_ms"]
    assert {"ingest", "consume", "join", "train", "pack", "push", "load", "first_token"} <= set(stages)
    assert stages["train"] > 0 and stages["load"] > 0
    # the stages lie on the loop's path: together they are about the loop, never far beyond it
    assert sum(stages.values()) < 1.5 * data["loop_ms"]["p95"]
    assert _left_behind(str(out)) == []
