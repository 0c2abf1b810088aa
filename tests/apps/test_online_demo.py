"""`hotloop demo-online`: the loop bookkeeping directly (update records, feedback rates, trace
spans), and a short real run on the tiny model through the CLI, checked for its report and for
leaving no process behind. Stopping on SIGTERM (exit 130, the interrupted report, nothing left
running) is checked by tests/apps/test_tenant_demo.py's real run: both demos stop through
`Stack.stop` and `run_interruptible`. The update-loop bench: tests/benchmarks/test_update_loop.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apps.online_demo import target_share
from measure.loop import LoopTracker
from measure.traces import read_trace_spans, ttft_hops
from measure.users import Record

REPO = Path(__file__).resolve().parents[2]


def test_target_is_three_times_the_base_rate_capped_at_point_eight():
    assert target_share(0.15) == pytest.approx(0.45)
    assert target_share(0.5) == 0.8
    assert target_share(0.0) == 0.8 and target_share(None) == 0.8


def test_the_loop_trend_compares_the_first_third_of_the_feedback_with_the_last():
    from apps.online_demo import loop_summary

    # sent out of order: the thirds go by when the feedback was sent, not by list order
    loops = [{"sent": t, "loop_ms": ms} for t, ms in
             [(7, 700), (1, 100), (2, 300), (3, 200), (4, 400), (5, 500), (6, 600), (8, 900), (9, 800)]]
    got = loop_summary(loops)
    assert (got["first_third_p50"], got["last_third_p50"], got["n"]) == (200, 800, 9)
    assert got["p50"] == 500
    assert loop_summary(loops[:2])["first_third_p50"] is None  # fewer than 3: no thirds
    assert got["to_live_p50"] is None and got["after_live_p50"] is None  # no announcement heard


def test_the_loop_splits_at_the_versions_announcement():
    from apps.online_demo import loop_summary

    loops = [{"sent": 0.0, "live": 2.0, "first_token": 5.0, "loop_ms": 5000.0},
             {"sent": 1.0, "live": 5.0, "first_token": 6.0, "loop_ms": 5000.0},
             {"sent": 2.0, "live": 3.0, "first_token": 9.0, "loop_ms": 7000.0},
             {"sent": 3.0, "live": None, "first_token": 4.0, "loop_ms": 1000.0}]  # unheard: left out
    got = loop_summary(loops)
    assert got["to_live_p50"] == pytest.approx(2000) and got["after_live_p50"] == pytest.approx(3000)


def test_feedback_rates_count_what_arrived_trained_and_was_dropped(tmp_path):
    import asyncio

    from apps.online_demo import DemoState, feedback_rates
    from measure.loop import Update
    from measure.users import Brevity

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"settled": {"seq": s, "kind": k, "reason": "r"}}) + "\n"
                               for s, k in [(1, "shed"), (2, "shed"), (3, "missing_traffic")]))
    tracker = LoopTracker("nats://unused", metrics)
    asyncio.run(tracker.poll())  # settled records need no bus; steps would
    assert tracker.settled == {"shed": 2, "missing_traffic": 1}
    tracker.updates = [Update(1, 0.0, 4, 0.0, seconds=2.0), Update(2, 0.0, 2, 0.0, seconds=1.0)]

    class Sim:  # what feedback_rates reads of a Simulation
        records = [Record(ts=0, user=0, phase="training", prompt=0, feedback=f)
                   for f in ["accepted"] * 9 + ["duplicate", "error: HTTP 503", ""]]
        records.append(Record(ts=0, user=0, phase="idle", prompt=0, feedback="accepted"))

    state = DemoState("r", tmp_path, Brevity(), 40, sim=Sim(), tracker=tracker,
                      training_started=100.0, training_ended=110.0)
    got = feedback_rates(state)
    assert got["counts"] == {"arrived": 10, "trained": 6, "dropped": 3, "pending": 1}
    assert (got["arrived"], got["trained"], got["dropped"]) == pytest.approx((1.0, 0.6, 0.3))
    assert got["capacity"] == pytest.approx(2.0)  # 6 trained in 3 s of updates
    assert got["trainer_busy_share"] == pytest.approx(0.3)


def test_a_run_stopped_before_any_answer_still_writes_its_report(tmp_path):
    from apps.online_demo import DemoState, write_demo_report
    from measure.users import Brevity

    state = DemoState("early", tmp_path, Brevity(), window=40, interrupted=True)
    report = write_demo_report(state)
    on_disk = json.loads((tmp_path / "online-report.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert set(on_disk["preference_share"]) >= {"base", "final"} and on_disk["interrupted"]
    assert {"idle_p99", "training_p99"} <= set(on_disk["user_ttft_ms"]) and "p50" in on_disk["loop_ms"]
    assert (tmp_path / "online.png").read_bytes()[:4] == b"\x89PNG"
    assert "(interrupted)" in (tmp_path / "online-report.md").read_text()


# ---- real runs ---------------------------------------------------------------------------------


def _config(tmp_path, tiny_model) -> Path:
    cfg = tmp_path / "online.toml"
    cfg.write_text(f"""
