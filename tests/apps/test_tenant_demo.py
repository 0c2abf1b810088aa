"""`hotloop demo-tenants`: the preferences and the report's bookkeeping directly, and a short real
run on the tiny model through the CLI (three tenants, one engine, one shared trainer with a lane
per tenant), stopped by SIGTERM once every tenant has a trained version, checked for its
interrupted report, for each tenant's feedback training its own lane only, and for leaving no
process behind. The SIGTERM check is demo-online's too: both stop through
`launch.stack.Stack.stop`."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from measure.loop import LoopTracker
from measure.users import PREFERENCES, TENANT_PROMPTS, Bullets, Direct, Exclaim, Question, Record, list_items
from apps.tenant_demo import (BATCH_SIZE, KL_HORIZON, MAX_WAIT_S, NEGATIVE_WEIGHT, SERVE_AVERAGE, TENANTS,
                              TenantRun, key_id, make_keys, tenant_overrides, trainer_plan,
                              training_overrides, wrong_adapter)
from benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[2]


def test_bullets_count_list_lines_of_enough_words_and_score_a_step_toward_a_list():
    assert list_items("Sure:\n- one\n* two\n1. three\n2) four\n  - nested\nnot - this\n-\n- ") == 5
    assert list_items("- one two three four\n- Excuse.\n1. a b c d e", min_words=4) == 2
    b = Bullets(2, min_item_words=2)
    assert b.matched("- a b\n- c d") and not b.matched("- a b only") and not b.matched("- a\n- b")
    assert (b.score("- a b\n- c d"), b.score("1. a b"), b.score("- a\n- b"), b.score("no list")) == \
        (1.0, -0.5, -1.0, -1.0)
    assert "at least 4 words" in Bullets().describe()


def test_a_question_ends_the_answer_within_its_tail():
    q = Question(max_tail_words=3)
    assert q.matched("What kind of dog?") and q.matched("What kind? Let me know!")
    assert not q.matched("What kind? Tell me more about it soon") and not q.matched("A dog.")
    assert q.score("Why? " + "word " * 10) == -0.5 and q.score("No question.") == -1.0
    assert Question(0).matched("ok?  \n") and not Question(0).matched("ok? yes")


def test_an_exclamation_opens_the_answer():
    e = Exclaim()
    assert e.matched("Wow! A dog. Great.") and e.matched("Congratulations!!")
    assert not e.matched("A dog. Wow!") and not e.matched("Why? Great!") and not e.matched("no mark")
    assert (e.score("Great! Yes."), e.score("Yes. Great!"), e.score("Yes.")) == (1.0, -0.5, -1.0)


def test_direct_answers_say_you_in_their_first_sentence():
    d = Direct()
    assert d.matched("You could adopt a dog. Dogs are fun.") and d.matched("Great, you did it! Yes.")
    assert not d.matched("A dog is fun. You will love it.") and not d.matched("Your dog. Fun.")
    assert not d.matched("Younger dogs need care.") and d.matched("no mark but you")
    assert (d.score("You can."), d.score("Dogs. You can."), d.score("Dogs. Cats.")) == (1.0, -0.5, -1.0)


def test_tenants_are_named_after_known_preferences_each_once():
    from apps.tenant_demo import preferences

    prefs = preferences(["direct", "short"], max_words=50)
    assert list(prefs) == ["direct", "short"] and prefs["short"].max_words == 50
    assert isinstance(prefs["direct"], Direct) and list(preferences()) == list(TENANTS)
    for bad in (["short", "short"], ["short", "long"], []):
        with pytest.raises(ValueError, match="name each tenant once"):
            preferences(bad)


def test_demo_tenants_refuses_an_unknown_tenant_before_starting_anything(tmp_path):
    import subprocess
    import sys

    # a list written with spaces names the same tenants ("short" is known: "long" is refused)
    r = subprocess.run([sys.executable, "-m", "apps.cli", "demo-tenants", "--tenants", "short, long",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "--tenants short,long: name each tenant once" in r.stdout
    assert not list(tmp_path.iterdir())  # no run directory, no mesh


def test_every_tenant_has_a_preference_and_the_prompts_are_distinct():
    assert set(TENANTS) <= set(PREFERENCES)
    assert len(set(TENANT_PROMPTS)) == len(TENANT_PROMPTS) >= 40


def test_keys_and_tenants_config_give_each_tenant_its_own_key(tmp_path):
    keys = make_keys(tmp_path / "keys", list(TENANTS))
    lines = (tmp_path / "keys").read_text().splitlines()
    assert sorted(lines) == sorted(f"{key_id(t)}:{k}" for t, k in keys.items())
    assert len(set(keys.values())) == 3 and (tmp_path / "keys").stat().st_mode & 0o077 == 0
    from hotloop import config

    mesh = config.load_mesh(config.raw_config(None, tenant_overrides(tmp_path / "keys", list(TENANTS))))
    assert {t: c.keys for t, c in mesh.tenants.items()} == {t: [key_id(t)] for t in TENANTS}


def test_the_shared_trainer_plan_is_the_default_and_reads_each_lanes_metrics(tmp_path):
    from launch.stack import TRAINER_RUN
    from services.trainer.tenants.lanes import lane_dir

    plan = trainer_plan("auto", ["a", "b"], tmp_path)
    assert plan.mode == "shared" and plan.trainers is None  # the mesh's trainer role
    # it follows the tenant registry, so that a check can hold the lineage it checks
    assert plan.overrides == ['online.tenants=["a", "b"]', "online.follow_registry=true"]
    from hotloop import config
    from services.trainer.config import OnlineConfig

    section = config.raw_config(None, [*plan.overrides, f"online.out_dir={tmp_path}",
                                       f"online.run_id={TRAINER_RUN}"])["online"]
    job = OnlineConfig(**section)
    assert job.lanes and job.lane_tenants == ["a", "b"] and job.follow_registry
    for t in ("a", "b"):  # where start_stack's trainer writes each lane's step records
        assert plan.metrics[t] == lane_dir(Path(job.out_dir) / job.run_id, t) / "metrics.jsonl"


def test_the_trainer_plan_gives_each_tenant_its_own_run_and_subject(tmp_path):
    plan = trainer_plan("per-tenant", ["a", "b"], tmp_path)
    assert plan.mode == "per-tenant" and plan.overrides == []
    assert plan.trainers == {"trainer-a": ["online.tenant=a", "online.run_id=trainer-a"],
                             "trainer-b": ["online.tenant=b", "online.run_id=trainer-b"]}
    assert plan.metrics["b"] == tmp_path / "trainer-b" / "metrics.jsonl"
    with pytest.raises(ValueError):
        trainer_plan("several", ["a"], tmp_path)


def test_an_answer_is_from_the_wrong_adapter_when_its_lineage_is_not_the_keys():
    tracker = LoopTracker("nats://unused", Path("/nonexistent"), tenant="short")
    tracker.published_at = {1: 10.0, 2: 20.0}
    run = TenantRun("short", PREFERENCES["short"](), sim=None, tracker=tracker)

    def rec(**kw) -> Record:
        return Record(ts=0.0, user=0, phase="training", prompt=0, **kw)

    assert not wrong_adapter(run, rec(tenant="short", version=2))
    assert not wrong_adapter(run, rec(tenant="short", version=0))
    assert wrong_adapter(run, rec(tenant="bullets", version=1))  # another lineage served it
    assert wrong_adapter(run, rec(tenant=None, version=1))  # nothing said which
    assert wrong_adapter(run, rec(tenant="short", version=3))  # a version its lineage never had
    assert wrong_adapter(run, rec(error="HTTP 503: ... answered from the lineage of tenant 'x'"))
    assert not wrong_adapter(run, rec(error="HTTP 503: no healthy rollout replica"))


def test_the_report_pools_the_base_rates_and_measures_the_other_preferences_rise(tmp_path):
    from measure.users import VersionClock
    from apps.tenant_demo import TenantsState, preferences, write_tenants_report

    prefs = preferences(["short", "bullets", "exclaim"], max_words=6, min_words=5)  # 5 to 6 words;
    # lists of items of >= 4 words
    long_list, short_x, plain = "- a b c d\n- e f g h", "Wow! What a nice dog.", "one two three four five six seven"

    class Sim:  # what the report reads of a Simulation
        def __init__(self, idle: list[str], training: list[tuple[str, int, int]],
                     evaluated: list[str] = (), final: int = 0):
            self.records = [Record(ts=1.0, user=0, phase="idle", prompt=0, answer=a, tenant="x",
                                   version=0, last_version=0, **ending(a)) for a in idle]
            self.records += [Record(ts=10.0 + i, user=0, phase="training", prompt=0, answer=a,
                                    version=v, last_version=lv, **ending(a))
                             for i, (a, v, lv) in enumerate(training)]
            self.records += [Record(ts=30.0 + i, user=0, phase="eval", prompt=0, answer=a,
                                    version=final, last_version=final, **ending(a))
                             for i, a in enumerate(evaluated)]
            self.clock, self.feedback_sent = VersionClock(), {}

    def ending(a: str) -> dict:  # `plain` is an answer the token limit ended
        return {"words": len(a.split()), "finish_reason": "length" if a == plain else "stop"}

    state = TenantsState("r", tmp_path, prefs, window=4, trainers="per-tenant", training_started=5.0,
                         training_ended=20.0)
    for name, idle, training, evaluated, learned_until in (
            # learned to the end of training (20.0): its final version v2 answered 5 times after
            # that, all short and exclaiming
            ("short", [plain, short_x], [(plain, 1, 1)] * 4 + [(short_x, 1, 1)] * 4, [short_x] * 5, 20.0),
            # stopped learning at 11.5 (its users stopped rating): the answers after that which its
            # final version v2 gave, first token to last, count (2 of training, 3 of evaluation);
            # one begun on v1 does not, nor one from before the stop
            ("bullets", [long_list, plain],
             [(long_list, 2, 2), (plain, 1, 1), (long_list, 2, 2), (plain, 1, 2), (long_list, 2, 2)],
             [long_list, plain, plain], 11.5),
            # stopped before it stopped learning: the last 4 of training
            ("exclaim", [plain, plain], [(short_x, 1, 1), (plain, 1, 1), (plain, 1, 1), (plain, 1, 1)], [],
             None)):
        run = TenantRun(name, prefs[name], Sim(idle, training, evaluated, final=2),
                        LoopTracker("nats://unused", tmp_path, name))
        run.base, run.target, run.learned_until = 0.1, 0.3, learned_until
        state.runs[name] = run
    from measure.loop import Update

    state.runs["short"].tracker.updates = [  # its lane's step records: two turns, 30 tokens
        Update(1, 6.0, 2, 0.5, tokens=10, stages={"turn_wait": 1.0, "train": 2.0}, kl=0.02, kl_coef=0.1),
        Update(2, 8.0, 1, 0.5, tokens=20, stages={"turn_wait": 3.0, "train": 2.5}, kl=0.3, kl_coef=0.12)]
    state.runs["bullets"].tracker.updates = [Update(1, 7.0, 2, 0.5, tokens=10, stages={"train": 1.0})]
    report = write_tenants_report(state)
    short, bullets, exclaim = report["tenants"]
    # every tenant's idle answers together: 6 answers, 1 short, 1 list, 1 exclaiming
    assert [t["share"]["base"] for t in report["tenants"]] == pytest.approx([1 / 6] * 3)
    assert short["share"]["base_answers"] == 6
    # the final shares: the final version's answers since the lineage stopped learning, where
    # there are some, else the training window
    assert (short["share"]["final"], short["share"]["window"], short["share"]["final_from"],
            short["share"]["final_version"]) == (1.0, 5, "final_version", 2)
    assert short["cross"]["exclaim"]["delta"] == pytest.approx(1 - 1 / 6)  # a leak: shown, not hidden
    # its noise: the base share 1/6 of 6 answers, the final 1.0 of 5 (no spread)
    assert short["cross"]["exclaim"]["se"] == pytest.approx(((1 / 6) * (5 / 6) / 6) ** 0.5)
    assert short["cross_delta_max"] == pytest.approx(5 / 6)
    assert (bullets["share"]["final"], bullets["share"]["window"]) == (pytest.approx(3 / 5), 5)
    assert bullets["cross_delta_max"] == pytest.approx(-1 / 6)  # the others fell
    assert (exclaim["share"]["final"], exclaim["share"]["final_from"]) == (0.25, "training")
    # length, on the same answers as the shares: 4 of the 6 idle answers cut off (7, 5, 10, 7,
    # 7, 7 words); `short`'s final answers all ended by the model, `exclaim`'s 3 of 4 cut off
    assert short["length"] == {"base": {"cut_off": pytest.approx(4 / 6), "words_p50": 7},
                               "final": {"cut_off": 0.0, "words_p50": 5}}
    assert exclaim["length"]["final"] == {"cut_off": 0.75, "words_p50": 7}
    assert "| 0.67 (7) -> 0.00 (5) |" in (tmp_path / "tenants-report.md").read_text()
    # reached: the evaluation's share at the target (0.3), else the window's verdict (never met)
    assert [(t["share"]["reached"], t["share"]["confirmed"]) for t in report["tenants"]] == \
        [(True, False), (True, False), (False, False)]
    assert short["turns"] == {"updates": 2, "feedback": 3, "tokens": 30, "tokens_share": 0.75, "train_s": 4.5,
                              "turn_wait_s": 4.0, "turn_wait_p50_s": 2.0, "turn_wait_max_s": 3.0,
                              "kl_last": pytest.approx(0.16), "kl_coef_last": 0.12}
    assert bullets["turns"]["kl_last"] is None  # no KL term: nothing to show
    assert (bullets["turns"]["updates"], bullets["turns"]["tokens_share"]) == (1, 0.25)
    assert exclaim["turns"]["updates"] == 0 and exclaim["turns"]["turn_wait_max_s"] is None
    assert "| short | 2 | 3 | 30 (75%) |" in (tmp_path / "tenants-report.md").read_text()
    assert "| 0.160 / 0.120 |" in (tmp_path / "tenants-report.md").read_text()
    assert report["acceptance"] == {"targets_reached": False, "cross_delta_max_le_0_1": False,
                                    "no_wrong_adapter_answers": False,  # training answers said no tenant
                                    "audit_no_other_tenant_answers": None}  # no audit ran
    on_disk = json.loads((tmp_path / "tenants-report.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    assert (tmp_path / "tenants.png").read_bytes()[:4] == b"\x89PNG"


def test_the_loops_a_checks_hold_delayed_are_counted_apart_from_the_others():
    """A check pauses a tenant's users and holds its lineage: feedback sent before the hold
    trains only after it, so its loop is the pause's length. The report gives the loops
    outside every hold apart (the loop the product has), and counts the held ones."""
    from apps.tenant_demo import _held, across_a_hold, hold_spans, loop_report

    run = TenantRun("short", None, None, None)
    run.checks = [{"paused_at": 100.0, "at": 160.0}]  # a check that sent its users back to rating
    run.paused_at = 300.0  # and one still open when training ended (400)
    holds = hold_spans(run, 400.0)
    assert holds == [(100.0, 160.0), (300.0, 400.0)]

    def loop(sent: float, first: float) -> dict:
        return {"sent": sent, "first_token": first, "loop_ms": (first - sent) * 1e3}

    before, across, after, into_the_open_one, ends_as_it_begins = (
        loop(50, 60), loop(90, 170), loop(170, 174), loop(290, 310), loop(95, 100))
    loops = [before, across, after, into_the_open_one, ends_as_it_begins]
    assert [across_a_hold(e, holds) for e in loops] == [False, True, False, True, False]
    report = loop_report(loops, holds)
    assert report["n"] == 5 and report["held"] == 2  # every loop is still in p50 / p95 ...
    assert report["p95"] >= 20_000
    assert report["unheld"]["n"] == 3  # ... and the others (10, 4, 5 s) apart
    assert report["unheld"]["p50"] == pytest.approx(5_000) and report["unheld"]["p95"] < 10_001
    assert _held(report) == "; 2 held, the other 3: 5000 / " + f"{report['unheld']['p95']:.0f}"
    assert _held(loop_report([before], holds)) == ""  # nothing held: nothing said
    assert loop_report([before], [])["held"] == 0


def test_a_window_meets_its_target_only_beyond_its_sampling_noise():
    from apps.tenant_demo import met_target

    pref, hit, miss = PREFERENCES["exclaim"](), "Wow! Yes.", "Yes."

    def window(hits: int, size: int = 40) -> list[Record]:
        return [Record(ts=0.0, user=0, phase="training", prompt=0, answer=hit if i < hits else miss)
                for i in range(size)]

    # a target of 0.25 over 40 answers: one standard error is 0.068, so 11 hits (0.275) are noise
    assert not met_target(window(11), pref, 0.25, 40) and not met_target(window(12), pref, 0.25, 40)
    assert met_target(window(13), pref, 0.25, 40)  # 0.325
    assert not met_target(window(30, size=39), pref, 0.25, 40)  # not a full window yet


def test_a_block_past_the_target_pauses_a_tenant_and_a_check_of_fresh_answers_confirms_or_resumes(tmp_path):
    """`advance`: a tenant's answers of training are read in blocks of `window`, each once; a
    block beyond the target by its noise pauses the tenant's rating (a sliding window that met
    it in between does not); the version it then serves is judged on answers to requests sent
    after the pause only, the newest version's only; below the target by its noise the users
    rate again and the blocks count from then."""
    from measure.users import SimConfig
    from apps.tenant_demo import advance

    hit, miss = "Wow! Yes.", "Yes."

    class Sim:  # what `advance` reads and sets of a Simulation
        def __init__(self):
            self.records: list[Record] = []
            self.cfg = SimConfig(feedback=True, phase="training")

    run = TenantRun("exclaim", Exclaim(), Sim(), LoopTracker("nats://unused", tmp_path, "exclaim"))
    run.target, run.rating_since = 0.3, 100.0

    def answer(ts: float, text: str, v: int, last: int | None = None, phase: str = "training") -> None:
        last = v if last is None else last
        run.sim.records.append(Record(ts=ts, user=0, phase=phase, prompt=0, answer=text, version=v,
                                      last_version=last))
        run.tracker.published_at.setdefault(max(v, last), ts)

    def step(now: float) -> str | None:
        return advance(run, now, window=4, check_answers=5, margin_se=1.0)

    answer(90.0, hit, 0, phase="idle")  # not training: no block counts it
    for i, text in enumerate([miss, hit, miss, hit]):
        answer(101.0 + i, text, 1)
    assert step(105.0) is None  # block 1: 0.5, not past 0.3 by its noise (0.23 for 4)
    for i, text in enumerate([hit, hit, miss]):
        answer(105.1 + i / 10, text, 1)
    # the last 4 (hit, hit, hit, miss) would meet the bar; block 2 is not complete yet
    assert step(105.5) is None and run.paused_at is None
    answer(105.6, hit, 2)
    assert step(107.0) == "paused"  # block 2: 3 of 4
    assert run.paused_at == 107.0 and run.sim.cfg.feedback is False and run.learned_until is None
    # sent before the pause, begun on an older version, or from a version since replaced: no evidence
    answer(106.5, hit, 2)
    answer(108.0, hit, 2, last=3)
    for i in range(5):
        answer(109.0 + i, hit, 2)
    answer(114.0, miss, 3)  # feedback sent before the pause trained v3: it is what is checked now
    assert step(115.0) is None and not run.checks
    answer(116.0, hit, 3)
    answer(117.0, miss, 3)
    assert step(118.0) is None  # 1 hit, 2 to come
    answer(118.5, miss, 3)
    answer(119.0, miss, 3)
    assert step(120.0) == "resumed"  # 1 of 5 < 0.3 + 0.2
    assert run.checks == [{"at": 120.0, "paused_at": 107.0, "version": 3, "answers": 5, "share": 0.2,
                           "accepted": False}]
    assert (run.paused_at, run.rating_since, run.sim.cfg.feedback) == (None, 120.0, True)
    # the blocks count from the resumption: the answers before it do not pause the tenant again
    assert step(121.0) is None
    for i in range(4):
        answer(121.0 + i, hit if i else miss, 4)
    assert step(125.0) == "paused"
    answer(126.0, hit, 4)
    answer(127.0, hit, 4)
    assert step(128.0) is None  # 2 hits; 3 of 5 are needed
    answer(128.5, hit, 4)
    # decided once the rest cannot change the verdict: 3 of 5 (0.6 >= 0.3 + 0.205) whatever follows
    assert step(129.0) == "accepted"
    assert (run.reached_at, run.learned_until, run.sim.cfg.feedback) == (129.0, 129.0, False)
    assert [(c["accepted"], c["answers"], c["share"]) for c in run.checks] == [(False, 5, 0.2), (True, 3, 1.0)]
    answer(132.0, miss, 4)
    assert step(133.0) is None  # done: it stays silent


def test_a_check_needs_its_target_plus_its_margin(tmp_path):
    """A check's bar is the target plus `margin_se` standard errors of `check_answers` (the
    demo's `CHECK_MARGIN_SE`): 0.3 + 1.5 x 0.065 of 50 answers is 0.397, so 19 hits are refused
    and 20 accepted; at one standard error (0.365) 19 would be enough."""
    from measure.users import SimConfig
    from apps.tenant_demo import CHECK_MARGIN_SE, advance

    class Sim:
        def __init__(self):
            self.records: list[Record] = []
            self.cfg = SimConfig(feedback=False, phase="training")

    def verdict(hits: int, margin_se: float = CHECK_MARGIN_SE) -> str | None:
        run = TenantRun("exclaim", Exclaim(), Sim(), LoopTracker("nats://unused", tmp_path, "exclaim"))
        run.target, run.rating_since, run.paused_at = 0.3, 0.0, 10.0
        run.tracker.published_at[1] = 1.0
        for i in range(50):
            run.sim.records.append(Record(ts=11.0 + i, user=0, phase="training", prompt=0,
                                          answer="Wow! Yes." if i < hits else "Yes.",
                                          version=1, last_version=1))
        return advance(run, 100.0, window=4, check_answers=50, margin_se=margin_se)

    assert CHECK_MARGIN_SE == 1.5
    assert verdict(19) == "resumed" and verdict(20) == "accepted"
    assert verdict(19, margin_se=1.0) == "accepted" and verdict(18, margin_se=1.0) == "resumed"


def test_an_unconfirmed_tenant_goes_back_to_the_checked_version_that_met_its_target_best(tmp_path):
    """`rollback_choice`: training ended and no check confirmed the tenant's target: the check
    whose share met the target best (refused for the margin only), unless the tenant serves
    that version already; none when no check met the target, or one was accepted."""
    from apps.tenant_demo import rollback_choice

    run = TenantRun("short", PREFERENCES["short"](), sim=None,
                    tracker=LoopTracker("nats://unused", tmp_path, "short"))

    class Sim:
        records: list[Record] = []

    run.sim, run.target = Sim(), 0.35
    run.tracker.published_at.update({v: float(v) for v in range(1, 216)})

    def check(version: int, share: float, accepted: bool = False) -> dict:
        return {"at": 0.0, "paused_at": 0.0, "version": version, "answers": 37, "share": share,
                "accepted": accepted}

    assert rollback_choice(run) is None  # no check at all
    run.checks = [check(12, 0.20), check(30, 0.34)]
    assert rollback_choice(run) is None  # none at the target
    run.checks += [check(27, 0.41), check(204, 0.41), check(90, 0.38)]
    assert rollback_choice(run)["version"] == 204  # the best share; of equals, the later
    run.tracker.published_at = {v: float(v) for v in range(1, 205)}
    assert rollback_choice(run) is None  # it serves v204 already
    run.tracker.published_at[215] = 215.0
    run.reached_at = 1.0
    assert rollback_choice(run) is None  # confirmed: nothing to go back to


def test_a_block_is_read_once(tmp_path):
    """A block below the bar stays below it: read again, later, it does not pause the tenant,
    and neither do the answers of a block not yet complete."""
    from measure.users import SimConfig
    from apps.tenant_demo import advance

    class Sim:
        def __init__(self):
            self.records: list[Record] = []
            self.cfg = SimConfig(feedback=True, phase="training")

    run = TenantRun("exclaim", Exclaim(), Sim(), LoopTracker("nats://unused", tmp_path, "exclaim"))
    run.target, run.rating_since = 0.3, 0.0
    for i, text in enumerate(["Yes.", "Wow! Yes.", "Wow! Yes.", "Yes."]):  # 0.5: below 0.53
        run.sim.records.append(Record(ts=1.0 + i, user=0, phase="training", prompt=0, answer=text,
                                      version=1, last_version=1))
    assert advance(run, 5.0, window=4, check_answers=5) is None and run.blocks_read == 1
    run.target = 0.1  # were it read again, it would now meet the bar (0.1 + 0.15)
    assert advance(run, 6.0, window=4, check_answers=5) is None and run.paused_at is None


def test_a_run_stopped_before_any_answer_still_writes_its_report(tmp_path):
    from apps.tenant_demo import TenantsState, preferences, write_tenants_report

    state = TenantsState("early", tmp_path, preferences(), window=40, interrupted=True)
    report = write_tenants_report(state)
    assert report["tenants"] == [] and report["interrupted"]
    assert "(interrupted)" in (tmp_path / "tenants-report.md").read_text()


def test_the_clean_up_waits_for_what_ends_and_goes_on_past_what_does_not(capsys):
    """A stop must reach the mesh's stop and the report whatever one close does."""
    from apps.tenant_demo import _within

    done = []

    async def ends():
        await asyncio.sleep(0.01)
        done.append(1)

    async def hangs():
        await asyncio.Event().wait()

    async def main():
        await _within(5.0, "quick", ends(), ends())
        assert done == [1, 1] and "did not finish" not in capsys.readouterr().out
        t0 = time.monotonic()
        stuck = asyncio.ensure_future(hangs())
        await _within(0.2, "the trackers", stuck, ends())
        assert time.monotonic() - t0 < 2.0 and done == [1, 1, 1]
        await asyncio.sleep(0)
        assert stuck.cancelled()  # not left running behind the run

    asyncio.run(main())
    assert "the trackers: 1 did not finish within 0.2 s; going on" in capsys.readouterr().out


