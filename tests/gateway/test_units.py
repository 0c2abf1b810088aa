"""The gateway's plain parts without servers: keys, config bounds, routing, the response memory."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from hotloop.errors import Unauthenticated, Unavailable
from services.gateway.config import GatewayConfig
from services.gateway.core import ResponseIndex, _version_at
from services.gateway.keys import KeyConfigError, KeyRing, default_id, load_keys
from services.gateway.routing import Router
from services.gateway.types import Replica, ReplicaStatus


def test_keys_are_kept_as_digests_with_ids(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# users\n\nbob:sk-bob-secret-1\nsk-anonymous-secret\n")
    ring = KeyRing(load_keys(["alice:sk-alice-secret"], str(f)))
    assert ring.authenticate("Bearer sk-alice-secret") == "alice"
    assert ring.authenticate("bearer sk-bob-secret-1") == "bob"
    anon = ring.authenticate("Bearer sk-anonymous-secret")
    assert anon == default_id("sk-anonymous-secret") == "key-" + hashlib.sha256(b"sk-anonymous-secret").hexdigest()[:8]
    assert "secret" not in repr(ring.__dict__)
    for bad in (None, "", "Bearer", "Basic sk-alice-secret", "Bearer sk-alice-secreT", "sk-alice-secret"):
        with pytest.raises(Unauthenticated):
            ring.authenticate(bad)


@pytest.mark.parametrize("entries,needle", [
    ([], "no user API keys"),
    (["short"], "at least 8"),
    (["a:sk-one-key-1", "a:sk-two-key-2"], "already used"),
    (["sk-same-key-1", "x:sk-same-key-1"], "twice"),
    (["bad id:sk-some-key-1"], "key id"),
])
def test_bad_key_configs_refuse_to_start(entries, needle):
    with pytest.raises(KeyConfigError, match=needle):
        KeyRing(load_keys(entries))


def test_a_ring_of_no_config_keys_starts_with_the_admin_api_and_takes_its_tenants_keys():
    """No config key: refused to start without the admin API (no key could ever be accepted);
    with it, every key is refused until a created tenant's is put, and again once dropped."""
    with pytest.raises(KeyConfigError, match="admin_token"):
        KeyRing({})
    ring = KeyRing({}, admin=True)
    assert len(ring) == 0 and ring.ids() == set()
    with pytest.raises(Unauthenticated):
        ring.authenticate("Bearer sk-initech-0123456789")
    ring.put("initech", load_keys(["initech-1:sk-initech-0123456789"]))
    assert ring.authenticate("Bearer sk-initech-0123456789") == "initech-1"
    ring.drop("initech")
    with pytest.raises(Unauthenticated):
        ring.authenticate("Bearer sk-initech-0123456789")


def test_missing_key_file_is_an_error(tmp_path):
    with pytest.raises(KeyConfigError, match="does not exist"):
        load_keys([], str(tmp_path / "nope"))