run_dir = "{tmp_path / 'unused'}"
[model]
name = "{tiny_model}"
max_model_len = 512
[telemetry]
exporter = "jsonl"
[rollout]
kv_cache_gib = 1
[trainer]
torch_threads = 1
[trainer.optimizer]
lr = 1e-3
[online]
batch_size = 2
batch_window_s = 0.5
checkpoint_interval = 2
""")
    return cfg


def _left_behind(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.mark.slow
def test_demo_online_writes_its_report_and_leaves_nothing_running(tiny_model, tmp_path):
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "apps.cli", "demo-online", "--config", str(_config(tmp_path, tiny_model)),
           "--idle-s", "6", "--train-s", "20", "--no-stop", "--users", "2", "--max-tokens", "16",
           "--max-words", "8", "--window", "8", "--progress", "5", "--out-dir", str(out),
           "--run-id", "t", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "idle phase:" in proc.stdout and "report:" in proc.stdout
    report = json.loads((out / "t" / "online-report.json").read_text())
    assert report["preference_share"]["base"] is not None and report["preference_share"]["final"] is not None
    assert report["loop_ms"]["p50"] > 0 and report["loop_ms"]["n"] >= 1  # a version trained on feedback served
    assert {"first_third_p50", "last_third_p50"} <= set(report["loop_ms"])
    rates = report["feedback_per_s"]
    assert rates["arrived"] > 0 and rates["trained"] > 0 and rates["dropped"] >= 0
    assert rates["counts"]["trained"] + rates["counts"]["dropped"] <= rates["counts"]["arrived"]
    for key in ("idle_p99", "training_p99", "idle_p50", "training_p50"):
        assert report["user_ttft_ms"][key] > 0 and report["user_itl_ms"][key] is not None
    assert set(report["version_lag"]) == {"versions", "seconds"}
    assert report["versions"]["trained"] >= 1 and report["versions"]["served"] >= 1
    png = (out / "t" / "online.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "t" / "online-report.md").read_text().startswith("# hotloop online run")
    records = [json.loads(line) for line in (out / "t" / "requests.jsonl").read_text().splitlines()]
    assert {r["phase"] for r in records} == {"warmup", "idle", "training"}
    assert sum(r["phase"] == "warmup" for r in records) >= 2  # each user's first answer
    assert all(r["feedback"] == "" for r in records if r["phase"] != "training")
    assert any(r["feedback"] == "accepted" for r in records if r["phase"] == "training")
    # every user request's trace runs gateway -> replica, and the replica marks its first token
    spans = read_trace_spans(sorted((out / "t" / "mesh" / "traces").glob("*.jsonl")))
    hops = ttft_hops(spans, records)
    assert len(hops) >= len(records) // 2, (len(hops), len(records))
    for h in hops.values():
        # to_client is the client's TTFT (a monotonic duration from just before the send) less
        # a wall-clock span (the record's send time to the replica's first token): the two
        # clocks and the two instants taken for "sent" differ by up to a millisecond or so, so
        # a hop of ~0 can read slightly negative (CI: -0.2 ms). The bound is the invariant.
        assert h["to_replica"] >= 0 and h["replica"] > 0 and h["to_client"] >= -5.0, h
    assert _left_behind(str(out)) == []
