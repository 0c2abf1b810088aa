"""`hotloop bench tenants`: its pieces directly (percentiles, options, the probe verdict, the
workload's spread over tenants), and a short real run on the tiny model through `main`: one
engine, a real gRPC server, real pushes into tenants' lineages, the JSON with every field."""

from __future__ import annotations

import json
import math
from argparse import Namespace
from pathlib import Path

import pytest

from benchmarks.rollout import spread
from benchmarks.tenants import check_args, parse_counts, percentile, probe_verdict
from hotloop.completion import Completion


def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 95) == 95
    assert percentile([10, 0], 100) == 10


def test_tenant_counts_and_options_are_checked():
    assert parse_counts("1,4,16") == [1, 4, 16]
    for bad in ("", "1,x", "0", "2,-1"):
        with pytest.raises(ValueError, match="--tenant-counts"):
            parse_counts(bad)
    good = dict(users=4, tenant_slots=4, max_tokens=64, prompts=8, n=8, batch_max_tokens=128,
                repeats=1, duration_s=30.0, push_every_s=10.0, slot_wait_s=120.0)
    assert check_args(Namespace(**good)) == []
    assert check_args(Namespace(**{**good, "users": 0})) == ["--users must be 1 or more"]
    assert check_args(Namespace(**{**good, "push_every_s": 0.0})) == [
        "--push-every-s must be above 0"]
    assert "twice --push-every-s" in check_args(Namespace(**{**good, "duration_s": 15.0}))[0]


def _greedy(tokens: list[int], top: list[list[tuple[int, float]]] = ()) -> Completion:
    return Completion(0, 0, "", tokens, [0.0] * len(tokens), "length", 1,
                      top_logprobs=[[(t, lp, "") for t, lp in pos] for pos in top])


def test_probe_verdict_tells_a_tie_from_a_wrong_adapter():
    alone = _greedy([5, 6, 7])
    assert probe_verdict(_greedy([5, 6, 7]), alone) == "same"
    # parts at token 1 where 9 and 6 were all but tied: the batch's sums may flip that
    assert probe_verdict(_greedy([5, 9, 2], [[(5, -0.1)], [(9, -0.70), (6, -0.71)]]), alone) == "tie"
    # parts where the runner-up was far behind, or not in the top at all: another adapter
    assert probe_verdict(_greedy([5, 9, 2], [[(5, -0.1)], [(9, -0.1), (6, -2.5)]]), alone) == "wrong"
    assert probe_verdict(_greedy([5, 9, 2], [[(5, -0.1)], [(9, -0.1), (3, -0.1)]]), alone) == "wrong"
    assert probe_verdict(_greedy([5, 6]), alone) == "wrong"  # stopped early


def test_the_workload_spreads_its_samples_evenly_over_any_number_of_tenants():
    prompts = [f"p{i}" for i in range(4)]
    for k in (1, 2, 3, 4, 8, 16):
        tenants = [f"t{i}" for i in range(k)]
        calls = spread(prompts, 4, tenants)
        per_tenant = {t: 0 for t in tenants}
        per_prompt = {p: 0 for p in prompts}
        for t, ps, n in calls:
            per_tenant[t] += n * len(ps)
            for p in ps:
                per_prompt[p] += n
        assert per_prompt == {p: 4 for p in prompts}, k  # every sample once
        assert max(per_tenant.values()) - min(per_tenant.values()) <= 4, k
        if k <= len(prompts):  # whole prompts, as one call would prefill them
            assert all(n == 4 for _, _, n in calls)
        if k == 16:  # more tenants than samples per prompt's share: one sample each
            assert sorted(per_tenant.values()) == [1] * 16
    assert spread(prompts, 4, []) == [("", prompts, 4)]


@pytest.mark.slow
def test_a_short_run_reports_every_field_and_no_wrong_answer(tiny_model: Path, tmp_path: Path):
    from benchmarks.tenants import main

    out, png = tmp_path / "tenants.json", tmp_path / "tenants.png"
    # one slot for two tenants: the 2-tenant run must evict
    args = Namespace(model=str(tiny_model), tenant_counts="1,2", tenant_slots=1, users=2,
                     duration_s=2.0, push_every_s=1.0, max_tokens=8, prompts=2, n=2,
                     batch_max_tokens=8, repeats=1, slot_wait_s=60.0, json=str(out),
                     plot=str(png))
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert [x["tenants"] for x in r["runs"]] == [1, 2]
    assert r["merged_tokens_per_s"] > 0
    assert {"model", "tenant_slots", "users", "workload"} <= set(r["config"])
    assert {"cpu", "cores", "dtype", "engine"} <= set(r["machine"])
    for x in r["runs"]:
        k = x["tenants"]
        for key in ("user_ttft_ms.p50", "user_ttft_ms.p99", "user_tokens_per_s", "loop_ms.p50",
                    "loop_ms.p95", "adapter_load_ms.p50", "batch_tokens_per_s",
                    "resident_adapter_mib", "merged_tokens_per_s", "batch_vs_merged"):
            v = x
            for part in key.split("."):
                v = v[part]
            assert v is not None and v > 0 and math.isfinite(v), (k, key)
        assert x["wrong_adapter_answers"] == 0, x["wrong_examples"]
        assert x["failed_requests"] == {}
        # one round of pushes (each tenant's v2), each seen by a user of its tenant
        assert x["pushes"] == k and x["loops_seen"] == k
        assert x["adapter_loads"] >= k
        # the probes: beside the users equal to alone, and the tenants' answers their own
        assert x["probes"].get("same", 0) + x["probes"].get("tie", 0) == k
        assert x["probe_answers_distinct"] == k
        assert x["user_requests"] > 0
    one, two = r["runs"]
    assert two["evictions"] >= 1 and two["slot_waits"] >= 0
    assert one["ttft_p99_vs_1_tenant"] == 1.0
    assert png.stat().st_size > 0
