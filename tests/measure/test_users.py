"""The simulated users: the hidden preference and the statistics directly; the simulator
against a real gateway (launcher-started processes on the tiny model)."""

from __future__ import annotations

import asyncio
import json

import pytest

from measure.users import (
    PROMPTS,
    Brevity,
    PromptDeck,
    RateLimiter,
    Record,
    SimConfig,
    Simulation,
    SlidingShare,
    Target,
    VersionClock,
    itl_summary,
    percentile,
    summarize,
    word_count,
)


def test_the_deck_asks_every_prompt_once_before_any_again():
    import random

    deck = PromptDeck(7, random.Random(3))
    drawn = [deck.draw() for _ in range(21)]
    for cycle in range(3):
        assert sorted(drawn[7 * cycle:7 * cycle + 7]) == list(range(7))
    assert drawn[:7] != drawn[7:14] or drawn[7:14] != drawn[14:]  # shuffled anew each cycle
    other = PromptDeck(7, random.Random(4))
    assert [other.draw() for _ in range(7)] != drawn[:7]  # the seed decides the order
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptDeck(0, random.Random(0))


def test_word_count_splits_on_any_whitespace():
    assert word_count("") == 0
    assert word_count("one") == 1
    assert word_count("  one\ttwo\nthree  - 4. ") == 5


def test_brevity_scores_plus_one_when_met_and_grades_the_excess():
    pref = Brevity(max_words=10)
    short = " ".join(["w"] * 10)
    assert pref.matched(short) and pref.score(short) == 1.0
    assert not pref.matched(short + " w")
    assert pref.score(" ".join(["w"] * 11)) == pytest.approx(-0.1)
    assert pref.score(" ".join(["w"] * 15)) == pytest.approx(-0.5)
    assert pref.score(" ".join(["w"] * 20)) == -1.0
    assert pref.score(" ".join(["w"] * 500)) == -1.0  # bounded to the gateway's [-1, 1]
    # monotone: a shorter over-long answer never scores below a longer one
    scores = [pref.score(" ".join(["w"] * n)) for n in range(11, 40)]
    assert scores == sorted(scores, reverse=True)
    assert "10 words" in pref.describe()


def test_a_cut_off_answer_is_not_short_when_only_complete_answers_count():
    from measure.users import Record

    text = " ".join(["w!"] * 8)  # few words in many tokens, ended by the token limit
    cut = Record(ts=0, user=0, phase="train", prompt=0, answer=text, finish_reason="length")
    done = Record(ts=0, user=0, phase="train", prompt=0, answer=text, finish_reason="stop")
    assert cut.cut_off and not done.cut_off
    whole, words = Brevity(max_words=10, min_words=5, complete=True), Brevity(max_words=10, min_words=5)
    assert not cut.meets(whole) and whole.score(text, cut_off=True) == -1.0
    assert done.meets(whole) and whole.score(text) == 1.0
    assert cut.meets(words) and words.score(text, cut_off=True) == 1.0  # words in the budget only
    # a complete answer above the limit still scores above a cut-off one: ending it is the step
    assert -1.0 < whole.score(" ".join(["w"] * 15)) < 0
    assert "complete answers" in whole.describe() and "complete" not in words.describe()


def test_an_empty_or_near_empty_answer_is_not_short_but_broken():
    pref = Brevity(max_words=10, min_words=5)
    for text in ("", "   "):
        assert not pref.matched(text) and pref.score(text) == -1.0
    # graded by the shortfall, like the excess: a one-liner near the edge is not a cliff
    assert pref.score("Ok.") == pytest.approx(-0.8)
    assert not pref.matched("one two three four")
    assert pref.score("one two three four") == pytest.approx(-0.2)
    scores = [pref.score(" ".join(["w"] * n)) for n in range(0, 5)]
    assert scores == sorted(scores) and len(set(scores)) == 5
    five = "one two three four five"
    assert pref.matched(five) and pref.score(five) == 1.0
    assert "5 to 10 words" in pref.describe()


def test_prompts_are_short_varied_questions():
    assert len(PROMPTS) >= 30 and len(set(PROMPTS)) == len(PROMPTS)
    assert all(0 < word_count(p) <= 15 for p in PROMPTS)


def test_percentile_interpolates_and_ignores_missing():
    assert percentile([], 50) is None
    assert percentile([None, float("nan")], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4, None], 100) == 4
    assert percentile(range(101), 99) == pytest.approx(99)


def test_sliding_share_keeps_only_the_window():
    s = SlidingShare(window=4)
    assert s.value is None
    for ok in (False, False, False, False, True, True):
        s.add(ok)
    assert len(s) == 4 and s.value == 0.5


def test_version_clock_first_token_of_a_version_or_a_later_one():
    c = VersionClock()
    c.saw(0, 10.0)
    c.saw(2, 30.0)
    c.saw(2, 25.0)  # an earlier sighting wins
    c.saw(3, 40.0)
    assert c.latest == 3
    assert c.first_at_least(1) == 25.0  # v1 never seen: v2 descends from it
    assert c.first_at_least(3) == 40.0
    assert c.first_at_least(4) is None


