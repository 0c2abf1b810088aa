"""Tenants through the rollout service (merged mode on the CPU, 2 adapter slots, a real gRPC
server on port 0 and a real vLLM engine): each request is served by its own tenant's version,
in batches shared with other tenants, with more tenants than slots."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio

from hotloop import adapters, grpcutil
from hotloop.proto.v1 import common_pb2, rollout_pb2

from .test_rollout_service import TOKEN, serving, text_prompt

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
PROMPT = "def add(a, b):"
FETCH_WAIT_S = 3.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(tiny_model, tmp_path_factory):
    async with serving(tiny_model, tmp_path_factory.mktemp("rollout-tenants"), "merged",
                       tenant_slots=2, max_new_tokens=400, tenant_slot_wait_s=60,
                       tenant_fetch_wait_s=FETCH_WAIT_S) as served:
        yield served


async def push(stub, tenant: str, data: bytes, version: int):
    info = common_pb2.VersionInfo(version=version, sha256=adapters.sha256(data), bytes=len(data),
                                  base_model="tiny")

    def messages():
        yield rollout_pb2.AdapterChunk(header=rollout_pb2.AdapterHeader(
            info=info, make_latest=True, tenant=tenant))
        yield rollout_pb2.AdapterChunk(data=data)

    return await stub.PushAdapter(messages(), metadata=grpcutil.bearer(TOKEN))


async def greedy(stub, tenant: str, pin: int = 0, max_tokens: int = 16, stream: bool = False,
                 prompt: str = PROMPT) -> rollout_pb2.Completion:
    req = rollout_pb2.GenerateRequest(
        prompts=[text_prompt(prompt)], tenant=tenant, pin_version=pin, stream=stream,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0))
    msgs = [c async for c in stub.Generate(req)]
    assert msgs and msgs[-1].final
    ids = [t for m in msgs for t in m.token_ids]
    last = msgs[-1]
    assert all(m.tenant == tenant and list(m.version_spans) == list(last.version_spans) for m in msgs)
    return rollout_pb2.Completion(token_ids=ids, policy_version=last.policy_version,
                                  version_spans=last.version_spans, tenant=last.tenant)


def spans(c) -> list[tuple[int, int]]:
    return [(s.version, s.first_token) for s in c.version_spans]


async def test_bad_tenant_names_are_refused(rollout, adapter_factory):
    core, stub = rollout
    data = adapters.pack(adapter_factory(seed=21, scale=5.0))
    for bad in ("Acme", "a b", "../x", "-x", "x" * 33, "é"):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await greedy(stub, bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert "tenant" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await push(stub, bad, data, 1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
    assert core.tenants() == {}
    # an unknown tenant is served the base model, as the default lineage at version 0
    fresh, base = await greedy(stub, "nobody-yet"), await greedy(stub, "")
    assert list(fresh.token_ids) == list(base.token_ids) and spans(fresh) == [(0, 0)]
    assert fresh.tenant == "nobody-yet" and base.tenant == ""
    # pinning a version the tenant does not hold
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await greedy(stub, "nobody-yet", pin=3)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_two_tenants_streaming_while_both_lineages_get_versions(rollout, adapter_factory):
    _, stub = rollout
    seeds = {("alpha", 1): 31, ("beta", 1): 32, ("alpha", 2): 33, ("beta", 2): 34}
    data = {k: adapters.pack(adapter_factory(seed=s, scale=5.0)) for k, s in seeds.items()}
    for t in ("alpha", "beta"):
        await push(stub, t, data[t, 1], 1)
    served: dict[tuple[str, int], list[list[int]]] = {}
    pushed = asyncio.Event()

    async def client(tenant: str) -> None:
        # stream until this tenant has been served its second version (bounded)
        for _ in range(200):
            c = await greedy(stub, tenant, max_tokens=24, stream=True)
            assert c.tenant == tenant
            assert len(spans(c)) == 1 and spans(c)[0][1] == 0, spans(c)
            served.setdefault((tenant, c.policy_version), []).append(list(c.token_ids))
            if pushed.is_set() and c.policy_version == 2:
                return
        raise AssertionError(f"{tenant} was never served version 2")

    async def pusher() -> None:
        await asyncio.sleep(0.3)
        await asyncio.gather(*(push(stub, t, data[t, 2], 2) for t in ("alpha", "beta")))
        pushed.set()

    await asyncio.gather(client("alpha"), client("beta"), pusher())
    assert set(served) == set(seeds)
    # every completion equals its own tenant's version run alone
    refs = {k: list((await greedy(stub, k[0], pin=k[1], max_tokens=24)).token_ids) for k in seeds}
    assert len({tuple(v) for v in refs.values()}) == 4  # a wrong adapter would show
    for k, outs in served.items():
        assert all(o == refs[k] for o in outs), k
    st = await stub.Status(rollout_pb2.StatusRequest())
    listed = {t.tenant: (t.latest_version, [v.version for v in t.versions]) for t in st.tenants}
    assert listed["alpha"] == (2, [1, 2]) and listed["beta"] == (2, [1, 2])


async def test_more_tenants_than_slots(rollout, adapter_factory):
    core, stub = rollout
    names = [f"t{i}" for i in range(4)]
    for i, t in enumerate(names):
        await push(stub, t, adapters.pack(adapter_factory(seed=40 + i, scale=5.0)), 1)
    refs = {t: list((await greedy(stub, t)).token_ids) for t in names}  # one at a time
    assert len({tuple(v) for v in refs.values()}) == 4
    loads = core.updater.slots.loads
    # 8 concurrent calls over 4 tenants and 2 slots: they wait for slots, none errs, none is
    # served another tenant's adapter
    outs = await asyncio.gather(*(greedy(stub, t, stream=k % 2 == 1) for k in range(2)
                                  for t in names))
    for c, t in zip(outs, names * 2):
        assert c.tenant == t and spans(c) == [(1, 0)]
        assert list(c.token_ids) == refs[t], t
    assert core.updater.slots.loads > loads  # evicted adapters came back
    st = await stub.Status(rollout_pb2.StatusRequest())
    assert len(st.resident_adapters) == 2


async def test_a_version_in_use_is_neither_evicted_nor_retired(rollout, adapter_factory):
    from services.rollout.core import GenerateInput, PromptIn, Sampling

    core, stub = rollout
    await push(stub, "x", adapters.pack(adapter_factory(seed=51, scale=5.0)), 1)
    for t, s in (("y", 52), ("z", 53)):
        await push(stub, t, adapters.pack(adapter_factory(seed=s, scale=5.0)), 1)
    long = GenerateInput([PromptIn(text=PROMPT)], Sampling(max_tokens=400, temperature=0,
                                                            ignore_eos=True),
                         tenant="x", stream=True)
    got: list[int] = []
    running = asyncio.Event()
    done = asyncio.Event()

    async def consume() -> None:
        async for c in core.generate(long):
            got.extend(c.token_ids)
            assert c.tenant == "x" and c.version_spans == [(1, 0)]
            running.set()
        done.set()

    task = asyncio.create_task(consume())
    await running.wait()
    # x's next versions arrive (keep_versions = 3 would retire v1), and y then z need the other
    # slot: z evicts y, never x@v1
    for v in (2, 3, 4):
        await push(stub, "x", adapters.pack(adapter_factory(seed=51 + 10 * v, scale=5.0)), v)
    await greedy(stub, "y", max_tokens=4)
    await greedy(stub, "z", max_tokens=4)
    assert not done.is_set(), "the long request ended before the checks: make it longer"
    assert "x@v1" in core.tenant_slots()["resident"]
    assert 1 in [v.version for v in core.tenants()["x"][1]]
    await task
    assert len(got) == 400
    ref = await greedy(stub, "x", pin=1, max_tokens=400)
    assert got == list(ref.token_ids)
    # the next push retires v1 now that nothing runs on it
    await push(stub, "x", adapters.pack(adapter_factory(seed=99, scale=5.0)), 5)
    assert [v.version for v in core.tenants()["x"][1]] == [3, 4, 5]
    assert "x@v1" not in core.tenant_slots()["resident"]


async def test_a_tenant_announced_but_not_fetched_yet_waits_for_its_version_never_the_base(
        rollout, adapter_factory):
    """Catch-up told the core that the mesh announced a version of a lineage the replica holds
    nothing of (it restarted): the tenant's request waits for catch-up's push of it, bounded by
    `tenant_fetch_wait_s`, and is refused with UNAVAILABLE past it, never served the base."""
    core, stub = rollout
    data = adapters.pack(adapter_factory(seed=61, scale=5.0))
    core.announced("late", 1)  # what catch-up does once it reads late's KV key
    base = await greedy(stub, "not-announced")  # a tenant nothing was announced for: the base
    assert spans(base) == [(0, 0)]
    waiting = asyncio.create_task(greedy(stub, "late"))
    deadline = time.monotonic() + 30
    while core.users.waiting == 0:  # admitted into generate, waiting for its first token
        assert time.monotonic() < deadline and not waiting.done()
        await asyncio.sleep(0.01)
    await push(stub, "late", data, 1)  # what catch-up does once it fetched it
    served = await waiting
    assert served.tenant == "late" and spans(served) == [(1, 0)]
    assert list(served.token_ids) == list((await greedy(stub, "late", pin=1)).token_ids)
    assert list(served.token_ids) != list(base.token_ids)

    core.announced("never", 2)  # nothing will fetch it
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await greedy(stub, "never")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "announced v2" in e.value.details() and "has not fetched it yet" in e.value.details()
    assert time.monotonic() - t0 >= FETCH_WAIT_S
    assert "never" not in core.tenants()


async def test_metrics_show_slot_loads_evictions_and_residency(rollout, adapter_factory):
    from hotloop import metrics
    from tests.scrape import scrape

    core, stub = rollout
    names = ["m0", "m1", "m2"]  # three tenants through two slots: the third evicts
    for i, t in enumerate(names):
        await push(stub, t, adapters.pack(adapter_factory(seed=70 + i, scale=5.0)), 1)
    endpoint = metrics.serve(core.registry)
    try:
        before = await scrape(endpoint.port)
        for t in names:
            await greedy(stub, t, max_tokens=4)
        after = await scrape(endpoint.port)
    finally:
        endpoint.close()

    def delta(sample: str, **labels) -> float:
        return after.value(sample, **labels) - before.value(sample, **labels)

    assert after.type_of("hotloop_rollout_tenant_slot_load_seconds") == "histogram"
    assert delta("hotloop_rollout_tenant_slot_load_seconds_count", result="ok") == 3
    assert delta("hotloop_rollout_tenant_slot_load_seconds_sum", result="ok") > 0
    assert delta("hotloop_rollout_tenant_slot_evictions_total") >= 1
    assert delta("hotloop_rollout_tenant_slot_refusals_total") == 0
    assert after.type_of("hotloop_rollout_tenant_slot_wait_seconds") == "histogram"
    assert after.value("hotloop_rollout_tenant_resident_adapters") == 2
    # the bytes of the two resident adapters' factors, as the worker reported them
    st = core.updater.slots.stats()
    assert after.value("hotloop_rollout_tenant_resident_adapter_bytes") == st["resident_bytes"] > 0
    assert st["resident_adapters"] == 2
    assert set(core.tenant_slots()["resident"]) == {"m1@v1", "m2@v1"}


async def test_a_reader_that_stops_reading_holds_neither_slot_nor_version_once_generated(
        rollout, adapter_factory):
    """A caller that stops reading its stream (a frozen client, a user behind the gateway
    whose socket no longer drains) keeps the stream open, not its adapter: once the engine has
    generated the answer, the slot goes to other tenants and the version can retire; the
    reader still gets every token of the version it was admitted on."""
    from services.rollout.core import GenerateInput, PromptIn, Sampling

    core, stub = rollout
    await push(stub, "slow", adapters.pack(adapter_factory(seed=81, scale=5.0)), 1)
    for t, s in (("p", 82), ("q", 83)):
        await push(stub, t, adapters.pack(adapter_factory(seed=s, scale=5.0)), 1)
    ref = await greedy(stub, "slow", max_tokens=24)
    gen = core.generate(GenerateInput([PromptIn(text=PROMPT)], Sampling(
        max_tokens=24, temperature=0), tenant="slow", stream=True))
    got = [await anext(gen)]  # one delta read, then the reader stops

    def leases() -> int:
        st = core.tenant_slots()
        return sum(n for label, n in zip(st["resident"], st["held"]) if label == "slow@v1")

    deadline = time.monotonic() + 30
    while leases():  # the engine finishes the answer without the reader
        assert time.monotonic() < deadline, "a reader that stopped reading still holds its slot"
        await asyncio.sleep(0.05)
    # two other tenants take both slots without waiting for the reader: slow@v1 is evicted
    for t in ("p", "q"):
        await asyncio.wait_for(greedy(stub, t, max_tokens=4), 30)
    assert "slow@v1" not in core.tenant_slots()["resident"]
    # and its next versions retire v1 (keep_versions = 3) while the reader's stream is open
    for v in (2, 3, 4):
        await push(stub, "slow", adapters.pack(adapter_factory(seed=81 + 10 * v, scale=5.0)), v)
    assert [v.version for v in core.tenants()["slow"][1]] == [2, 3, 4]
    got += [c async for c in gen]  # the reader comes back: the answer v1 gave, whole
    assert [t for c in got for t in c.token_ids] == list(ref.token_ids)
    assert all(c.tenant == "slow" and c.version_spans == [(1, 0)] for c in got)
    assert got[-1].final
