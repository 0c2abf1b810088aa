"""In-flight weight updates (merged mode, `swap = "inflight"`) through a real gRPC server.

The exactness test is what the trainer's per-token importance ratio relies on: a greedy
generation is running when a large-delta adapter goes live; the completion's version_spans
must put the boundary at the exact token where the new weights started sampling. Checked
three ways: the tokens before it are the base model's greedy tokens; the logprobs after it are
what Hugging Face computes when it continues the base model's KV cache with the merged
weights (what the engine does: running sequences keep their KV); and the worker's own
snapshot of the request's token count at commit time agrees. The engine runs in fp32 so that
vLLM and HF agree to a few 1e-3 nats; the adapter's delta is large, so a boundary off by one
token changes the logprob at the boundary by far more than that.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch

from hotloop import adapters
from hotloop.proto.v1 import common_pb2, rollout_pb2

from .test_rollout_service import generate, push, serving

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
LOGPROB_TOL = 0.02  # nats: vLLM fp32 CPU kernels vs HF fp32
PROMPT = "for i in range(10):"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(tiny_model, tmp_path_factory):
    async with serving(tiny_model, tmp_path_factory.mktemp("rollout-inflight"), "merged",
                       dtype="float32", swap="inflight", max_new_tokens=400) as served:
        yield served


def hf_mixed_logprobs(model_dir, adapter_dir, prompt_ids, tokens, boundary) -> list[float]:
    """Logprobs of tokens[boundary:] when the base model computed the KV cache of everything
    before the step that sampled tokens[boundary], and the merged model computed the rest."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter_dir
    ).merge_and_unload().eval()
    seq = list(prompt_ids) + list(tokens)
    cut = len(prompt_ids) + boundary - 1  # input position of the step that sampled the boundary
    with torch.no_grad():
        past = base(torch.tensor([seq[:cut]]), use_cache=True).past_key_values
        logits = merged(torch.tensor([seq[cut:-1]]), past_key_values=past).logits[0]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [lp[i, t].item() for i, t in enumerate(tokens[boundary:])]


def hf_base_logprobs(model_dir, prompt_ids, tokens) -> list[float]:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seq = list(prompt_ids) + list(tokens)
    with torch.no_grad():
        logits = base(torch.tensor([seq[:-1]])).logits[0, len(prompt_ids) - 1:]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [lp[i, t].item() for i, t in enumerate(tokens)]


async def test_inflight_swap_boundary_is_exact(rollout, tiny_model, adapter_factory):
    core, stub = rollout
    prompt_ids = core.tokenizer.encode(PROMPT)
    prompt = [common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=prompt_ids))]
    (base,) = await generate(stub, prompt, max_tokens=300, temperature=0)
    assert len(base.token_ids) > 40, "the base model stopped too early for this test"

    adapter_dir = adapter_factory(seed=7, scale=5.0)
    data = adapters.pack(adapter_dir)
    v = core.latest + 1
    req = rollout_pb2.GenerateRequest(prompts=prompt, stream=True,
                                      sampling=common_pb2.SamplingParams(max_tokens=300, temperature=0))
    msgs, pushed = [], None
    async for m in stub.Generate(req):
        msgs.append(m)
        if pushed is None and sum(len(x.token_ids) for x in msgs) >= 8:
            pushed = asyncio.create_task(push(stub, data, v))
    assert (await pushed).loaded.version == v
    tokens = [t for m in msgs for t in m.token_ids]
    logprobs = [lp for m in msgs for lp in m.logprobs]
    spans = [(s.version, s.first_token) for s in msgs[-1].version_spans]
    assert len(spans) == 2, f"the swap did not land in flight: spans {spans}"
    (v0, s0), (v1, k) = spans
    assert (v0, s0, v1) == (0, 0, v) and 8 <= k < len(tokens)
    assert msgs[-1].policy_version == 0
    # spans grow monotonically over the stream and never point past the tokens sent so far
    sent = 0
    for m in msgs:
        sent += len(m.token_ids)
        assert all(s.first_token < sent for s in m.version_spans)
    # the worker's own count of the request's tokens at commit time is the same boundary
    assert list(core.last_swap["worker"]["tokens_at_commit"].values()) == [k]
    assert tokens[:k] == list(base.token_ids[:k])

    ref = hf_mixed_logprobs(tiny_model, adapter_dir, prompt_ids, tokens, k)
    assert logprobs[k:] == pytest.approx(ref, abs=LOGPROB_TOL)
    old = hf_base_logprobs(tiny_model, prompt_ids, tokens)
    assert logprobs[:k] == pytest.approx(old[:k], abs=LOGPROB_TOL)
    # the adapter really changes the boundary token's logprob: an off-by-one would show
    assert abs(old[k] - ref[0]) > 10 * LOGPROB_TOL

    # new requests are admitted on the new version, wholly
    (after,) = await generate(stub, prompt, max_tokens=8, temperature=0)
    assert after.policy_version == v
    assert [(s.version, s.first_token) for s in after.version_spans] == [(v, 0)]


async def test_inflight_swaps_under_load_fail_no_request(rollout, adapter_factory):
    core, stub = rollout
    stop = asyncio.Event()
    results, errors = [], []

    async def traffic(i: int, stream: bool) -> None:
        while not stop.is_set():
            req = rollout_pb2.GenerateRequest(
                prompts=[common_pb2.Prompt(text=f"def f{i}(x):")], stream=stream,
                sampling=common_pb2.SamplingParams(n=2, max_tokens=48))
            try:
                results.append([m async for m in stub.Generate(req)])
            except Exception as e:  # counted: no request may fail because of a swap
                errors.append(e)

    users = [asyncio.create_task(traffic(i, stream=i % 2 == 0)) for i in range(4)]
    await asyncio.sleep(0.5)
    first = core.latest + 1
    for j in range(3):
        await push(stub, adapters.pack(adapter_factory(seed=10 + j, scale=2.0)), first + j)
        # the gate was closed only for pause + swap + resume
        assert core.last_swap["pause_ms"] + core.last_swap["commit_ms"] < 2000
        await asyncio.sleep(0.3)
    stop.set()
    await asyncio.gather(*users)
    assert not errors, errors[:3]
    crossed = 0
    for msgs in results:
        finals = [m for m in msgs if m.final]
        assert len(finals) == 2
        for f in finals:
            spans = [(s.version, s.first_token) for s in f.version_spans]
            assert [s for _, s in spans] == sorted({s for _, s in spans})
            assert [v for v, _ in spans] == sorted({v for v, _ in spans})
            assert spans[0][0] == f.policy_version and spans[-1][0] <= first + 2
            crossed += len(spans) > 1
        n_tokens = sum(len(m.token_ids) for m in msgs)
        assert n_tokens == sum(len(m.logprobs) for m in msgs)
    assert crossed > 0, "no completion was in flight across a swap"
    status = await stub.Status(rollout_pb2.StatusRequest())
    assert status.latest_version == first + 2 and status.swap == "inflight"
