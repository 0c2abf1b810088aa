"""`hotloop bench grpo`'s figures from synthetic steps and CPU samples (the run itself needs
the mesh and minutes; `make bench` runs it)."""

from __future__ import annotations

import json

import pytest

from benchmarks.grpo import (CpuSample, StepSeen, compare, idle, markdown, merge,
                                         phase_figures)


def cpu(rate_own: float, rate_busy: float, t0: float = 1000.0, t1: float = 1100.0) -> list[CpuSample]:
    """Samples every second of a run using `rate_own` cores itself and `rate_busy` in all."""
    return [CpuSample(t, (t - t0) * rate_own, (t - t0) * rate_busy) for t in range(int(t0), int(t1) + 1)]


def test_idle_share_is_the_unused_part_of_the_cores():
    s = cpu(1.5, 1.8)
    f = idle(s, [(1010.0, 1020.0), (1030.5, 1040.5)], cpus=2)
    assert f["idle_share"] == pytest.approx(0.25) and f["machine_idle_share"] == pytest.approx(0.1)
    assert f["other_cores"] == pytest.approx(0.3) and f["seconds"] == pytest.approx(20.0)
    assert idle(s, [], 2)["idle_share"] is None


def test_overlapping_stage_windows_count_once():
    assert merge([(5, 7), (1, 3), (2, 4), (7, 8)]) == [(1, 4), (5, 8)]


def steps(walls: list[float], rewards: list[float], t0: float = 1000.0) -> list[StepSeen]:
    out, end = [], t0
    for i, (w, r) in enumerate(zip(walls, rewards)):
        end += w
        out.append(StepSeen(i + 1, end, w, {"generate": w / 2, "train": w / 2}, r, 64))
    return out


def test_samples_per_s_is_the_median_step_after_the_first_and_idle_covers_the_same_steps():
    seen = steps([30.0, 10.0, 20.0, 10.0], [0.1, 0.2, 0.3, 0.4])
    spans = [("generate", 1030.0, 1035.0), ("train", 1035.0, 1040.0), ("generate", 1200.0, 1300.0)]
    f = phase_figures(seen, cpu(1.0, 1.0, 1000, 1070), spans, cpus=2)
    assert f["samples_per_s"] == pytest.approx(64 / 15.0)  # steps 2 and 3: not the fill, not the drain
    assert f["samples_per_s_all"] == pytest.approx(4 * 64 / 70.0)
    assert f["idle_share"] == pytest.approx(0.5) and f["stage_idle_share"]["train"] == pytest.approx(0.5)
    assert phase_figures(seen[:2], cpu(1.0, 1.0), [], 2)["samples_per_s"] == pytest.approx(6.4)
    assert f["stage_seconds"] == {"generate": 7.5, "train": 7.5}  # medians
    assert [p["samples"] for p in f["reward_curve"]] == [64, 128, 192, 256]


def test_compare_states_each_aim():
    seen_sync = phase_figures(steps([20.0, 20.0, 20.0], [0.2, 0.3, 0.25]), cpu(1.6, 1.6), [], 2)
    seen_async = phase_figures(steps([20.0, 14.0, 14.0], [0.3, 0.2, 0.25]), cpu(1.9, 1.9), [], 2)
    c = compare(seen_sync, seen_async, {"name": "trl", "samples_per_s": 1.0})
    assert c["async_vs_sync"] == pytest.approx(20 / 14)
    assert c["aims"]["async_vs_sync_met"] and c["aims"]["async_idle_share_met"]  # 5% idle
    assert c["aims"]["learning_within_noise"]
    assert c["vs_peer"]["async"] == pytest.approx(64 / 14) and c["aims"]["vs_peer_met"]
    slow = compare(seen_sync, seen_sync, None)
    assert not slow["aims"]["async_vs_sync_met"] and "vs_peer" not in slow
    result = {"sync": seen_sync, "async": seen_async, "peer": {"name": "trl", "samples_per_s": 1.0},
              "comparison": c, "notes": ["a note"]}
    md = markdown(json.loads(json.dumps(result)))
    assert "| async |" in md and "vs peer" in md and "- a note" in md


def test_cpu_sampler_stops_cleanly_started_or_not():
    import time

    from benchmarks.grpo import CpuSampler

    never = CpuSampler(0.05)
    never.stop()  # the run failed before sampling began
    s = CpuSampler(0.05)
    s.start()
    deadline = time.monotonic() + 30
    while len(s.samples) < 2:  # two periodic samples, however slowly this machine runs
        assert time.monotonic() < deadline, "the sampler took no second sample"
        time.sleep(0.01)
    s.stop()
    assert not s.is_alive() and len(s.samples) >= 3  # and the one `stop` takes
    assert all(b.at >= a.at and b.own_s >= a.own_s for a, b in zip(s.samples, s.samples[1:]))


def test_each_replicas_share_is_its_part_of_its_services_work_in_replica_order():
    from benchmarks.grpo import replica_of, replica_shares, work_accounting

    assert replica_of("reward-1") == ("reward", 1) and replica_of("reward") == ("reward", 0)
    assert replica_of("trainer_server") == ("trainer_server", 0)
    endpoints = {"rollout": ["r:1", "r:2"], "reward": ["w:1", "w:2"], "reference": ["f:1"], "gateway": "g:1"}
    before = {"rollout": 10.0, "rollout-1": 0.0, "reward": 0.0, "reward-1": 5.0, "reference": 0.0}
    after = {"rollout-1": 300.0, "rollout": 110.0, "reward": 20.0, "reward-1": 25.0, "reference": 12.0,
             "gateway": 99.0}
    shares = replica_shares(before, after, endpoints)
    assert shares["rollout"] == [{"process": "rollout", "address": "r:1", "work": 100.0, "share": 0.25},
                                 {"process": "rollout-1", "address": "r:2", "work": 300.0, "share": 0.75}]
    assert [r["share"] for r in shares["reward"]] == [0.5, 0.5] and "gateway" not in shares

    seen = [StepSeen(1, 0.0, 1.0, {}, 0.0, 20, tokens=200, trained=8),
            StepSeen(2, 1.0, 1.0, {}, 0.0, 20, tokens=200, trained=4)]
    work = work_accounting(shares, seen, kl=True)
    assert work["rollout"] == {"unit": "tokens", "consumed": 400, "counted": 400.0, "lost": 0.0, "duplicated": 0.0}
    assert work["reward"]["lost"] == 0.0 and work["reward"]["duplicated"] == 0.0
    assert (work["reference"]["consumed"], work["reference"]["lost"]) == (12, 0.0)
    # a sample scored twice, and reference passes that never reached the service
    assert work_accounting({**shares, "reward": [{**shares["reward"][0], "work": 21.0}, shares["reward"][1]]},
                           seen, kl=True)["reward"]["duplicated"] == 1.0
    assert work_accounting(shares, seen, kl=False)["reference"]["duplicated"] == 12.0
    result = {"replicas": shares, "work": work, "lost": 0.0, "duplicated": 0.0}
    md = markdown(json.loads(json.dumps(result)))
    assert "| rollout | r:2 | 75% | 300 | tokens |" in md
    assert "lost: 0, duplicated: 0 (rollout: 400 of 400 tokens;" in md
