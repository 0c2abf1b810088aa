"""`hotloop bench joint`: the summarizing and choosing logic on synthetic records (no mesh)."""

from __future__ import annotations

import json

import pytest

from measure.users import Record
from benchmarks.joint import (
    CpuMark,
    StepSeen,
    bench_summary,
    choose,
    foreign_cpu,
    hop_figures,
    markdown,
    meets_aim,
    parse_policies,
    parse_steps,
    ppo_rate,
)


def rec(phase: str, ttft: float, itl: float = 50.0, error: str = "", ts: float = 0.0) -> Record:
    r = Record(ts=ts, user=0, phase=phase, prompt=0, ttft_ms=ttft, error=error, words=9, score=0.0)
    r.itl_ms = {"p50": itl, "p99": itl * 2, "max": itl * 2, "n": 10}
    return r


def records() -> list[Record]:
    """Policy `none` trains in (100, 160], `nice` in (300, 360] (unix seconds)."""
    out = [rec("warmup", 5000.0, ts=1.0)]  # the engine's first batch: excluded from everything
    out += [rec("idle", 100.0 + i, ts=10.0) for i in range(100)]  # p99 = 100 + 98.01
    # started while the first step ran (labelled start-up: the step was not logged yet)
    out += [rec("none:startup", 300.0 + 2 * i, itl=80.0, ts=101.0) for i in range(10)]
    out += [rec("none:training", 300.0 + 2 * i, itl=80.0, ts=130.0) for i in range(10, 100)]
    out += [rec("nice:training", 120.0 + i, ts=330.0) for i in range(100)]
    # the trainer's start-up (before its first step began), and after the window: not measured
    out += [rec("nice:startup", 9000.0, ts=290.0), rec("nice:stopping", 9000.0, ts=359.0)]
    out += [rec("none:training", 0.0, error="HTTP 503: busy", ts=140.0)]
    return out


def steps(*specs) -> list[StepSeen]:
    return [StepSeen(i, samples, seen_at, seconds, skipped) for i, (samples, seen_at, seconds, skipped)
            in enumerate(specs)]


def test_step_records_are_read_from_metrics_lines():
    lines = [json.dumps({"step": {"step": 3, "samples": 16, "skipped": False,
                                  "stage_seconds": {"generate": 2.0, "score": 0.5, "train": 7.5},
                                  "paused_s": 1.5}}),
             json.dumps({"eval": {"pass_at_1": 0.5}}), "",
             json.dumps({"step": {"step": 4, "samples": 16, "skipped": True, "stage_seconds": {}}})]
    got = parse_steps(lines, seen_at=42.0)
    assert [(s.step, s.samples, s.seconds, s.skipped, s.seen_at, s.paused_s) for s in got] == [
        (3, 16, 10.0, False, 42.0, 1.5), (4, 16, 0.0, True, 42.0, 0.0)]


def test_ppo_rate_counts_the_steps_logged_inside_the_window_and_not_skipped_ones():
    st = steps((16, 100.0, 9.0, False),   # the first step: it opens the window, not counted
               (16, 120.0, 10.0, False),
               (16, 140.0, 10.0, True),   # skipped (value divergence): no samples trained on
               (16, 150.0, 10.0, False),
               (16, 170.0, 10.0, False))  # logged after SIGTERM: outside
    r = ppo_rate(st, 100.0, 160.0)
    assert r["ppo_steps"] == 3 and r["ppo_skipped_steps"] == 1 and r["ppo_samples"] == 32
    # over the time the counted steps took (to the last one's line at 150), not the window's
    # tail, where a step was cut by SIGTERM
    assert r["ppo_samples_per_s"] == pytest.approx(32 / 50)
    assert r["ppo_samples_per_s_per_step"] == pytest.approx(32 / 20)
    empty = ppo_rate(st, 200.0, 260.0)
    assert empty["ppo_samples_per_s"] == 0.0 and empty["ppo_samples_per_s_per_step"] is None


def test_summary_ratios_the_choice_and_the_aim():
    runs = [
        {"policy": "none", "window": (100.0, 160.0),
         "steps": steps((16, 95.0, 9.0, False),  # the previous policy's trainer: outside
                        (16, 109.0, 9.0, False), (16, 130.0, 9.0, False)),
         "first_step_wait_s": 40.0},
        {"policy": "nice", "window": (300.0, 360.0),
         "steps": steps((16, 320.0, 20.0, False), (16, 365.0, 20.0, False)), "first_step_wait_s": 55.0},
    ]
    res = bench_summary(records(), runs, default_policy="none")
    idle_p99 = 100.0 + 98.01
    assert res["ttft_ms"]["idle"]["p50"] == pytest.approx(149.5)
    assert res["ttft_ms"]["idle"]["p99"] == pytest.approx(idle_p99)
    assert res["requests"]["idle"] == 100
    none, nice = res["policies"]["none"], res["policies"]["nice"]
    assert none["requests"] == 101 and none["errors"] == 1  # the failed request is counted, not timed
    assert none["ttft_p99_ratio"] == pytest.approx((300 + 2 * 98.01) / idle_p99)
    assert nice["ttft_p99_ratio"] == pytest.approx((120 + 98.01) / idle_p99)
    assert none["ppo_samples_per_s"] == pytest.approx(32 / 30) and nice["ppo_samples_per_s"] == pytest.approx(16 / 20)
    assert none["first_step_wait_s"] == 40.0  # extras pass through
    assert nice["startup"]["ttft_ms"]["p50"] == 9000.0 and none["startup"]["requests"] == 0
    assert nice["requests"] == 100  # neither the start-up nor the stopping request
    # the configured default is what "training" shows; the choice is by measurement
    assert res["training_policy"] == "none" and res["chosen"] == "nice"
    assert res["ttft_ms"]["training"] == none["ttft_ms"] and res["itl_ms"]["training"]["p50"] == 80.0
    assert res["ppo_samples_per_s"] == none["ppo_samples_per_s"]
    assert not res["aim"]["met"] and "2.51x idle" in res["aim"]["why_not"]
    assert nice["aim_met"] and not none["aim_met"]
    # a default that was not measured: "training" is the chosen policy's figure
    res2 = bench_summary(records(), runs, default_policy="pause")
    assert res2["training_policy"] == "nice" and res2["aim"]["met"] and res2["aim"]["why_not"] == ""
    json.dumps(res2)  # the result is JSON as it stands (steps are not part of it)
    md = markdown({**res, "notes": ["a note"]})
    assert "users_first=nice (chosen)" in md and "**Aim not met**" in md and "- a note" in md


