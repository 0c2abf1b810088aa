"""`hotloop.leases`: one trainer per lineage, on a real NATS server. Short leases (a 2 s TTL,
renewed every 0.3 s) keep the waits short; the rules are the production ones."""

from __future__ import annotations

import asyncio

import pytest

from hotloop import bus as hbus
from hotloop.leases import Holder, LineageLease, LineageTaken, lease_key, leases_kv

TTL, RENEW, POLL = 3.0, 0.3, 0.1


def holder(run_dir: str, host: str = "h1", pid: int = 1) -> Holder:
    return Holder(host, run_dir, pid, 0.0)


async def claim(b, tenant: str, who: Holder) -> LineageLease:
    return await LineageLease.claim(b, tenant, who, ttl_s=TTL, renew_s=RENEW, poll_s=POLL)


async def test_a_second_trainer_is_refused_a_lineage_a_live_one_holds(nats_server):
    b = await hbus.Bus.connect(nats_server.url, "test")
    try:
        first = await claim(b, "acme", holder("/runs/a"))
        other = await claim(b, "globex", holder("/runs/b"))  # another lineage: free
        with pytest.raises(LineageTaken, match=r"lineage 'acme' is learned by another trainer "
                                               r"\(pid 1 on h1, run directory /runs/a\)"):
            await claim(b, "acme", holder("/runs/b", pid=2))
        first.check()  # the refused claim took nothing from the holder
        await asyncio.sleep(TTL + RENEW)  # renewed all along: still held
        with pytest.raises(LineageTaken):
            await claim(b, "acme", holder("/runs/b", host="h2"))
        # given up: the next trainer gets it at once
        await first.release()
        taken = await asyncio.wait_for(claim(b, "acme", holder("/runs/b", pid=2)), timeout=5.0)
        await taken.release()
        await other.release()
    finally:
        await b.close()


async def test_a_restarted_run_takes_its_lease_over_and_a_dead_holders_lease_expires(nats_server):
    b = await hbus.Bus.connect(nats_server.url, "test")
    try:
        kv = await leases_kv(b, TTL)
        dead = await claim(b, "", holder("/runs/a"))  # the default lineage
        dead._task.cancel()  # killed: it renews no more and releases nothing
        # the same run restarted (another pid): its own lease, taken over without a wait
        again = await asyncio.wait_for(claim(b, "", holder("/runs/a", pid=7)), timeout=5.0)
        assert Holder.decode((await kv.get(lease_key(""))).value).pid == 7
        again._task.cancel()
        # another trainer waits while the dead holder's lease may still expire, then holds it
        t = asyncio.get_running_loop().time()
        taken = await claim(b, "", holder("/runs/b"))
        assert asyncio.get_running_loop().time() - t <= 2 * TTL + 1.0
        assert Holder.decode((await kv.get(lease_key(""))).value).run_dir == "/runs/b"
        await taken.release()
    finally:
        await b.close()


async def test_a_holder_whose_lease_was_taken_while_it_stalled_fails_its_check(nats_server):
    """A holder that stopped renewing past the TTL (a stall) and finds the lineage another's
    marks its lease lost: its next publish is refused (`check`)."""
    b = await hbus.Bus.connect(nats_server.url, "test")
    try:
        # it renews only after twice the TTL: the other's claim lands well before that
        stalled = await LineageLease.claim(b, "acme", holder("/runs/a"), ttl_s=TTL, renew_s=2 * TTL + 2.0,
                                           poll_s=POLL)
        other = await claim(b, "acme", holder("/runs/b"))  # waited for the lapse, then took it
        for _ in range(200):  # until the stalled one's renewal comes around
            if stalled.lost:
                break
            await asyncio.sleep(0.1)
        with pytest.raises(LineageTaken, match="held it until its lease lapsed"):
            stalled.check()
        await stalled.release()  # gives up nothing that is not its own
        other.check()
        kv = await leases_kv(b)
        assert Holder.decode((await kv.get(lease_key("acme"))).value).run_dir == "/runs/b"
        await other.release()
    finally:
        await b.close()


def test_lease_keys_and_holders_read_back():
    assert (lease_key(""), lease_key("acme")) == ("default", "tenant.acme")
    h = Holder.here("/runs/x")
    assert Holder.decode(h.encode()) == h and h.owner.endswith(":/runs/x")
    assert Holder.decode(b"not json") is None and Holder.decode(b'{"host": "h"}') is None
    with pytest.raises(ValueError):
        lease_key("bad name!")
