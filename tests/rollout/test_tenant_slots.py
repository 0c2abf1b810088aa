"""Several adapters in one batch inside a real vLLM CPU worker (services/rollout/updates/slots.py):
each request is served by the adapter its `extra_args` name, whatever else shares its batch.

Greedy outputs of requests on adapters A, B, the live weights and the base, mixed in one batch
(prefill and decode, interleaved so that a slot's rows are not one run), equal each run alone;
and the slot path computes what the single-adapter factored path computes."""

from __future__ import annotations

import pytest

from services.rollout.tenants import BASE, LABEL_KEY

pytestmark = pytest.mark.slow

PROMPTS = [[1, 17, 33, 90, 5], [1, 200, 7], [1, 44, 45, 46, 47, 48, 49], [1, 3]]
N_TOKENS = 12


@pytest.fixture(scope="module")
def llm(tiny_model):
    from vllm import LLM

    engine = LLM(model=str(tiny_model), dtype="float32", enforce_eager=True, max_model_len=512,
                 worker_extension_cls="services.rollout.worker_ext.HotloopWorkerExtension",
                 seed=0, enable_prefix_caching=False)
    engine.collective_rpc("hotloop_init", args=(str(tiny_model),))
    (st,) = engine.collective_rpc("hotloop_slots_init", args=(2,))
    assert st == {"slots": 2, "labels": [None, None]}
    yield engine
    del engine


def _run(llm, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Greedy tokens of each (prompt, adapter label) job, all in one generate call."""
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True,
                             extra_args=None if label is None else {LABEL_KEY: label})
              for _, label in jobs]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in jobs], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_mixed_batch_equals_each_alone(llm, adapter_factory):
    a, b, c = (adapter_factory(seed=s, scale=5.0) for s in (11, 12, 13))
    llm.collective_rpc("hotloop_slot_load", args=(0, "acme@1", str(a)))
    llm.collective_rpc("hotloop_slot_load", args=(1, "beta@1", str(b)))
    labels = ["acme@1", "beta@1", None, "acme@1"]  # acme's rows are two runs: gather path
    alone = {(i, lab): _run(llm, [(p, lab)])[0] for i, p in enumerate(PROMPTS) for lab in set(labels)}
    # the adapters change outputs, so a request served by the wrong one would show
    for i in range(len(PROMPTS)):
        assert len({tuple(alone[i, lab]) for lab in set(labels)}) == 3, i
    # not a palindrome of labels: a mapping laid out in the wrong order fails
    jobs = [(p, lab) for p, lab in zip(PROMPTS, labels)] + [(p, lab) for p, lab in zip(PROMPTS, labels[1:] + labels[:1])]
    mixed = _run(llm, jobs)
    assert mixed == [alone[PROMPTS.index(p), lab] for p, lab in jobs]

    # n > 1: vLLM's child requests carry their parent's label
    from vllm import SamplingParams, TokensPrompt

    (out,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[1])], [SamplingParams(
        n=2, temperature=1.0, top_k=1, max_tokens=N_TOKENS, ignore_eos=True,  # greedy, n > 1
        extra_args={LABEL_KEY: "beta@1"})], use_tqdm=False)
    assert [list(c.token_ids) for c in out.outputs] == [alone[1, "beta@1"]] * 2

    # The slot path computes the adapter: acme alone in a slot == acme live (factored build).
    llm.collective_rpc("hotloop_swap", args=(5, str(a)), kwargs={"mode": "factored"})
    try:
        assert [_run(llm, [(p, None)])[0] for p in PROMPTS] == [alone[i, "acme@1"] for i in range(4)]
        # With a version live, slot rows and BASE rows leave the live weights: the base rows
        # run on the load-time base, the slot rows on base + their own adapter.
        llm.collective_rpc("hotloop_swap", args=(6, str(c)), kwargs={"mode": "merged"})
        live_c = [_run(llm, [(p, None)])[0] for p in PROMPTS]
        jobs = [(PROMPTS[0], BASE), (PROMPTS[1], None), (PROMPTS[2], "beta@1"), (PROMPTS[3], BASE),
                (PROMPTS[0], None), (PROMPTS[1], "acme@1")]
        want = [alone[0, None], live_c[1], alone[2, "beta@1"], alone[3, None], live_c[0],
                alone[1, "acme@1"]]
        assert _run(llm, jobs) == want
        # no row on the live weights: one base GEMM for all rows
        assert _run(llm, [(PROMPTS[0], BASE), (PROMPTS[2], "beta@1")]) == [alone[0, None],
                                                                          alone[2, "beta@1"]]
        assert live_c != [alone[i, None] for i in range(4)]
    finally:
        llm.collective_rpc("hotloop_reset")


def test_a_freed_slot_takes_another_adapter(llm, adapter_factory):
    a, b = adapter_factory(seed=11, scale=5.0), adapter_factory(seed=12, scale=5.0)
    llm.collective_rpc("hotloop_slot_load", args=(0, "acme@1", str(a)))
    want_a = _run(llm, [(PROMPTS[0], "acme@1")])
    llm.collective_rpc("hotloop_slot_free", args=(0,))
    (st,) = llm.collective_rpc("hotloop_slots_status")
    assert st["labels"][0] is None
    llm.collective_rpc("hotloop_slot_load", args=(0, "beta@2", str(b)))
    assert _run(llm, [(PROMPTS[0], "beta@2")]) != want_a
    # a label is resident once: loading it elsewhere moves it
    llm.collective_rpc("hotloop_slot_load", args=(1, "beta@2", str(b)))
    (st,) = llm.collective_rpc("hotloop_slots_status")
    assert st["labels"] == [None, "beta@2"]