def test_no_progress_means_no_choice_and_the_aim_is_not_met_whatever_the_latency():
    runs = [{"policy": "nice", "window": (300.0, 360.0),
             "steps": steps((16, 370.0, 9.0, False))}]  # logged after SIGTERM: no progress in the window
    res = bench_summary(records(), runs, default_policy="nice")
    assert res["policies"]["nice"]["ttft_p99_ratio"] < 1.5
    assert res["chosen"] is None and not res["aim"]["met"]
    assert "no progress" in res["aim"]["why_not"]
    assert choose({}) is None


def test_hop_figures_show_the_median_hops_and_the_slowest_requests():
    recs = [rec("idle", 100.0 + i) for i in range(10)]
    for i, r in enumerate(recs):
        r.response_id = f"r{i}"
    recs.append(rec("idle", 5000.0))  # no trace: left out
    hops = {f"r{i}": {"to_gateway": 10.0, "to_replica": 1.0, "replica": 80.0 + i, "to_client": 9.0}
            for i in range(10)}
    got = hop_figures(hops, recs)
    assert got["requests"] == 10 and got["p50_ms"]["replica"] == pytest.approx(84.5)
    assert [x["ttft_ms"] for x in got["slowest"]] == [109.0, 108.0, 107.0]
    assert got["slowest"][0]["replica"] == 89.0
    assert hop_figures(hops, [rec("idle", 100.0)]) is None  # no request of the phase traced
    res = bench_summary(recs, [], default_policy="none")
    md = markdown({**res, "notes": [], "ttft_hops": {"idle": got, "pause": None}})
    assert "| idle | median | 10 | 1 | 84 | 9 |" in md and "| idle | TTFT 109 |" in md


def test_nothing_measured_still_summarizes():
    res = bench_summary([], [], default_policy="none")
    assert res["training_policy"] is None and res["ttft_ms"]["training"]["p99"] is None
    assert not res["aim"]["met"] and res["ppo_samples_per_s"] == 0.0
    markdown({**res, "notes": []})


def test_policies_are_checked():
    assert parse_policies("none, nice,none") == ["none", "nice"]
    assert parse_policies("pause") == ["pause"]
    with pytest.raises(ValueError, match="bogus"):
        parse_policies("none,bogus")
    with pytest.raises(ValueError):
        parse_policies(" , ")


def test_other_work_is_what_the_machine_did_beyond_the_bench():
    a = CpuMark(0.0, 100.0, 0.0, 50.0, {7: (3.0, "pytest tests/x"), 8: (1.0, "idle daemon")})
    b = CpuMark(10.0, 118.0, 1.0, 60.0, {7: (9.0, "pytest tests/x"), 8: (1.1, "idle daemon"),
                                         9: (2.0, "a new python")})
    f = foreign_cpu(a, b)
    assert f["other_cores"] == pytest.approx(0.8) and f["own_cores"] == pytest.approx(1.0)
    assert f["steal_cores"] == pytest.approx(0.1)
    assert f["top_other"] == [{"cores": 0.6, "cmd": "pytest tests/x"}, {"cores": 0.2, "cmd": "a new python"}]
    assert foreign_cpu(None, b) is None


def test_notes_say_what_weakens_the_numbers():
    from types import SimpleNamespace

    from benchmarks.joint import notes

    runs = [
        {"policy": "none", "window": (100.0, 160.0), "steps": steps((16, 130.0, 9.0, False))},
        {"policy": "nice", "window": (300.0, 360.0),
         "steps": steps((16, 310.0, 20.0, False), (16, 340.0, 20.0, False))},
    ]
    recs = [r for r in records() if not r.phase.startswith("none:")]
    recs += [rec("none:training", 118.0 + i, ts=120.0) for i in range(100)]  # a hair better than nice
    res = bench_summary(recs, runs, default_policy="nice")
    assert res["chosen"] == "none"
    bench = SimpleNamespace(idle_cpu={"other_cores": 0.6, "steal_cores": 0.0, "cpus": 2}, runs=[], failed="")
    got = notes(bench, res)
    assert any("0.60 of 2 cores during the idle phase" in n for n in got)
    assert any(n.startswith("nice is within 10% of `none`") for n in got)
    assert any("the measurement chose `none`, the config's default is `nice`" in n for n in got)


def test_the_aim_holds_time_to_first_token_and_the_streams_stalls_alike():
    ok = {"ttft_p99_ratio": 1.4, "itl_p99_ratio": 1.9, "ppo_samples_per_s": 0.13}
    assert meets_aim(ok)
    assert not meets_aim({**ok, "itl_p99_ratio": 2.1})  # a stream frozen mid-answer
    assert not meets_aim({**ok, "ttft_p99_ratio": 1.6})
    assert not meets_aim({**ok, "itl_p99_ratio": None})  # not measured is not met
    assert not meets_aim({**ok, "ppo_samples_per_s": 0.0})
