"""A service that is down fails the call after bounded retries with an error naming it
(the GRPO step then fails; it never becomes a silent zero reward)."""

import socket
import time

import pytest

from hotloop.clients import ReferenceClient, RewardClient, ScoreItem
from hotloop.errors import Unavailable


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_reward_down_is_a_clear_bounded_failure():
    client = RewardClient(f"127.0.0.1:{_unused_port()}")
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="reward at 127.0.0.1"):
        await client.score([ScoreItem(id="1", prompt="p", completion="c", tests="assert True")])
    assert time.monotonic() - t0 < 30
    await client.close()


async def test_reference_down_is_a_clear_bounded_failure():
    client = ReferenceClient(f"127.0.0.1:{_unused_port()}")
    with pytest.raises(Unavailable, match="reference"):
        await client.logprobs([([1, 2], [3])])
    await client.close()


async def test_score_each_answers_before_the_input_ends():
    """The streaming call hands out each score while the caller still holds the next item
    back: asynchronous GRPO scores a group while the engine generates the rest."""
    import asyncio

    from services.reward.config import RewardConfig, SandboxConfig
    from services.reward.core import RewardCore
    from services.reward.server import serve

    core = RewardCore.from_config(RewardConfig(concurrency=2, sandbox=SandboxConfig(
        wall_seconds=3.0, cpu_seconds=2, memory_mb=256)))
    server, port, _ = await serve(core, "127.0.0.1:0")
    client = RewardClient(f"127.0.0.1:{port}")
    gate: asyncio.Queue = asyncio.Queue()
    good = "```python\ndef add(a, b):\n    return a + b\n```"

    async def items():
        for i in range(3):
            if (await gate.get()) is None:
                return
            yield ScoreItem(id=str(i), prompt="p", completion=good if i != 1 else "nope",
                            entry_point="add", test_cases=["assert add(1, 2) == 3"])

    try:
        got = []
        await gate.put(True)
        async for s in client.score_each(items()):
            got.append((s.id, s.reward))
            await gate.put(True if len(got) < 3 else None)  # the next item only after this result
        assert got == [("0", 1.0), ("1", 0.0), ("2", 1.0)]
    finally:
        await client.close()
        await server.stop(None)
        await core.close()


async def test_logprobs_each_matches_the_batch_call(tiny_model):
    from services.reference.config import ReferenceConfig
    from services.reference.core import ReferenceCore
    from services.reference.server import serve

    core = ReferenceCore(ReferenceConfig(model=str(tiny_model), dtype="float32", token_budget=256))
    server, port, _ = await serve(core, "127.0.0.1:0")
    client = ReferenceClient(f"127.0.0.1:{port}")
    pairs = [([5, 6, 7], [8, 9]), ([11], [12, 13, 14]), ([3, 4], [])]

    async def each():
        for i, (p, c) in enumerate(pairs):
            yield f"s{i}", p, c

    try:
        streamed = {i: lp async for i, lp in client.logprobs_each(each())}
        batch = await client.logprobs(pairs)
        assert set(streamed) == {"s0", "s1", "s2"}
        for i, lp in enumerate(batch):
            assert streamed[f"s{i}"] == pytest.approx(lp, abs=1e-5) and len(lp) == len(pairs[i][1])
    finally:
        await client.close()
        await server.stop(None)


async def test_streams_to_a_service_that_is_down_name_it():
    async def none():
        return
        yield

    client = RewardClient(f"127.0.0.1:{_unused_port()}")
    with pytest.raises(Unavailable, match="reward at 127.0.0.1"):
        async for _ in client.score_each(none()):
            pass
    await client.close()


# ---- the rollout client: the wire as the gateway and the publisher use it ----------------------


