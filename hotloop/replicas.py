"""Work spread over the replicas of one service, and routed around a replica that dies.

Owns: `Replicas`, the clients of one service's replicas with which of them to use now (a
replica that failed is left out for `cooldown_s`) and what each did (`ReplicaStats`); the two
ways a call is spread; and the balanced clients built on them, with the method names of the
single-replica clients (`hotloop.clients`), so a recipe takes either: `Rollouts` (`generate`,
`generate_each`), `Rewards` (`score`, `score_each`), `References` (`logprobs`,
`logprobs_each`, `status`).

How a call is spread:
- A call over a list (`generate`, `generate_each`, `score`, `logprobs`) splits it into one
  contiguous chunk per live replica and runs the chunks at once; results come back in input
  order (`generate`: by prompt and sample, as one replica returns them). A chunk whose replica
  fails with UNAVAILABLE (after the client's own bounded retries) is re-split over the
  replicas still live. A batch call yields nothing of a failed chunk, so its chunk is re-run
  whole; `generate_each` hands out completions as they finish and re-runs only the prompts
  whose samples did not all arrive, keeping the first result for each (prompt, sample).
- A stream (`score_each`, `logprobs_each`) opens one stream per replica as items arrive and
  sends each item to the live replica with the fewest unanswered; when a stream fails, its
  unanswered items go to the others. An id given while another item of that id is unanswered
  is an error: ids are how results find their items.
Either way every item is answered exactly once: a result for an item already answered is
dropped and counted (`ReplicaStats.dropped`), never handed out. An item is tried at most
`len(replicas) + 1` times; then the call fails with `Unavailable` naming every replica. When
every replica is in its cooldown, all of them are tried again (the cooldown is a preference,
not a ban). Errors other than UNAVAILABLE (a refused request, a broken contract) fail the call
at once, as with one replica.

With a single replica the balanced clients call it directly: the behaviour, retries and
error messages are exactly those of `hotloop.clients`.

Rollout prompts keep their own seeds across chunks: the engine seeds prompt i of a request
with seed + i, so a chunk starting at prompt s is sent seed + s. Each completion keeps the
`policy_version` of the replica that produced it.

Does not own: the calls themselves (`hotloop.clients`), where the addresses come from
(`[endpoints]`, filled in by `hotloop up`), or pushing versions to the rollout replicas (the
publisher pushes to every one), nor finding a replica that hangs without failing: a rollout
whose engine hangs fails its own requests with UNAVAILABLE and stops
(services/rollout/heartbeat.py), and a replica whose process freezes fails its calls through
the channel's keepalive pings (`[grpc]`, `grpcutil.client_options`); either is re-split here
like any failed chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

import grpc

from hotloop.clients import (
    RETRY_ATTEMPTS,
    Completion,
    ReferenceClient,
    RewardClient,
    RolloutClient,
    Score,
    ScoreItem,
)
from hotloop.errors import Unavailable

# A replica tried while still dead costs that call its retries (~1.5 s) before the work moves
# on; with steps of seconds to minutes, 30 s keeps that to one call in several.
COOLDOWN_S = 30.0
# Where other replicas can take the work, a member tries once before it fails over (its
# channel still retries UNAVAILABLE in gRPC's service config, ~1.5 s); one replica alone keeps
# the client's usual attempts.
MEMBER_ATTEMPTS = 1
M = TypeVar("M")
R = TypeVar("R")
T = TypeVar("T")


def lost_replica(e: BaseException) -> bool:
    """Whether `e` says the replica is gone (its work may be re-run elsewhere), not that the
    request was wrong."""
    if isinstance(e, Unavailable):
        return True
    return isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE


@dataclass
class ReplicaStats:
    """What one replica did for the calls spread over it."""

    answered: int = 0  # results kept from it (completions, scores, logprobs)
    failed_calls: int = 0  # chunks and streams lost with it
    resent: int = 0  # items it held when it failed, sent to another replica
    dropped: int = 0  # results it sent for items already answered: not handed out
    last_error: str = ""


class Replicas(Generic[M]):
    """The clients of one service's replicas (a sequence of them) and which to use now."""

    def __init__(self, what: str, members: Sequence[M], cooldown_s: float = COOLDOWN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`what`: the service's name in errors. `members`: one client per replica, each with
        an `address`. `clock`: monotonic seconds (tests pass their own)."""
        if not members:
            raise ValueError(f"no {what} replica given")
        self.what, self.members = what, list(members)
        self.cooldown_s, self.clock = cooldown_s, clock
        self.addresses = [str(getattr(m, "address", f"replica {i}")) for i, m in enumerate(self.members)]
        self.stats = {a: ReplicaStats() for a in self.addresses}
        self._down_until = [float("-inf")] * len(self.members)
        self._turn = 0

    @property
    def address(self) -> str:
        return ", ".join(self.addresses)

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[M]:
        return iter(self.members)

    def __getitem__(self, i: int) -> M:
        return self.members[i]

    @property
    def max_attempts(self) -> int:
        return len(self.members) + 1

    def candidates(self) -> list[int]:
        """The replicas to use now (those not in their cooldown; every one when all are), in
        an order that turns with each call, so uneven splits and ties fall to each in turn."""
        now = self.clock()
        live = [i for i, t in enumerate(self._down_until) if t <= now] or list(range(len(self.members)))
        k = self._turn % len(live)
        self._turn += 1
        return live[k:] + live[:k]

    def failed(self, i: int, error: BaseException) -> None:
        """Replica `i` lost a call: leave it out for the cooldown."""
        self._down_until[i] = self.clock() + self.cooldown_s
        st = self.stats[self.addresses[i]]
        st.failed_calls += 1
        st.last_error = str(error)

    def exhausted(self, items: int) -> Unavailable:
        errors = "; ".join(f"{a}: {s.last_error}" for a, s in self.stats.items() if s.last_error)
        return Unavailable(f"{self.what} at {self.address} is unavailable: {items} item(s) failed on "
                           f"{self.max_attempts} attempts across the replicas ({errors})")

    async def close(self) -> None:
        for m in self.members:
            await m.close()


def split(indices: Sequence[int], parts: int) -> list[list[int]]:
    """`indices` (ascending) as at most about `parts` contiguous runs of near-equal length:
    more only where the indices themselves are not contiguous."""
    if not indices:
        return []
    size = -(-len(indices) // max(1, parts))
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1 and len(runs[-1]) < size:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


async def spread(pool: Replicas[M], n: int,
                 run: Callable[[M, list[int]], AsyncIterator[tuple[int, R]]],
                 accept: Callable[[int, R], bool], done: Callable[[int], bool]) -> AsyncIterator[R]:
    """Items 0..n-1 over the replicas: `run(client, chunk)` does a contiguous chunk and yields
    (item, result) pairs; `accept` keeps a result (False: a second one for its unit, dropped);
    `done(i)` says item i needs nothing more. Results are yielded as they arrive."""
    events: asyncio.Queue = asyncio.Queue()
    attempts = [0] * n
    tasks: list[asyncio.Task] = []
    running = 0  # chunks whose last event has not been read yet

    async def one(i: int, chunk: list[int]) -> None:
        try:
            async for item, r in run(pool.members[i], chunk):
                await events.put(("result", i, (item, r)))
        except Exception as e:
            await events.put(("failed", i, (chunk, e)))
        else:
            await events.put(("ended", i, chunk))

    def launch(items: list[int]) -> None:
        nonlocal running
        order = pool.candidates()
        for k, chunk in enumerate(split(items, len(order))):
            tasks.append(asyncio.create_task(one(order[k % len(order)], chunk)))
            running += 1

    launch(list(range(n)))
    try:
        while running:
            kind, i, x = await events.get()
            st = pool.stats[pool.addresses[i]]
            if kind == "result":
                item, r = x
                if accept(item, r):
                    st.answered += 1
                    yield r
                else:
                    st.dropped += 1
                continue
            running -= 1
            if kind == "ended":
                if missing := [j for j in x if not done(j)]:
                    raise RuntimeError(f"{pool.what} at {pool.addresses[i]} returned no result for "
                                       f"{len(missing)} of its {len(x)} items")
                continue
            chunk, e = x
            if not lost_replica(e):
                raise e
            pool.failed(i, e)
            again = [j for j in chunk if not done(j)]
            st.resent += len(again)
            for j in again:
                attempts[j] += 1
            if any(attempts[j] >= pool.max_attempts for j in again):
                raise pool.exhausted(len(again)) from e
            launch(again)
    finally:
        await _cancel_all(tasks)


@dataclass
class _Lane:
    """One replica's stream within a spread stream."""

    index: int
    queue: asyncio.Queue
    outstanding: dict[str, Any]  # id -> item, sent and not yet answered
    task: asyncio.Task | None = None


async def spread_stream(pool: Replicas[M], items: AsyncIterator[T], key: Callable[[T], str],
                        open_: Callable[[M, AsyncIterator[T]], AsyncIterator[R]],
                        result_key: Callable[[R], str]) -> AsyncIterator[R]:
    """Items as the caller produces them, each to the live replica with the fewest unanswered,
    over one stream per replica (`open_(client, requests)`); results in arrival order, matched
    to their items by `key` / `result_key`. Ends once the input is exhausted and every item is
    answered."""
    events: asyncio.Queue = asyncio.Queue()
    lanes: dict[int, _Lane] = {}
    attempts: dict[str, int] = {}
    tasks: list[asyncio.Task] = []
    ended = closing = False

    async def feed() -> None:
        try:
            async for it in items:
                await events.put(("item", None, it))
        except Exception as e:
            await events.put(("error", None, e))
        else:
            await events.put(("end", None, None))

    async def stream(lane: _Lane) -> None:
        async def requests() -> AsyncIterator[T]:
            while (it := await lane.queue.get()) is not None:
                yield it

        try:
            async for r in open_(pool.members[lane.index], requests()):
                await events.put(("result", lane, r))
        except Exception as e:
            await events.put(("failed", lane, e))
        else:
            await events.put(("closed", lane, None))

    def dispatch(it: T) -> None:
        order = pool.candidates()
        i = min(order, key=lambda j: (len(lanes[j].outstanding) if j in lanes else 0, order.index(j)))
        if i not in lanes:
            lanes[i] = _Lane(i, asyncio.Queue(), {})
            lanes[i].task = asyncio.create_task(stream(lanes[i]))
            tasks.append(lanes[i].task)
        lanes[i].outstanding[key(it)] = it
        lanes[i].queue.put_nowait(it)

    tasks.append(asyncio.create_task(feed()))
    try:
        while True:
            kind, lane, x = await events.get()
            if kind == "item":
                k = key(x)
                if any(k in ln.outstanding for ln in lanes.values()):
                    raise ValueError(f"{pool.what}: id {k!r} given again while unanswered")
                dispatch(x)
            elif kind == "end":
                ended = True
            elif kind == "error":
                raise x
            elif kind == "result":
                st = pool.stats[pool.addresses[lane.index]]
                if lane.outstanding.pop(result_key(x), None) is None:
                    st.dropped += 1  # not asked of it, or asked and answered already
                    continue
                st.answered += 1
                yield x
            else:  # "failed" or "closed": the lane's stream is over
                del lanes[lane.index]
                if kind == "closed" and lane.outstanding:
                    raise RuntimeError(f"{pool.what} at {pool.addresses[lane.index]} ended its stream "
                                       f"with {len(lane.outstanding)} items unanswered")
                if kind == "failed":
                    if not lost_replica(x):
                        raise x
                    pool.failed(lane.index, x)
                    pool.stats[pool.addresses[lane.index]].resent += len(lane.outstanding)
                    for k, it in lane.outstanding.items():
                        attempts[k] = attempts.get(k, 0) + 1
                        if attempts[k] >= pool.max_attempts:
                            raise pool.exhausted(len(lane.outstanding)) from x
                        dispatch(it)
            if ended and not any(ln.outstanding for ln in lanes.values()):
                if not lanes:
                    return
                if not closing:  # nothing can need a lane any more: end the requests
                    closing = True
                    for ln in lanes.values():
                        ln.queue.put_nowait(None)
    finally:
        await _cancel_all(tasks)


# ---- the balanced clients -------------------------------------------------------------------


class _Service(Replicas[M]):
    """The replicas of one service: its name in errors (`service`) and the client that
    `connect` opens to each address (`client`)."""

    service: str
    client: Callable[..., M]

    def __init__(self, members: Sequence[M], cooldown_s: float = COOLDOWN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(self.service, members, cooldown_s, clock)

    @classmethod
    def connect(cls, addresses: Sequence[str], **kw) -> Self:
        """One client per address. A client retries a call itself only when it is the only
        replica; among several, the pool moves the call to another one instead."""
        return cls([cls.client(a, attempts=_attempts(addresses)) for a in addresses], **kw)


class Rollouts(_Service[RolloutClient]):
    """Training generation spread over the rollout replicas; a sequence of their clients
    (each gets every version: the publisher pushes to all of them)."""

    service, client = "rollout", RolloutClient

    def _run(self, prompts: Sequence, sampling: dict, each: bool):
        texts = sampling.pop("texts", None)
        source = texts if texts is not None else prompts

        async def run(client: RolloutClient, chunk: list[int]) -> AsyncIterator[tuple[int, Completion]]:
            first, part = chunk[0], [source[i] for i in chunk]
            s = dict(sampling)
            if s.get("seed") is not None:
                s["seed"] += first  # the seed the prompt gets in one request for all of them
            if texts is not None:
                part, s["texts"] = None, part
            comps = (client.generate_each(part, **s) if each
                     else _aiter(await client.generate(part, **s)))
            async for c in comps:
                yield first + c.prompt_index, dataclasses.replace(c, prompt_index=first + c.prompt_index)

        return source, run

    def _done(self, n_prompts: int, n: int):
        seen: list[set[int]] = [set() for _ in range(n_prompts)]

        def accept(i: int, c: Completion) -> bool:
            if c.sample_index in seen[i]:
                return False
            seen[i].add(c.sample_index)
            return True

        return accept, lambda i: len(seen[i]) >= n

    async def generate(self, chats: Sequence[Sequence[dict[str, str]]] | None,
                       **sampling) -> list[Completion]:
        """`RolloutClient.generate`, the prompts spread over the replicas; sorted by
        (prompt, sample)."""
        if len(self) == 1:
            return await self.members[0].generate(chats, **sampling)
        source, run = self._run(chats, dict(sampling), each=False)
        accept, done = self._done(len(source), sampling.get("n", 1))
        comps = [c async for c in spread(self, len(source), run, accept, done)]
        return sorted(comps, key=lambda c: (c.prompt_index, c.sample_index))

    async def generate_each(self, chats: Sequence[Sequence[dict[str, str]]] | None,
                            **sampling) -> AsyncIterator[Completion]:
        """`RolloutClient.generate_each`, the prompts spread over the replicas: each whole
        completion as soon as a replica finishes it, with its prompt index in `chats`."""
        if len(self) == 1:
            async for c in self.members[0].generate_each(chats, **sampling):
                yield c
            return
        source, run = self._run(chats, dict(sampling), each=True)
        accept, done = self._done(len(source), sampling.get("n", 1))
        async for c in spread(self, len(source), run, accept, done):
            yield c


class Rewards(_Service[RewardClient]):
    """Scoring spread over the reward replicas."""

    service, client = "reward", RewardClient

    async def score(self, items: Sequence[ScoreItem]) -> list[Score]:
        """`RewardClient.score` spread over the replicas; results in the order of `items`."""
        if len(self) == 1:
            return await self.members[0].score(items)
        return await _batch(self, len(items), lambda c, chunk: c.score([items[i] for i in chunk]))

    async def score_each(self, items: AsyncIterator[ScoreItem]) -> AsyncIterator[Score]:
        """`RewardClient.score_each` over one stream per replica; each result as soon as its
        sample is scored, matched by `id`."""
        if len(self) == 1:
            async for s in self.members[0].score_each(items):
                yield s
            return
        async for s in spread_stream(self, items, lambda it: it.id, lambda c, its: c.score_each(its),
                                     lambda s: s.id):
            yield s


class References(_Service[ReferenceClient]):
    """Reference passes spread over the reference replicas."""

    service, client = "reference", ReferenceClient

    async def logprobs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                       ) -> list[list[float]]:
        """`ReferenceClient.logprobs` spread over the replicas; in the order of `pairs`."""
        if len(self) == 1:
            return await self.members[0].logprobs(pairs)
        return await _batch(self, len(pairs), lambda c, chunk: c.logprobs([pairs[i] for i in chunk]))

    async def logprobs_each(self, pairs: AsyncIterator[tuple[str, Sequence[int], Sequence[int]]]
                            ) -> AsyncIterator[tuple[str, list[float]]]:
        """`ReferenceClient.logprobs_each` over one stream per replica, matched by id."""
        if len(self) == 1:
            async for r in self.members[0].logprobs_each(pairs):
                yield r
            return
        async for r in spread_stream(self, pairs, lambda p: p[0], lambda c, ps: c.logprobs_each(ps),
                                     lambda r: r[0]):
            yield r

    async def status(self):
        """The first replica's status that answers (all hold the same base model; `every`
        gives each one's)."""
        errors: list[BaseException] = []
        for i in self.candidates():
            try:
                return await self.members[i].status()
            except Exception as e:
                if not lost_replica(e):
                    raise
                errors.append(e)
        raise errors[-1]

    async def every_status(self) -> list:
        """Each replica's status, in replica order (a replica that is down raises)."""
        return list(await asyncio.gather(*(m.status() for m in self.members)))


async def _batch(pool: Replicas, n: int, call: Callable[[Any, list[int]], Awaitable[list]]) -> list:
    """A batch call whose results are positional: each chunk's results, in input order."""
    out: list = [None] * n
    got = [False] * n

    async def run(client, chunk: list[int]) -> AsyncIterator[tuple[int, Any]]:
        results = await call(client, chunk)
        if len(results) != len(chunk):
            raise RuntimeError(f"{pool.what} at {getattr(client, 'address', '?')} returned {len(results)} results "
                               f"for {len(chunk)} items")
        for i, r in zip(chunk, results):
            yield i, r

    def accept(i: int, r) -> bool:
        if got[i]:
            return False
        out[i], got[i] = r, True
        return True

    async for _ in spread(pool, n, run, accept, lambda i: got[i]):
        pass
    return out


async def _cancel_all(tasks) -> None:
    """Cancel `tasks` and wait until each has ended, whatever it ended with."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t


def _attempts(addresses: Sequence[str]) -> int:
    return RETRY_ATTEMPTS if len(addresses) == 1 else MEMBER_ATTEMPTS


async def _aiter(xs):
    for x in xs:
        yield x