def test_itl_summary_and_summarize_by_phase():
    assert itl_summary([]) == {"p50": None, "p99": None, "max": None, "n": 0}
    assert itl_summary([10, 20, 30])["p50"] == 20
    recs = [
        Record(ts=0, user=0, phase="idle", prompt=0, response_id="a", version=0, ttft_ms=100,
               itl_ms=itl_summary([10, 20]), words=5, matched=True, score=1.0),
        Record(ts=1, user=1, phase="idle", prompt=1, response_id="b", version=1, ttft_ms=300,
               itl_ms=itl_summary([30]), words=50, matched=False, score=-1.0,
               feedback="accepted"),
        Record(ts=2, user=1, phase="idle", prompt=2, error="HTTP 503: no replica"),
        Record(ts=3, user=0, phase="idle", prompt=3, response_id="c", version=1, ttft_ms=200,
               itl_ms=itl_summary([]), words=60, matched=False, score=-1.0,
               feedback="error: HTTP 404 unknown"),
    ]
    s = summarize(recs)
    assert s["requests"] == 4 and s["errors"] == 1
    assert s["matched_share"] == pytest.approx(1 / 3)
    assert s["ttft_ms"]["p50"] == 200
    assert s["itl_ms"]["p50"] == pytest.approx(22.5)  # medians of the two streams with gaps
    assert s["feedback"] == {"sent": 2, "accepted": 1, "errors": 1}
    assert s["versions"] == [0, 1]


def test_rate_limiter_spaces_requests():
    async def go():
        lim = RateLimiter(20.0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.gather(*(lim.wait() for _ in range(5)))
        return loop.time() - t0

    assert 0.18 <= asyncio.run(go()) < 1.0  # 5 starts at 20/s: the last one after 0.2 s
    assert RateLimiter(0).interval == 0


@pytest.mark.slow
def test_simulated_users_through_a_real_gateway(tiny_model, tmp_path):
    """A short bounded run: every request streams through the gateway and gets a record with
    its response id and version; every feedback is accepted; no request fails."""
    from hotloop import config
    from launch.mesh import Mesh
    from launch.mesh import find_target
    from measure.users import SimConfig, Simulation

    cfg_path = tmp_path / "sim.toml"
    cfg_path.write_text(f"""
run_dir = "{tmp_path / 'run'}"
[model]
name = "{tiny_model}"
max_model_len = 512
[rollout]
kv_cache_gib = 1
""")
    mesh_cfg = config.load_mesh(config.raw_config(cfg_path, environ={}))
    out = tmp_path / "requests.jsonl"
    with Mesh(mesh_cfg, str(cfg_path), [], ["rollout", "gateway"], quiet=True):
        target = find_target(tmp_path / "run")
        sim = Simulation(target, SimConfig(users=2, requests_per_user=3, max_tokens=12, progress_s=0),
                         Brevity(8), out)
        summary = asyncio.run(sim.run())
        sim.close()
        # requests the gateway refuses (max_tokens over its limit): errors are records
        bad = Simulation(target, SimConfig(users=1, requests_per_user=2, max_tokens=10**6, progress_s=0),
                         Brevity(8))
        bad_summary = asyncio.run(bad.run())

        class StopsRating(Brevity):  # the user stops rating while it reads its first answer
            def matched(self, text: str, cut_off: bool = False) -> bool:
                quits.cfg.feedback = False
                return super().matched(text, cut_off)

        quits = Simulation(target, SimConfig(users=1, requests_per_user=2, max_tokens=12, progress_s=0),
                           StopsRating(8))
        asyncio.run(quits.run())
    # asked while rating, read after it stopped: not rated; asked after: not rated either
    assert [(bool(r.response_id), r.feedback) for r in quits.records] == [(True, ""), (True, "")]
    assert bad_summary["requests"] == 2 and bad_summary["errors"] == 2
    assert all(r.error.startswith("HTTP 400") and not r.feedback for r in bad.records)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 6 and summary["requests"] == 6 and summary["errors"] == 0
    for r in lines:
        assert r["response_id"].startswith("chatcmpl-")
        assert r["version"] == 0 and r["ttft_ms"] > 0 and r["words"] >= 0
        assert r["feedback"] == "accepted" and r["score"] == Brevity(8).score(r["answer"])
        assert r["words"] == len(r["answer"].split())
    assert len({r["response_id"] for r in lines}) == 6
    assert summary["feedback"] == {"sent": 6, "accepted": 6, "errors": 0}


def test_halt_stops_waits_and_closes_whatever_the_users_task_did(tmp_path):
    out = tmp_path / "requests.jsonl"

    async def go(body):
        sim = Simulation(Target("http://unused", "k"), SimConfig(duration_s=1), Brevity(), out)
        task = asyncio.create_task(body(sim))
        await asyncio.sleep(0)
        await sim.halt(task)
        return sim, task

    async def ended(sim):
        return {"requests": 0}

    async def fails(sim):
        raise RuntimeError("the gateway went away")

    async def runs_forever(sim):
        await asyncio.Event().wait()

    sim, task = asyncio.run(go(ended))
    assert task.result() == {"requests": 0} and sim._out is None and sim._stop.is_set()
    sim, task = asyncio.run(go(fails))  # not raised again: the caller is ending
    assert isinstance(task.exception(), RuntimeError) and sim._out is None
    sim, task = asyncio.run(go(runs_forever))
    assert task.cancelled() and sim._out is None