class _Rollout:
    """A Rollout servicer that records what it was sent and answers from a script."""

    def __init__(self) -> None:
        from hotloop.proto.v1 import rollout_pb2_grpc

        class Servicer(rollout_pb2_grpc.RolloutServicer):
            async def PushAdapter(s, request_iterator, context):
                from hotloop.proto.v1 import rollout_pb2

                self.metadata = dict(context.invocation_metadata())
                async for msg in request_iterator:
                    self.pushed.append(msg)
                header = self.pushed[0].header
                return rollout_pb2.PushAdapterResponse(loaded=header.info, verify_ms=1.5, load_ms=2.5,
                                                       already_present=True)

            async def Generate(s, request, context):
                from hotloop.proto.v1 import rollout_pb2

                self.requests.append(request)
                self.time_remaining.append(context.time_remaining())
                # a replica without stream support: whole completions, `final` unset
                yield rollout_pb2.Completion(prompt_index=0, sample_index=0, text="x", token_ids=[7],
                                             logprobs=[-0.5], finish_reason="stop", policy_version=3)

        self.servicer = Servicer()
        self.pushed, self.requests, self.time_remaining, self.metadata = [], [], [], {}

    async def start(self) -> str:
        import grpc

        from hotloop.proto.v1 import rollout_pb2_grpc

        self.server = grpc.aio.server()
        rollout_pb2_grpc.add_RolloutServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"


async def test_push_adapter_sends_a_header_then_chunks_with_the_admin_token():
    from hotloop import adapters, grpcutil
    from hotloop.clients import Pushed, RolloutClient

    fake = _Rollout()
    client = RolloutClient(await fake.start())
    data = bytes(range(256)) * (grpcutil.CHUNK_BYTES * 5 // 2 // 256)  # 2.5 chunks
    info = adapters.Version(4, adapters.sha256(data), len(data), "tiny", created_at=12.0)
    sent = []
    try:
        pushed = await client.push_adapter(info, data, "s3cret", on_sent=lambda: sent.append(len(fake.pushed)))
    finally:
        await client.close()
        await fake.server.stop(0)
    header = fake.pushed[0].header
    assert header.make_latest and adapters.version_from_proto(header.info) == info
    assert [len(m.data) for m in fake.pushed[1:]] == [grpcutil.CHUNK_BYTES] * 2 + [grpcutil.CHUNK_BYTES // 2]
    assert b"".join(m.data for m in fake.pushed[1:]) == data
    assert fake.metadata["authorization"] == "Bearer s3cret"
    assert pushed == Pushed(info, 1.5, 2.5, True)
    assert len(sent) == 1  # once, after the last chunk was handed over


async def test_stream_sends_raw_prompts_with_a_deadline_and_marks_a_finished_message_final():
    from hotloop.clients import USER_PRIORITY, RolloutClient

    fake = _Rollout()
    client = RolloutClient(await fake.start())
    try:
        got = [c async for c in client.stream(None, texts=["def f(x):"], max_tokens=4, stop=["\n"],
                                              priority=USER_PRIORITY, request_id="r1", timeout_s=30)]
        [_ async for _ in client.stream([[{"role": "user", "content": "hi"}]])]  # no deadline
    finally:
        await client.close()
        await fake.server.stop(0)
    req, chat = fake.requests
    assert [p.text for p in req.prompts] == ["def f(x):"] and list(req.sampling.stop) == ["\n"]
    assert req.stream and req.request_id == "r1" and req.sampling.max_tokens == 4
    assert [m.content for m in chat.prompts[0].chat.messages] == ["hi"]
    # the deadline travels with the call (its exact remainder depends on the clocks)
    assert fake.time_remaining[0] is not None and fake.time_remaining[1] is None
    assert [(c.text, c.final, c.policy_version) for c in got] == [("x", True, 3)]


async def test_without_retry_a_down_replica_is_the_grpc_error_at_once():
    """The gateway and the publisher judge a failure themselves (another replica; tenacity)."""
    import grpc

    from hotloop.clients import RolloutClient, direct_channel

    address = f"127.0.0.1:{_unused_port()}"
    direct = RolloutClient(address, direct_channel(address, (100, 250)), retry=False)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await direct.status(timeout_s=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    await direct.close()
    retrying = RolloutClient(address)
    with pytest.raises(Unavailable, match=f"rollout at {address} is unavailable after"):
        await retrying.status(timeout_s=5)
    await retrying.close()