def test_the_report_carries_the_audit_s_verdict_and_keeps_its_rows_apart(tmp_path):
    from apps.tenant_demo import TenantsState, preferences, write_tenants_report

    rows = [{"response_id": "r1", "tokens": 9, "best": "a", "own_minus_other": 6.0, "other": "b",
             "own_minus_base": 0.5, "wrong": False},
            {"response_id": "r2", "tokens": 7, "best": "b", "own_minus_other": -4.0, "other": "b",
             "own_minus_base": -0.3, "wrong": True}]
    audit = {"model": "m", "margin_nats": 3.0, "per_tenant": 2, "sampled": 2, "other_tenant_answers": 1,
             "tenants": {"a": {"version": 3, "sha256": "x", "answers": 5, "sampled": 2,
                               "best": {"own": 1, "base": 0, "other": 1}, "other_tenant_answers": ["r2"],
                               "own_minus_other_nats": {"min": -4.0, "p50": 1.0},
                               "own_minus_base_per_token": 0.0125, "rows": rows}}}
    state = TenantsState("r", tmp_path, preferences(), window=40, exports={"a": 3, "b": "HTTP 404"},
                         audit=audit)
    report = write_tenants_report(state)
    assert report["acceptance"]["audit_no_other_tenant_answers"] is False
    assert report["exports"] == {"a": 3, "b": "HTTP 404"}
    assert "rows" not in report["audit"]["tenants"]["a"] and audit["tenants"]["a"]["rows"] == rows
    md = (tmp_path / "tenants-report.md").read_text()
    assert "| a | v3 | 2 of 5 | 1 / 0 / 1 | -4.0 / 1.0 | +0.013 | 1 |" in md
    assert "more than 3 nats: 1 of 2." in md

    state.audit = {"error": "OSError: no space left"}
    report = write_tenants_report(state)
    assert report["audit"] == state.audit and report["acceptance"]["audit_no_other_tenant_answers"] is None
    assert "The audit did not run: OSError: no space left" in (tmp_path / "tenants-report.md").read_text()