def test_config_bounds():
    GatewayConfig()
    for bad in ({"max_n": 0}, {"request_timeout_s": 0}, {"default_max_tokens": 2048},
                {"routing": "random"}, {"traffic_queue": 0}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            GatewayConfig(**bad)


class Stub(Replica):
    def __init__(self, address, running=0, healthy=True, version=0, known_latest=0):
        self.address, self.running, self.healthy = address, running, healthy
        self.version, self.known_latest = version, known_latest

    def generate(self, req):
        raise NotImplementedError

    async def probe(self, timeout_s):
        if self.healthy == "raise":
            raise ConnectionError("refused")
        return ReplicaStatus(self.running, self.version, self.known_latest) if self.healthy else None

    async def close(self):
        pass


async def test_least_loaded_counts_own_and_reported_load():
    a, b = Stub("a", running=3), Stub("b", running=0)
    router = Router([a, b])
    await router.poll()
    first = router.pick()
    assert first.replica is b
    router.acquire(first)
    assert router.pick().replica is b  # 1 < 3
    for _ in range(3):
        router.acquire(router.states[1])
    assert router.pick().replica is a  # 4 > 3


async def test_a_slow_poll_marks_down_only_after_several_in_a_row():
    a = Stub("a")
    router = Router([a], failures=3)
    await router.poll()
    a.healthy = "raise"  # no answer in time, e.g. during a burst
    for _ in range(2):
        await router.poll()
        assert router.pick().replica is a
    await router.poll()
    with pytest.raises(Unavailable, match="refused"):
        router.pick()
    a.healthy = True
    await router.poll()
    a.healthy = False  # an explicit NOT_SERVING counts at once
    await router.poll()
    with pytest.raises(Unavailable, match="not serving"):
        router.pick()


async def test_round_robin_skips_unhealthy_and_poll_restores():
    a, b, c = Stub("a"), Stub("b", healthy=False), Stub("c", healthy="raise")
    router = Router([a, b, c], policy="round_robin")
    await router.poll()
    assert {router.pick().replica.address for _ in range(4)} == {"a"}
    b.healthy = True
    await router.poll()
    assert {router.pick().replica.address for _ in range(4)} == {"a", "b"}
    router.mark_down(a, "it failed a request")
    router.mark_down(b, "it failed a request")
    with pytest.raises(Unavailable, match="no healthy rollout replica") as e:
        router.pick()
    assert "refused" in str(e.value) and "failed a request" in str(e.value)
    await router.poll()
    assert router.pick().replica.address in ("a", "b")


async def test_a_replica_behind_the_newest_version_gets_no_user():
    a, b = Stub("a", version=3), Stub("b", version=1, running=0)
    a.running = 5  # least_loaded alone would pick b
    router = Router([a, b], max_version_lag=0)
    await router.poll()
    assert router.newest == 3 and [s.replica for s in router.servable()] == [a]
    assert {router.pick().replica.address for _ in range(4)} == {"a"}
    b.version = 2
    await router.poll()
    assert router.pick().replica is a
    b.version = 3  # caught up
    await router.poll()
    assert router.pick().replica is b

    # the newest version is remembered when the replica that served it goes away
    a.healthy = "raise"
    b.version = 1  # e.g. restarted on an older version
    for _ in range(3):
        await router.poll()
    with pytest.raises(Unavailable, match="no current rollout replica") as e:
        router.pick()
    assert "b: serves v1, 2 behind the newest v3 (max_version_lag 0)" in str(e.value)
    assert router.servable() == []


async def test_a_replica_that_knows_it_is_behind_is_skipped_on_its_own_word():
    """A lone replica that could not catch up reports the announced version it lacks."""
    lone = Stub("lone", version=0, known_latest=3)
    router = Router([lone], max_version_lag=1)
    await router.poll()
    with pytest.raises(Unavailable, match="serves v0, 3 behind the newest v3 \\(max_version_lag 1\\)"):
        router.pick()
    lone.version = 2  # one behind is within the lag
    await router.poll()
    assert router.pick().replica is lone


async def test_a_router_with_no_replica_yet_refuses_saying_so():
    """A name that resolves to nothing yet (no replica ready) leaves the router empty."""
    router = Router([])
    await router.poll()
    with pytest.raises(Unavailable, match="no rollout replica found"):
        router.pick()


async def test_update_keeps_staying_replicas_and_closes_gone_ones_once_idle():
    a, b, c = Stub("a", running=2), Stub("b"), Stub("c")
    closed: list[str] = []
    for r in (a, b, c):
        r.close = lambda r=r: _record(closed, r.address)
    router = Router([a, b])
    await router.poll()
    busy = router.pick(exclude={id(router.states[0])})
    assert busy.replica is b
    router.acquire(busy)
    router.mark_down(a, "it failed a request")

    router.update([a, c])  # b is gone with a request in flight; c is new
    assert [s.replica for s in router.states] == [a, c]
    assert router.states[0].failures == 1 and router.states[0].others == 2  # a kept its state
    with pytest.raises(Unavailable):
        router.pick()  # a is down until polled, c is not polled yet, b is gone
    await router.poll()
    assert closed == [] and router.pick().replica in (a, c)  # b still serves its request
    router.release(busy, ok=True)
    await router.poll()
    assert closed == ["b"]
    await router.close()
    assert sorted(closed) == ["a", "b", "c"]


async def _record(closed: list[str], address: str) -> None:
    closed.append(address)


async def test_discovery_expands_names_to_every_address_and_follows_them():
    """`dns:///host:port` stands for every address the name has (a scaled compose service, a
    headless Service); plain entries stay as written; a replica is kept while its address
    stays; a name that stops existing has no address, a failed lookup keeps the last ones."""
    import socket

    from services.gateway.discovery import Discovery

    records = {"rollout": ["10.0.0.1", "10.0.0.2"]}

    async def resolve(host, port):
        got = records[host]
        if isinstance(got, OSError):
            raise got
        return [f"{ip}:{port}" for ip in got]

    made: list[str] = []

    def make(address):
        made.append(address)
        return Stub(address)

    d = Discovery(["dns:///rollout:50051", "10.0.0.9:50051", "dns:///rollout:50051"], make,
                  resolve=resolve)
    first = await d.refresh()
    assert [r.address for r in first] == ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.9:50051"]
    records["rollout"] = ["10.0.0.2", "10.0.0.3"]  # scaled: one replaced
    second = await d.refresh()
    assert [r.address for r in second] == ["10.0.0.2:50051", "10.0.0.3:50051", "10.0.0.9:50051"]
    assert second[0] is first[1] and made.count("10.0.0.2:50051") == 1
    records["rollout"] = socket.gaierror(socket.EAI_AGAIN, "temporary failure")
    assert [r.address for r in await d.refresh()] == [r.address for r in second]
    records["rollout"] = socket.gaierror(socket.EAI_NONAME, "no such name")
    assert [r.address for r in await d.refresh()] == ["10.0.0.9:50051"]
    assert d.dynamic and not Discovery(["10.0.0.9:50051"], make).dynamic
    for bad in ("dns:///rollout", "dns:///:50051", "dns:///rollout:port", "dns:///rollout:0"):
        with pytest.raises(ValueError, match="dns:///<host>:<port>"):
            Discovery([bad], make)
    with pytest.raises(ValueError, match="not a host name"):
        Discovery(["dns:///roll..out:50051"], make)


async def test_the_default_resolver_asks_the_system():
    from services.gateway.discovery import resolve_all

    assert "127.0.0.1:50051" in await resolve_all("localhost", 50051)


def test_response_index_is_bounded_in_age_and_count():
    now = [0.0]
    idx = ResponseIndex(ttl_s=10, max_entries=2, clock=lambda: now[0])
    idx.add("r1", "alice", 1)
    idx.add("r2", "alice", 1)
    idx.add("r3", "alice", 1)
    assert idx.get("r1") is None and idx.get("r2") is not None
    now[0] = 11
    assert idx.get("r3") is None and len(idx) == 1


def test_version_of_a_token():
    spans = [(3, 0), (4, 5), (6, 9)]
    assert [_version_at(spans, t) for t in (0, 4, 5, 8, 9, 20)] == [3, 3, 4, 4, 6, 6]


@pytest.mark.parametrize("path", sorted((__import__("pathlib").Path(__file__).parents[2] / "configs").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_shipped_gateway_section_parses(path):
    from hotloop import config

    tree = config.raw_config(path, environ={})
    config.load_section(tree, "gateway", GatewayConfig)


def test_the_router_stops_when_a_poll_swallowed_the_cancel() -> None:
    """Python 3.11's wait_for (under the clients' calls) can return a reply that lands with the
    cancel; the poll loop must still end at its close, not poll on for ever."""
    import asyncio

    class Swallowing(Router):
        polls, swallowed = 0, False

        async def poll(self) -> None:
            self.polls += 1
            if self.polls > 3:
                inside.set()  # the close comes while this poll waits on its call
            try:
                await asyncio.sleep(0.005 if self.polls <= 3 else 10.0)
            except asyncio.CancelledError:
                if self.swallowed:  # only the first: a failing test must not hang
                    raise
                self.swallowed = True

    inside = asyncio.Event()

    async def main() -> tuple[bool, bool]:
        router = Swallowing([], interval_s=0.001)
        await router.start()
        await inside.wait()
        closing = asyncio.ensure_future(router.close())
        done, _ = await asyncio.wait({closing}, timeout=2.0)
        if not done:
            router._poller.cancel()
            await closing
        return bool(done), router.swallowed

    ended, swallowed = asyncio.run(main())
    assert swallowed and ended
