"""Streaming Generate through a real gRPC server on port 0 (merged mode, the CPU default).

Deltas must add up to what whole mode returns, each sample must end with exactly one final
message, a cancelled stream must abort its engine requests, and sampling options
(top_logprobs, priority) must reach the engine or be refused clearly.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio

from hotloop import grpcutil
from hotloop.clients import RolloutClient
from hotloop.proto.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from .test_rollout_service import generate, start, text_prompt

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(tiny_model, tmp_path_factory):
    # Long generations are allowed so a cancelled stream is still far from its natural end.
    core, server, port = await start(tiny_model, tmp_path_factory.mktemp("rollout-stream"),
                                     "merged", max_new_tokens=400)
    ch = grpcutil.channel(f"127.0.0.1:{port}")
    yield core, rollout_pb2_grpc.RolloutStub(ch), f"127.0.0.1:{port}"
    await ch.close()
    await server.stop(0)
    await core.stop()


def stream_request(prompts, return_prompt_ids=False, priority=0, **sampling):
    return rollout_pb2.GenerateRequest(
        prompts=prompts, sampling=common_pb2.SamplingParams(**sampling), stream=True,
        return_prompt_ids=return_prompt_ids, priority=priority,
    )


def by_sample(messages):
    out: dict[tuple[int, int], list] = {}
    for m in messages:
        out.setdefault((m.prompt_index, m.sample_index), []).append(m)
    return out


async def test_stream_deltas_concatenate_to_the_whole_completion(rollout):
    core, stub, _ = rollout
    prompts = [text_prompt("def add(a, b):"), text_prompt("class Point:")]
    whole = await generate(stub, prompts, max_tokens=24, temperature=0)
    msgs = [m async for m in stub.Generate(stream_request(prompts, return_prompt_ids=True,
                                                          max_tokens=24, temperature=0))]
    streams = by_sample(msgs)
    assert sorted(streams) == [(0, 0), (1, 0)]
    for w in whole:
        assert w.final and w.num_prompt_tokens > 0
        assert [(s.version, s.first_token) for s in w.version_spans] == [(0, 0)]
        parts = streams[(w.prompt_index, 0)]
        assert len(parts) > 1, "the stream came as one message, not as deltas"
        assert [p.final for p in parts] == [False] * (len(parts) - 1) + [True]
        assert [p.finish_reason for p in parts[:-1]] == [""] * (len(parts) - 1)
        assert parts[-1].finish_reason == w.finish_reason
        assert [t for p in parts for t in p.token_ids] == list(w.token_ids)
        assert "".join(p.text for p in parts) == w.text
        got = [lp for p in parts for lp in p.logprobs]
        assert got == pytest.approx(list(w.logprobs), abs=1e-4)
        ids = core.tokenizer.encode(["def add(a, b):", "class Point:"][w.prompt_index])
        assert list(parts[0].prompt_token_ids) == ids
        assert all(not p.prompt_token_ids for p in parts[1:])
        assert {p.num_prompt_tokens for p in parts} == {len(ids)}
        assert all([(s.version, s.first_token) for s in p.version_spans] == [(0, 0)]
                   for p in parts)


async def test_stream_of_n_samples_ends_each_with_one_final(rollout):
    _, stub, _ = rollout
    msgs = [m async for m in stub.Generate(stream_request([text_prompt("x = ")], n=3,
                                                          max_tokens=8))]
    streams = by_sample(msgs)
    assert sorted(streams) == [(0, 0), (0, 1), (0, 2)]
    for parts in streams.values():
        assert sum(p.final for p in parts) == 1 and parts[-1].final
        assert 0 < sum(len(p.token_ids) for p in parts) <= 8
        assert all(len(p.logprobs) == len(p.token_ids) for p in parts)


async def test_top_logprobs_in_whole_and_stream_mode(rollout):
    _, stub, _ = rollout
    prompt = [text_prompt("def add(a, b):")]
    (whole,) = await generate(stub, prompt, max_tokens=6, temperature=0, top_logprobs=3)
    msgs = [m async for m in stub.Generate(stream_request(prompt, max_tokens=6, temperature=0,
                                                          top_logprobs=3))]
    streamed = [t for m in msgs for t in m.top_logprobs]
    texts = [t for m in msgs for t in m.token_texts]
    assert len(whole.top_logprobs) == len(whole.token_ids) == len(streamed) == len(texts)
    assert len(whole.token_texts) == len(whole.token_ids)
    for tok, lp, top, st in zip(whole.token_ids, whole.logprobs, whole.top_logprobs, streamed):
        assert len(top.token_ids) == len(top.logprobs) == len(top.tokens) == 3
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
        # greedy: the sampled token is the most likely one, with the same logprob
        assert top.token_ids[0] == tok
        assert top.logprobs[0] == pytest.approx(lp, abs=1e-5)
        assert list(st.token_ids) == list(top.token_ids)
    # without top_logprobs, no alternatives and no per-token texts
    (plain,) = await generate(stub, prompt, max_tokens=6, temperature=0)
    assert not plain.top_logprobs and not plain.token_texts


@pytest.mark.parametrize("k", [21, 1000])
async def test_bad_top_logprobs_is_invalid_argument(rollout, k):
    _, stub, _ = rollout
    for req in (stream_request([text_prompt("hi")], top_logprobs=k),
                rollout_pb2.GenerateRequest(prompts=[text_prompt("hi")],
                                            sampling=common_pb2.SamplingParams(top_logprobs=k))):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [m async for m in stub.Generate(req)]
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_logprobs" in e.value.details()


async def test_cancelled_stream_aborts_its_engine_requests(rollout):
    core, stub, _ = rollout
    # 8 prompts x 8 samples x 400 tokens: many seconds of work if it were not aborted.
    req = stream_request([text_prompt(f"item {i}:") for i in range(8)], n=8, max_tokens=400)
    call = stub.Generate(req)
    got = 0
    async for _ in call:
        got += 1
        if got == 20:
            break
    assert core.engine.output_processor.get_num_unfinished_requests() > 0
    call.cancel()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 3.0:
        status = await stub.Status(rollout_pb2.StatusRequest())
        if (core.engine.output_processor.get_num_unfinished_requests() == 0
                and status.running_requests == 0):
            break
        await asyncio.sleep(0.05)
    assert core.engine.output_processor.get_num_unfinished_requests() == 0
    assert core.running() == 0
    (after,) = await generate(stub, [text_prompt("still serving")], max_tokens=2)
    assert after.final


async def test_priority_is_accepted_and_status_reports_the_swap(rollout):
    core, stub, _ = rollout
    assert core.cfg.scheduling_policy == "priority"
    msgs = [m async for m in stub.Generate(stream_request([text_prompt("hi")], priority=10,
                                                          max_tokens=4))]
    assert msgs[-1].final
    status = await stub.Status(rollout_pb2.StatusRequest())
    assert status.update_mode == "merged" and status.swap == "inflight"


async def test_client_stream_matches_client_generate(rollout):
    _, _, address = rollout
    client = RolloutClient(address)
    chat = [[{"role": "user", "content": "write a loop"}]]
    try:
        (whole,) = await client.generate(chat, max_tokens=16, temperature=0)
        parts = [c async for c in client.stream(chat, max_tokens=16, temperature=0,
                                                return_prompt_ids=True)]
    finally:
        await client.close()
    assert whole.version_spans == [(0, 0)] and whole.final
    assert [t for p in parts for t in p.token_ids] == whole.token_ids
    assert parts[0].prompt_token_ids == whole.prompt_token_ids
    assert parts[-1].final and parts[-1].finish_reason == whole.finish_reason
    assert all(p.version_spans == [(0, 0)] for p in parts)


@pytest.mark.parametrize("priority, expected", [(0, 1), (1, 0)])
async def test_status_counts_foreground_requests(rollout, priority, expected):
    """Users come at priority 0: Status counts those in flight (what a trainer that yields to
    users watches), not training requests at a larger priority, and forgets a cancelled one."""
    _, stub, _ = rollout
    # Greedy: the tiny model then runs all 400 tokens (seconds). Sampled, it may draw its end of
    # turn within a few tokens (58 in one run) and finish before Status looks: CI saw that once.
    call = stub.Generate(stream_request([text_prompt("count:")], priority=priority,
                                        max_tokens=400, temperature=0))
    got = 0
    async for msg in call:
        assert not msg.final
        got += 1
        if got == 3:
            break
    status = await stub.Status(rollout_pb2.StatusRequest())
    assert status.foreground_requests == expected and status.running_requests == 1
    call.cancel()
    # the two counts end apart: the running one when the engine's requests are aborted (the
    # admission), the user's when the stream has closed
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 10.0:
        status = await stub.Status(rollout_pb2.StatusRequest())
        if status.running_requests == 0 and status.foreground_requests == 0:
            break
        await asyncio.sleep(0.05)
    assert status.foreground_requests == 0 and status.running_requests == 0


async def _next_load(watch, want, timeout=5.0):
    """Read the load stream until it reports `want` (in flight, waiting); all reads seen."""
    seen = []
    async def read():
        async for load in watch:
            seen.append(tuple(load[:2]))
            if tuple(load[:2]) == want:
                return
    await asyncio.wait_for(read(), timeout)
    return seen


async def test_watch_load_follows_users_to_their_first_token(rollout):
    """WatchLoad reports users' requests in flight and those still waiting for a first token:
    what a `pause` trainer holds on. A training request (priority 1) is not a user's; a
    user's first token ends its wait; a cancelled stream ends its count."""
    _, stub, address = rollout
    client = RolloutClient(address)
    watch = client.watch_load()
    try:
        first = await anext(watch)  # at once, before any change
        assert (first.in_flight, first.waiting) == (0, 0)
        from hotloop.loadboard import LoadReader

        board = LoadReader.open(first.board_path, first.board_nonce)  # this host: readable
        assert board is not None and board.counts() == (0, 0)
        # greedy, so neither ends by itself before it is cancelled (see the test above)
        train = stub.Generate(stream_request([text_prompt("train:")], priority=1, max_tokens=400,
                                             temperature=0))
        async for _ in train:
            break
        user = stub.Generate(stream_request([text_prompt("user:")], priority=0, max_tokens=400,
                                            temperature=0))
        async for _ in user:
            break  # the user has a first token: nobody waits, one user in flight
        seen = await _next_load(watch, (1, 0))
        assert all(w <= f <= 1 for f, w in seen), seen  # never the training request
        assert board.counts() == (1, 0)  # the shared-memory board says the same
        user.cancel()
        await _next_load(watch, (0, 0))
        assert board.counts() == (0, 0)
        assert LoadReader.open(first.board_path, first.board_nonce + 1) is None  # not ours
        train.cancel()
        board.close()
    finally:
        await watch.aclose()
        await client.close()


