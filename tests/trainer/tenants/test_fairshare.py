"""FairShare, driven by explicit calls (no clock): who is granted, and the token shares."""

from __future__ import annotations

import pytest

from services.trainer.tenants.fairshare import FairShare


def run_one(fs: FairShare, tokens: dict[str, int], again: set[str]) -> str:
    """Grant one update, charge it, and make its tenant ready again if it is in `again`."""
    t = fs.grant()
    assert t is not None
    fs.done(t, tokens[t])
    if t in again:
        fs.ready(t)
    return t


def test_a_quiet_tenant_is_granted_within_one_update_of_a_bursty_one():
    fs = FairShare()
    fs.add("bursty")
    fs.add("quiet")
    queued = {"bursty": 100, "quiet": 0}
    fs.ready("bursty")
    order = []
    for i in range(200):
        if i == 37:  # the quiet tenant's one feedback arrives mid-burst
            queued["quiet"] = 1
            fs.ready("quiet")
        t = fs.grant()
        if t is None:
            break
        order.append(t)
        fs.done(t, 500 if t == "bursty" else 20)
        queued[t] -= 1
        if queued[t]:
            fs.ready(t)
    assert order.count("bursty") == 100 and order.count("quiet") == 1
    # ready at the 38th grant: granted at most one bursty update later
    assert order.index("quiet") <= 38


def test_two_always_backlogged_tenants_train_equal_tokens_within_one_update():
    fs = FairShare()
    sizes = {"a": 512, "b": 37}  # very different update sizes
    for t in sizes:
        fs.add(t)
        fs.ready(t)
    trained = {"a": 0, "b": 0}
    for _ in range(2000):
        t = run_one(fs, sizes, set(sizes))
        trained[t] += sizes[t]
        assert abs(trained["a"] - trained["b"]) <= max(sizes.values())
    assert min(trained.values()) > 10_000


def test_weights_share_tokens_in_proportion():
    fs = FairShare()
    fs.add("gold", weight=3.0)
    fs.add("basic")
    sizes = {"gold": 100, "basic": 100}
    for t in sizes:
        fs.ready(t)
    trained = {"gold": 0, "basic": 0}
    for _ in range(400):
        t = run_one(fs, sizes, set(sizes))
        trained[t] += sizes[t]
    assert trained["gold"] == pytest.approx(3 * trained["basic"], abs=3 * 100)


def test_a_tenant_back_from_idle_does_not_monopolise():
    fs = FairShare()
    sizes = {"a": 100, "b": 100}
    for t in sizes:
        fs.add(t)
    fs.ready("a")
    for _ in range(50):  # b idle meanwhile: a trains alone
        run_one(fs, sizes, {"a"})
    fs.ready("b")  # b comes back with a burst
    order = [run_one(fs, sizes, {"a", "b"}) for _ in range(20)]
    # no catch-up run of b's for the 50 updates it did not ask for: they alternate
    assert all(order[i] != order[i + 1] for i in range(len(order) - 1)), order
    assert order.count("b") == 10


def test_idle_everyone_then_both_return_on_an_equal_footing():
    """Nobody backlogged: a returning tenant starts where service stood, not at its old time."""
    fs = FairShare()
    sizes = {"a": 100, "b": 100}
    for t in sizes:
        fs.add(t)
    fs.ready("a")
    for i in range(30):
        run_one(fs, sizes, {"a"} if i < 29 else set())
    assert fs.grant() is None  # all idle
    fs.ready("b")
    fs.ready("a")
    order = [run_one(fs, sizes, {"a", "b"}) for _ in range(10)]
    assert order.count("b") == 5, order


def test_a_late_tenant_joins_at_the_current_virtual_time():
    fs = FairShare()
    fs.add("a")
    fs.ready("a")
    for _ in range(10):
        run_one(fs, {"a": 100}, {"a"})
    fs.add("late")
    fs.ready("late")
    order = [run_one(fs, {"a": 100, "late": 100}, {"a", "late"}) for _ in range(6)]
    assert order.count("late") == 3, order


def test_one_grant_at_a_time_and_withdrawal():
    fs = FairShare()
    fs.add("a")
    fs.add("b")
    fs.ready("a")
    fs.ready("b")
    assert fs.grant() == "a"  # equal times: the one that waited longest
    assert fs.grant() is None  # a runs
    fs.withdraw("b")
    fs.done("a", 10)
    assert fs.grant() is None and fs.waiting() == []
    with pytest.raises(ValueError, match="not granted"):
        fs.done("b", 1)
    with pytest.raises(KeyError):
        fs.ready("nobody")
    with pytest.raises(ValueError, match="already"):
        fs.add("a")
    fs.remove("a")
    assert "a" not in fs.vtime
