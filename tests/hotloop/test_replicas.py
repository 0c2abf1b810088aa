"""Work spread over replicas (hotloop/replicas.py) through real gRPC servers on port 0.

The servers are scripted fakes of the other side (reward, reference, rollout): each answers
from its own name, counts what it answered, and can be made to stop answering after k items
(`hold_after`), so a test stops it mid-call at a known point instead of racing it. Every test
checks the invariant: each item answered exactly once, in input order where the call promises
it, and the dead replica's unanswered work done by another.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter

import grpc
import pytest

from hotloop.clients import RewardClient, ScoreItem
from hotloop.errors import Unavailable
from hotloop.proto.v1 import reference_pb2, reference_pb2_grpc, reward_pb2, reward_pb2_grpc
from hotloop.proto.v1 import rollout_pb2, rollout_pb2_grpc
from hotloop.replicas import References, Replicas, Rewards, Rollouts, split
from tests.clock import Clock


class Held:
    """Stop answering after `hold_after` answers (None: never), and say so."""

    def __init__(self, name: str, hold_after: int | None = None):
        self.name, self.hold_after = name, hold_after
        self.answered = 0
        self.calls = 0
        self.held = asyncio.Event()
        self.refuse: tuple[grpc.StatusCode, str] | None = None

    async def before_answer(self) -> None:
        if self.hold_after is not None and self.answered >= self.hold_after:
            self.held.set()
            await asyncio.Event().wait()  # until the server is stopped
        self.answered += 1


class FakeReward(reward_pb2_grpc.RewardServicer, Held):
    async def Score(self, request_iterator, context):
        self.calls += 1
        if self.refuse:
            async for _ in request_iterator:  # a status sent mid-upload can turn into INTERNAL
                pass
            await context.abort(*self.refuse)
        async for r in request_iterator:
            await self.before_answer()
            yield reward_pb2.ScoreResult(id=r.id, reward=float(len(r.completion)), status=self.name)


class FakeReference(reference_pb2_grpc.ReferenceServicer, Held):
    async def Logprobs(self, request_iterator, context):
        self.calls += 1
        async for r in request_iterator:
            await self.before_answer()
            # logprobs that name the request: its completion ids, negated
            yield reference_pb2.LogprobsResult(id=r.id, logprobs=[-float(t) for t in r.completion_ids])


class FakeRollout(rollout_pb2_grpc.RolloutServicer, Held):
    def __init__(self, name: str, version: int, hold_after: int | None = None):
        Held.__init__(self, name, hold_after)
        self.version = version
        self.seeds: list[int | None] = []

    async def Generate(self, request, context):
        self.calls += 1
        self.seeds.append(request.sampling.seed if request.sampling.HasField("seed") else None)
        for p, prompt in enumerate(request.prompts):
            for s in range(request.sampling.n or 1):
                await self.before_answer()
                yield rollout_pb2.Completion(
                    prompt_index=p, sample_index=s, text=f"{prompt.chat.messages[0].content}|{self.name}",
                    token_ids=[p, s], logprobs=[-0.5, -0.5], finish_reason="stop",
                    policy_version=self.version, final=True)


async def serve(servicer, add) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def pair(kind, add, a_kw: dict, b_kw: dict):
    a, b = kind("A", **a_kw), kind("B", **b_kw)
    (sa, aa), (sb, ab) = await serve(a, add), await serve(b, add)
    return (a, sa, aa), (b, sb, ab)


def items(n: int) -> list[ScoreItem]:
    return [ScoreItem(id=f"s{i}", prompt="p", completion="x" * i) for i in range(n)]


def unused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# ---- plain logic ------------------------------------------------------------------------------


def test_split_gives_contiguous_near_equal_runs():
    assert split(list(range(10)), 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert split(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split([0, 1], 3) == [[0], [1]]
    assert split([], 2) == []
    # indices that are not contiguous stay in runs of their own (a rollout chunk's seed is
    # its first prompt's: a chunk must be contiguous)
    assert split([1, 2, 5, 6, 7], 2) == [[1, 2], [5, 6, 7]]
    assert split([1, 3, 5], 2) == [[1], [3], [5]]


def test_a_failed_replica_sits_out_its_cooldown_and_all_are_tried_when_all_failed():
    class M:
        def __init__(self, address):
            self.address = address

    clock = Clock()
    pool = Replicas("reward", [M("a"), M("b"), M("c")], cooldown_s=10.0, clock=clock)
    assert sorted(pool.candidates()) == [0, 1, 2]
    firsts = {pool.candidates()[0] for _ in range(3)}
    assert firsts == {0, 1, 2}  # the order turns from call to call
    pool.failed(1, Unavailable("gone"))
    clock.now += 9.9
    assert sorted(pool.candidates()) == [0, 2]
    clock.now += 0.2
    assert sorted(pool.candidates()) == [0, 1, 2]
    for i in range(3):
        pool.failed(i, Unavailable("gone"))
    assert sorted(pool.candidates()) == [0, 1, 2]  # a preference, not a ban
    assert pool.stats["b"].failed_calls == 2 and pool.stats["b"].last_error == "gone"


# ---- reward ---------------------------------------------------------------------------------


async def test_a_batch_spreads_over_the_replicas_in_input_order():
    (a, sa, aa), (b, sb, ab) = await pair(FakeReward, reward_pb2_grpc.add_RewardServicer_to_server, {}, {})
    rewards = Rewards.connect([aa, ab])
    try:
        got = await rewards.score(items(9))
        assert [s.id for s in got] == [f"s{i}" for i in range(9)]
        assert [s.reward for s in got] == [float(i) for i in range(9)]
        assert {a.answered, b.answered} == {4, 5} and a.calls == b.calls == 1
        assert Counter(s.status for s in got) == {"A": a.answered, "B": b.answered}
        assert rewards.stats[aa].answered + rewards.stats[ab].answered == 9
    finally:
        await rewards.close()
        await sa.stop(None)
        await sb.stop(None)


async def test_a_replica_killed_mid_batch_has_its_chunk_re_run_whole_on_the_other():
    (a, sa, aa), (b, sb, ab) = await pair(FakeReward, reward_pb2_grpc.add_RewardServicer_to_server,
                                          {"hold_after": 2}, {})
    rewards = Rewards.connect([aa, ab])
    try:
        call = asyncio.create_task(rewards.score(items(10)))
        await a.held.wait()  # A answered 2 of its 5 and holds the rest
        await sa.stop(None)
        got = await call
        assert [s.id for s in got] == [f"s{i}" for i in range(10)]
        assert [s.reward for s in got] == [float(i) for i in range(10)]
        # A's two answers died with its call: every result kept is B's, each item once
        assert {s.status for s in got} == {"B"}
        assert (a.answered, b.answered) == (2, 10)
        assert rewards.stats[aa].failed_calls == 1 and rewards.stats[aa].resent == 5
        assert rewards.stats[ab].answered == 10 and rewards.stats[ab].dropped == 0
        # A sits out its cooldown: the next batch is B's alone, without waiting on A
        assert [s.status for s in await rewards.score(items(4))] == ["B"] * 4
    finally:
        await rewards.close()
        await sb.stop(None)


async def test_a_replica_killed_mid_stream_has_its_unanswered_items_sent_to_the_other():
    (a, sa, aa), (b, sb, ab) = await pair(FakeReward, reward_pb2_grpc.add_RewardServicer_to_server,
                                          {"hold_after": 2}, {})
    rewards = Rewards.connect([aa, ab])

    async def each():
        for it in items(12):
            yield it

    async def kill_when_held():
        await a.held.wait()
        await sa.stop(None)

    try:
        killer = asyncio.create_task(kill_when_held())
        got = [s async for s in rewards.score_each(each())]
        await killer
        assert sorted(Counter(s.id for s in got).values()) == [1] * 12  # each once
        assert {s.id for s in got} == {f"s{i}" for i in range(12)}
        assert all(s.reward == float(int(s.id[1:])) for s in got)
        # A's two answers reached the caller before it died and were kept: no item was scored
        # twice by the replicas that answered, and none is missing
        assert Counter(s.status for s in got) == {"A": 2, "B": 10}
        assert (a.answered, b.answered) == (2, 10)
        assert rewards.stats[aa].resent == 12 // 2 - 2 and rewards.stats[aa].failed_calls == 1
        assert rewards.stats[ab].dropped == 0
    finally:
        await rewards.close()
        await sb.stop(None)


async def test_an_error_that_is_not_the_replicas_absence_fails_the_call_without_a_retry():
    (a, sa, aa), (b, sb, ab) = await pair(FakeReward, reward_pb2_grpc.add_RewardServicer_to_server, {}, {})
    a.refuse = (grpc.StatusCode.INVALID_ARGUMENT, "no such scorer")
    rewards = Rewards.connect([aa, ab])
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await rewards.score(items(6))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert a.calls == 1 and rewards.stats[aa].failed_calls == 0  # not taken for a dead replica
    finally:
        await rewards.close()
        await sa.stop(None)
        await sb.stop(None)


async def test_one_replica_is_called_directly():
    a = FakeReward("A")
    sa, aa = await serve(a, reward_pb2_grpc.add_RewardServicer_to_server)
    rewards = Rewards.connect([aa])
    try:
        assert rewards.members[0].attempts == RewardClient(aa).attempts  # the client's own retries
        got = [s async for s in rewards.score_each(_aiter(items(3)))]
        assert [s.id for s in got] == ["s0", "s1", "s2"] and a.calls == 1
    finally:
        await rewards.close()
        await sa.stop(None)


@pytest.mark.slow
async def test_every_replica_down_is_a_bounded_failure_naming_them():
    dead = [unused_address(), unused_address()]
    rewards = Rewards.connect(dead)
    try:
        with pytest.raises(Unavailable, match=f"reward at {dead[0]}, {dead[1]} is unavailable"):
            await rewards.score(items(4))
        assert all(rewards.stats[d].failed_calls >= 1 for d in dead)
    finally:
        await rewards.close()


@pytest.mark.slow
async def test_one_replica_down_fails_as_the_single_client_does():
    dead = unused_address()
    rewards = Rewards.connect([dead])
    try:
        with pytest.raises(Unavailable, match=f"^reward at {dead} is unavailable after 4 attempts"):
            await rewards.score(items(1))
    finally:
        await rewards.close()


# ---- reference --------------------------------------------------------------------------------


async def test_reference_batch_routes_around_a_dead_replica_and_keeps_order():
    ref = FakeReference("B")
    sb, ab = await serve(ref, reference_pb2_grpc.add_ReferenceServicer_to_server)
    dead = unused_address()
    references = References.connect([dead, ab])
    pairs = [([1], [10 + i, 20 + i]) for i in range(7)]
    try:
        got = await references.logprobs(pairs)
        assert got == [[-(10.0 + i), -(20.0 + i)] for i in range(7)]
        assert references.stats[dead].failed_calls == 1 and references.stats[ab].answered == 7
    finally:
        await references.close()
        await sb.stop(None)


async def test_reference_stream_killed_mid_way_answers_every_id_once():
    (a, sa, aa), (b, sb, ab) = await pair(FakeReference, reference_pb2_grpc.add_ReferenceServicer_to_server,
                                          {"hold_after": 1}, {})
    references = References.connect([aa, ab])

    async def each():
        for i in range(8):
            yield f"r{i}", [1], [i]

    async def kill_when_held():
        await a.held.wait()
        await sa.stop(None)

    try:
        killer = asyncio.create_task(kill_when_held())
        got = [r async for r in references.logprobs_each(each())]
        await killer
        assert sorted(i for i, _ in got) == sorted(f"r{i}" for i in range(8)) and len(got) == 8
        assert all(lp == [-float(i[1:])] for i, lp in got)
        assert a.answered + b.answered == 8
    finally:
        await references.close()
        await sb.stop(None)


# ---- rollout ----------------------------------------------------------------------------------


def chats(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"q{i}"}] for i in range(n)]


async def test_generation_spread_keeps_prompt_and_sample_indices_versions_and_seeds():
    (a, sa, aa), (b, sb, ab) = await pair(FakeRollout, rollout_pb2_grpc.add_RolloutServicer_to_server,
                                          {"version": 5}, {"version": 6})
    rollouts = Rollouts.connect([aa, ab])
    try:
        comps = await rollouts.generate(chats(5), n=3, seed=1000)
        assert [(c.prompt_index, c.sample_index) for c in comps] == [(p, s) for p in range(5) for s in range(3)]
        for c in comps:
            prompt, replica = c.text.split("|")
            assert prompt == f"q{c.prompt_index}"  # the index is the caller's, not the chunk's
            assert c.policy_version == {"A": 5, "B": 6}[replica]  # as the replica that sampled it
        # the engine seeds prompt i of a request with seed + i: each chunk starts at its first
        # prompt's seed, so every prompt gets the seed it would get in one request
        firsts = {rep: min(c.prompt_index for c in comps if c.text.endswith(rep)) for rep in "AB"}
        assert a.seeds == [1000 + firsts["A"]] and b.seeds == [1000 + firsts["B"]]
    finally:
        await rollouts.close()
        await sa.stop(None)
        await sb.stop(None)


async def test_generation_stream_killed_mid_prompt_re_runs_only_what_is_missing():
    # A hands out one sample of its first prompt and dies: that prompt is sampled again on B,
    # whose sample 0 of it is dropped (the caller has one already)
    (a, sa, aa), (b, sb, ab) = await pair(FakeRollout, rollout_pb2_grpc.add_RolloutServicer_to_server,
                                          {"version": 2, "hold_after": 1}, {"version": 2})
    rollouts = Rollouts.connect([aa, ab])

    async def kill_when_held():
        await a.held.wait()
        await sa.stop(None)

    try:
        killer = asyncio.create_task(kill_when_held())
        got = [c async for c in rollouts.generate_each(chats(4), n=2)]
        await killer
        keys = [(c.prompt_index, c.sample_index) for c in got]
        assert sorted(keys) == [(p, s) for p in range(4) for s in range(2)]  # each exactly once
        assert all(c.text.split("|")[0] == f"q{c.prompt_index}" for c in got)
        a_first = next(c.prompt_index for c in got if c.text.endswith("|A"))
        assert [(c.prompt_index, c.sample_index) for c in got if c.text.endswith("|A")] == [(a_first, 0)]
        assert rollouts.stats[ab].dropped == 1 and rollouts.stats[aa].failed_calls == 1
        assert rollouts.stats[aa].answered + rollouts.stats[ab].answered == 8
    finally:
        await rollouts.close()
        await sb.stop(None)


async def _aiter(xs):
    for x in xs:
        yield x