async def test_a_pause_trainer_sees_users_wait_and_get_served(rollout):
    """`users_first = "pause"` end to end on the stream: the trainer's watcher thread (its own
    event loop and channel) is told when a user waits for a first token and when none does."""
    from services.trainer.pacing.usersfirst import UsersFirst

    _, stub, address = rollout
    users = UsersFirst("pause", rollout=address, max_pause_s=1.0)
    seen: list[bool] = []
    real = users.users_waiting
    users.users_waiting = lambda busy: (seen.append(busy), real(busy))
    users.watch()
    try:
        assert await asyncio.to_thread(users.connected.wait, 10.0)
        assert users._board is not None  # the same host: it reads the shared-memory board
        for _ in range(5):  # each request opens a wait that its first token closes
            call = stub.Generate(stream_request([text_prompt("hi")], priority=0, max_tokens=4))
            async for _ in call:
                pass
        t0 = time.perf_counter()
        while not (seen and seen[-1] is False and users._free.is_set()) and time.perf_counter() - t0 < 5:
            await asyncio.sleep(0.02)
        assert True in seen, seen  # at least one wait was seen (changes may coalesce)
        assert seen[-1] is False and users._free.is_set()  # and nobody waits now
    finally:
        await users.close()
    assert users._thread is None


async def watch_peak(gate, peak: list[int]) -> None:
    """Keep `peak[0]` the most training prompts `gate` had in the engine at once."""
    while True:
        peak[0] = max(peak[0], gate.running)
        await asyncio.sleep(0.001)