# ---- a real run --------------------------------------------------------------------------------


def _config(tmp_path, tiny_model) -> Path:
    cfg = tmp_path / "tenants.toml"
    cfg.write_text(f"""
run_dir = "{tmp_path / 'unused'}"
[model]
name = "{tiny_model}"
max_model_len = 512
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


def _trained(log: str) -> dict[str, int]:
    """Each tenant's announced version, from the demo's last status line."""
    lines = [line for line in log.splitlines() if "(trained v" in line]
    return {m[0]: int(m[1]) for m in re.findall(r"(\w+) v\d+ \(trained v(\d+)\)", lines[-1])} if lines else {}


@pytest.mark.slow
def test_demo_tenants_trains_each_lane_on_its_own_feedback_and_stops_on_sigterm(tiny_model, tmp_path):
    """One shared trainer (the default) with a lane per tenant: once every tenant has a trained
    version the demo gets SIGTERM (the stop path `launch.stack.Stack.stop` is demo-online's
    too), exits 130, still writes its whole report, and leaves nothing running."""
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "apps.cli", "demo-tenants", "--config", str(_config(tmp_path, tiny_model)),
           "--idle-s", "2", "--idle-answers", "6", "--train-s", "600", "--users", "1", "--max-tokens", "16", "--window", "8",
           "--progress", "1", "--out-dir", str(out), "--run-id", "t", "--quiet"]
    log_path = tmp_path / "demo.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 400
        while not (len(trained := _trained(log_path.read_text())) == len(TENANTS)
                   and min(trained.values()) >= 1):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        stopped_in = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log_path.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert stopped_in < 60
    assert "idle phase:" in text and "report:" in text
    run = out / "t"
    report = json.loads((run / "tenants-report.json").read_text())
    assert report["interrupted"] is True and not report["failed"]  # and it reports what it saw
    assert report["trainers"] == "shared" and report["settings"]["kl_beta"] == 0.1
    assert f"online.batch_size={BATCH_SIZE}" in report["settings"]["learning"]  # what it learned with
    assert set(report) == {"run_id", "interrupted", "failed", "trainers", "tenants", "wrong_adapter_answers",
                           "gateway_wrong_tenant", "acceptance", "training_s", "settings", "exports", "audit"}
    assert (report["exports"], report["audit"]) == ({}, None)  # interrupted: neither export nor audit
    assert [t["name"] for t in report["tenants"]] == list(TENANTS)
    assert report["wrong_adapter_answers"] == 0 and report["gateway_wrong_tenant"] == 0
    assert set(report["acceptance"]) == {"targets_reached", "cross_delta_max_le_0_1", "no_wrong_adapter_answers",
                                         "audit_no_other_tenant_answers"}
    assert report["acceptance"]["no_wrong_adapter_answers"] is True
    seqs: dict[str, set[int]] = {}
    for t in report["tenants"]:
        assert set(t["share"]) >= {"base", "final", "target", "reached"} and t["share"]["target"] > 0
        assert set(t["cross"]) == set(TENANTS) - {t["name"]} and "cross_delta_max" in t
        assert 0 <= t["length"]["base"]["cut_off"] <= 1 and t["length"]["base"]["words_p50"] is not None
        assert {"p50", "p95"} <= set(t["loop_ms"])
        assert t["wrong_adapter_answers"] == 0 and t["answers"]["training"] >= 1
        assert t["versions"]["trained"] >= 1
        fb = t["feedback"]
        assert fb["sent"] >= 1 and fb["trained"] >= 1
        # what its lane trained was this tenant's feedback, on this tenant's answers, only
        assert set(fb["trained_tenants"]) == {t["name"]} and fb["trained_not_own"] == 0
        assert "other_tenant" not in fb["dropped_by_reason"]
        assert t["turns"]["updates"] >= 1 and t["turns"]["tokens"] >= 1 and t["turns"]["tokens_share"] > 0
        assert t["turns"]["kl_last"] is not None and t["turns"]["kl_coef_last"] > 0
        # its lane's files, where the shared trainer keeps them
        records = [json.loads(line) for line in
                   (run / "trainer" / "tenants" / t["name"] / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in records if "step" in r]  # one kind a line: step, published, ...
        assert len(steps) >= t["turns"]["updates"]
        seqs[t["name"]] = {q for step in steps for q in step["seqs"]}
        # the demo's KL to the base model: every step computed the reference logprobs, in the
        # trainer itself (no reference service was started)
        assert all(step["stage_seconds"]["reference"] > 0 for step in steps)
        # each lineage's own KL coefficient, steered from kl_beta toward the demo's target
        assert steps[0]["kl_coef"] == pytest.approx(0.1) and all(s["kl_coef"] > 0 for s in steps)
    for a, b in itertools.combinations(TENANTS, 2):
        assert not (seqs[a] & seqs[b]), (a, b)  # no feedback trained in two lanes
    assert not (run / "trainer" / "metrics.jsonl").exists()  # no default lane
    assert sorted(p.name for p in (run / "mesh" / "logs").iterdir()) == [  # no reference service
        "gateway.log", "nats.log", "rollout.log", "trainer.log"]
    for name in TENANTS:  # every answer said which lineage served it: the key's own
        records = [json.loads(line) for line in (run / f"requests-{name}.jsonl").read_text().splitlines()]
        assert records and all(r["tenant"] == name for r in records if not r["error"])
        assert all(r["feedback"] == "" for r in records if r["phase"] != "training")
    # what the GPU check's tenant stage reads of it (benchmarks/gpu_check.py)
    figures = gpu_check.tenants_figures(run / "tenants-report.json")
    assert figures["wrong_adapter_answers"] == 0 and figures["no_wrong_adapter_answers"] is True
    for t in report["tenants"]:
        assert figures[t["name"]]["target"] == t["share"]["target"]
        assert figures[t["name"]]["cross_delta_max"] == t["cross_delta_max"]
    assert (run / "tenants.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "tenants-report.md").read_text().startswith("# hotloop many-tenant run `t` (interrupted)")
    assert _left_behind(str(out)) == []


def test_training_overrides_are_what_the_trainer_loads():
    """The demo's learning reaches the trainer as written: every key a field of its section
    (the config is strict, so a misspelt one would stop the mesh at start), every value in
    range, on top of the demo's config file."""
    from hotloop.config import load
    from services.trainer.config import OnlineConfig, TrainerConfig

    config = REPO / "configs" / "online.toml"
    overrides = training_overrides(kl_beta=0.1, lr=2e-3, max_tokens=96)
    _, online = load("online", OnlineConfig, config, overrides)
    _, trainer = load("trainer", TrainerConfig, config, overrides)
    assert (online.batch_size, online.max_wait_s, online.kl_horizon) == (BATCH_SIZE, MAX_WAIT_S, KL_HORIZON)
    assert online.leave_one_out and online.negative_weight == NEGATIVE_WEIGHT
    assert online.reference == "colocated" and online.kl_target == 0.1
    assert online.batch_window_s == 0.0  # an update takes what has arrived, it does not wait
    assert online.serve_average == SERVE_AVERAGE > 0  # users get the lineage's running average
    assert (trainer.loss.kl_beta, trainer.optimizer.lr) == (0.1, 2e-3)
    assert (trainer.loss.aggregation, trainer.loss.norm_tokens) == ("constant", 96)
    # the exact KL, and what it needs: the colocated reference, LoRA on the top layers
    assert trainer.loss.kl_estimator == "full" and trainer.lora.top_layers is not None
    _, no_kl = load("trainer", TrainerConfig, config, training_overrides(kl_beta=0.0, lr=1e-3, max_tokens=96))
    assert no_kl.loss.kl_beta == 0.0
