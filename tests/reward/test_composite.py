"""Length rules and composite scorers, built by `build_scorers` from a config like a service's."""

from __future__ import annotations

import pytest

from services.reward.config import LengthRule, RewardConfig, SandboxConfig
from services.reward.pool import make_pool
from services.reward.scorers import CompositeScorer, LengthScorer, build_scorers
from services.reward.types import ScoreInput, TaskSpec

from .conftest import LIMITS

ADD = TaskSpec("add", entry_point="add", test_cases=("assert add(1, 2) == 3", "assert add(2, 2) == 4"))
BOOM = "python:tests.reward.scorer_fixtures:boom"


def config(**overrides) -> RewardConfig:
    base = dict(sandbox=SandboxConfig(isolation="process", **LIMITS), concurrency=2,
                length_rules={"brief": LengthRule(max_words=12, reward_under=1.0, reward_over=0.0)})
    base.update(overrides)
    return RewardConfig.model_validate(base)


async def build(cfg: RewardConfig):
    return build_scorers(cfg, lambda: make_pool(cfg))


async def test_length_rule_counts_words_up_to_the_limit():
    rule = LengthScorer("brief", LengthRule(max_words=3, reward_under=0.7, reward_over=-0.2))
    under, at, over = await rule.score([ScoreInput("a", "", "one two"), ScoreInput("b", "", "one\ntwo  three"),
                                        ScoreInput("c", "", "one two three four")])
    assert (under.reward, at.reward, over.reward) == (0.7, 0.7, -0.2)
    assert (at.status, over.status) == ("ok", "ok") and over.error == "4 words > max_words 3"


async def test_code_tests_plus_brevity_is_the_weighted_sum_of_its_parts():
    cfg = config(scorers=["ppo", "code_tests", "brief"], default_scorer="ppo",
                 composites={"ppo": {"parts": {"code_tests": 1.0, "brief": 0.5}}})
    scorers, pool = await build(cfg)
    try:
        samples = [
            ScoreInput("right-short", "", "```python\ndef add(a, b):\n    return a + b\n```", ADD),
            ScoreInput("half-long", "", "Here is my answer, explained at some length before the code:\n"
                       "```python\ndef add(a, b):\n    return a * b\n```", ADD),
            ScoreInput("no-code", "", "I do not know.", ADD),
        ]
        outs = {o.id: o for o in await scorers["ppo"].score(samples)}
        tests = {o.id: o for o in await scorers["code_tests"].score(samples)}
        brief = {o.id: o for o in await scorers["brief"].score(samples)}
        for sid in outs:
            assert outs[sid].reward == pytest.approx(tests[sid].reward + 0.5 * brief[sid].reward)
        assert (outs["right-short"].status, outs["right-short"].passed) == ("ok", 2 + 1)
        assert tests["half-long"].reward == 0.5 and brief["half-long"].reward == 0.0
        assert "brief:" in outs["half-long"].error and "code_tests:" in outs["half-long"].error
        # No code is a verdict on the sample, not a broken scorer: it shows in the status, and
        # the brevity part still counts.
        assert (outs["no-code"].status, outs["no-code"].reward) == ("no_code", 0.5)
    finally:
        await pool.close()


async def test_a_part_in_scorer_error_fails_the_composite():
    cfg = config(scorers=["mix"], default_scorer="mix", composites={"mix": {"parts": {"brief": 1.0, BOOM: 0.5}}})
    scorers, pool = await build(cfg)
    assert pool is None and set(scorers) == {"mix"}  # parts are built for it, not requestable
    (out,) = await scorers["mix"].score([ScoreInput("s", "", "short")])
    assert (out.status, out.reward) == ("scorer_error", 0.0)
    assert out.error.startswith(f"{BOOM}: ") and "ValueError: boom on s" in out.error


async def test_parts_run_concurrently():
    a, b = "python:tests.reward.scorer_fixtures:meet_a", "python:tests.reward.scorer_fixtures:meet_b"
    cfg = config(scorers=["both"], default_scorer="both", composites={"both": {"parts": {a: 1.0, b: 2.0}}})
    scorers, _ = await build(cfg)
    (out,) = await scorers["both"].score([ScoreInput("meet-1", "", "")])
    assert (out.status, out.reward) == ("ok", 3.0), out.error


async def test_nested_composites_share_their_parts():
    cfg = config(scorers=["outer", "inner"], default_scorer="outer", composites={
        "inner": {"parts": {"brief": 2.0, "format": 1.0}},
        "outer": {"parts": {"inner": 0.5, "brief": -1.0}},
    })
    scorers, _ = await build(cfg)
    outer, inner = scorers["outer"], scorers["inner"]
    assert isinstance(outer, CompositeScorer) and outer._parts[0][1] is inner
    assert outer._parts[1][1] is inner._parts[0][1]  # one "brief" for both
    (o,) = await outer.score([ScoreInput("n", "", "```python\nx = 1\n```")])
    (i,) = await inner.score([ScoreInput("n", "", "```python\nx = 1\n```")])
    assert (i.reward, o.reward) == (3.0, 0.5 * 3.0 - 1.0)