async def test_training_prompts_beside_a_user_run_at_most_the_limit_at_once(rollout):
    """`[rollout] training_prompts_beside_users`: while a user streams, a training call's
    prompts go through the engine `limit` at a time (and one prefill at a time); all of them
    finish, and once the user is gone a batch enters at once."""
    from services.rollout.core import TrainingGate

    core, stub, _ = rollout
    core.training_gate = TrainingGate(core.users, limit=1)
    try:
        user = stub.Generate(stream_request([text_prompt("count:")], max_tokens=400, temperature=0))
        async for _ in user:  # the user's stream is under way
            break
        peak = [0]
        watcher = asyncio.create_task(watch_peak(core.training_gate, peak))
        prompts = [text_prompt(f"def f{i}(x):") for i in range(4)]
        # whole mode, greedy: the same completions as without the gate
        alone = await generate(stub, prompts, max_tokens=8, temperature=0)
        req = rollout_pb2.GenerateRequest(prompts=prompts, priority=1, sampling=common_pb2.SamplingParams(
            max_tokens=8, temperature=0))
        done = [c async for c in stub.Generate(req)]
        watcher.cancel()
        assert sorted(c.prompt_index for c in done) == [0, 1, 2, 3] and all(c.final for c in done)
        assert sorted((c.prompt_index, list(c.token_ids)) for c in done) == \
            sorted((c.prompt_index, list(c.token_ids)) for c in alone)
        assert len(done) == 4  # one whole completion a prompt, not its steps
        assert peak[0] == 1, f"{peak[0]} training prompts ran at once beside a user (limit 1)"
        user.cancel()
        t0 = time.perf_counter()
        while core.users.foreground and time.perf_counter() - t0 < 10.0:
            await asyncio.sleep(0.01)
        # no user now: a batch enters whole
        gate = core.training_gate
        turns = await asyncio.wait_for(asyncio.gather(*(gate.enter() for _ in range(3))), 1)
        assert gate.running == 3
        for t in turns:
            t.leave()
    finally:
        core.training_gate = None


async def test_a_training_prompts_prefill_turn_ends_at_its_first_token_not_its_last(rollout):
    """Beside a user, the next training prompt enters once the last one is prefilled, so a
    whole-mode batch still decodes together (up to the limit), not one prompt after another."""
    from services.rollout.core import TrainingGate

    core, stub, _ = rollout
    core.training_gate = TrainingGate(core.users, limit=4)
    watcher = None
    try:
        user = stub.Generate(stream_request([text_prompt("count:")], max_tokens=400, temperature=0))
        async for _ in user:
            break
        peak = [0]
        watcher = asyncio.create_task(watch_peak(core.training_gate, peak))
        req = rollout_pb2.GenerateRequest(
            prompts=[text_prompt(f"def g{i}(x):") for i in range(3)], priority=1,
            sampling=common_pb2.SamplingParams(max_tokens=64, temperature=1.0, n=2))
        done = [c async for c in stub.Generate(req)]
        watcher.cancel()
        user.cancel()
        # every sample of every prompt, once, whole (n=2: the engine streams each sample apart)
        assert sorted((c.prompt_index, c.sample_index) for c in done) == \
            [(p, k) for p in range(3) for k in range(2)]
        assert all(c.final and c.finish_reason for c in done)
        assert peak[0] >= 2, "each training prompt waited for the last one's end, not its prefill"
    finally:
        if watcher is not None:
            watcher.cancel()
        core.training_gate = None
