"""The reward-model scorer on a tiny random sequence-classification model, checked against a
plain transformers forward of the same model on the same text (never a hard-coded score)."""

from __future__ import annotations

import asyncio
import math

import pytest

from services.reward.config import RewardConfig, RewardModelConfig
from services.reward.core import RewardCore
from services.reward.reward_model import RewardModelScorer
from services.reward.scorers import build_scorers
from services.reward.types import ScoreInput

PAIRS = [
    ("Write a Python function that adds two numbers.", "```python\ndef add(a, b):\n    return a + b\n```"),
    ("Reverse a string.", "def reverse(s):\n    return s[::-1]\n"),
    ("Is n even?", "n % 2 == 0"),
    ("Say something.", "The quick brown fox jumps over the lazy dog."),
    ("", "x"),
]


def rm_config(model_dir, **overrides) -> RewardModelConfig:
    # fp32 on the CPU: the comparison with a direct forward can then be tight.
    return RewardModelConfig(model=str(model_dir), device="cpu", dtype="float32", **overrides)


def items(pairs=PAIRS, prefix="p") -> list[ScoreInput]:
    return [ScoreInput(f"{prefix}{i}", p, c) for i, (p, c) in enumerate(pairs)]


def direct_scores(model_dir, pairs, label_index=0, chat=True) -> list[float]:
    """What the model says about each pair, one forward each, the way its model card would."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt, completion in pairs:
        if chat:
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(prompt + completion)["input_ids"]
        with torch.inference_mode():
            out.append(float(model(torch.tensor([ids])).logits[0, label_index]))
    return out


@pytest.fixture(scope="module")
def scorer(tiny_rm) -> RewardModelScorer:
    return RewardModelScorer.load("rm", rm_config(tiny_rm(), batch_size=4))


async def test_scores_match_a_direct_forward_and_are_deterministic(scorer, tiny_rm):
    first = await scorer.score(items())
    again = await scorer.score(items())
    expected = direct_scores(tiny_rm(), PAIRS)
    assert [o.status for o in first] == ["ok"] * len(PAIRS), [o.error for o in first]
    rewards = [o.reward for o in first]
    assert all(math.isfinite(r) for r in rewards)
    assert rewards == pytest.approx(expected, abs=1e-4)
    assert rewards == [o.reward for o in again]
    assert len({round(r, 4) for r in rewards}) > 1, "every pair scored the same: the check is vacuous"


async def test_batched_scores_equal_one_by_one(scorer):
    batched = await scorer.score(items())  # batches of 4 and 1, padded to the longest
    single = [(await scorer.score([item]))[0] for item in items()]
    assert [o.reward for o in batched] == pytest.approx([o.reward for o in single], abs=1e-4)


async def test_concurrent_requests_share_forwards(tiny_rm):
    """Single-item calls arriving together (as the stream makes them) are batched."""
    rm = RewardModelScorer.load("rm", rm_config(tiny_rm(), batch_size=3))
    sizes = []
    forward = rm.forward
    rm.forward = lambda ids: (sizes.append(len(ids)), forward(ids))[1]  # records, then the real forward
    outs = await asyncio.gather(*(rm.score([item]) for item in items()))
    assert [o.id for (o,) in outs] == [f"p{i}" for i in range(len(PAIRS))]
    assert sum(sizes) == len(PAIRS) and max(sizes) == 3 and len(sizes) < len(PAIRS)


async def test_plain_text_without_the_chat_template(tiny_rm):
    rm = RewardModelScorer.load("rm", rm_config(tiny_rm(), use_chat_template=False, scale=2.0, offset=-1.0))
    outs = await rm.score(items())
    expected = [2.0 * v - 1.0 for v in direct_scores(tiny_rm(), PAIRS, chat=False)]
    assert [o.reward for o in outs] == pytest.approx(expected, abs=1e-4)


async def test_long_prompts_lose_their_start_and_keep_the_completion(scorer, tiny_rm):
    rm = RewardModelScorer.load("rm", rm_config(tiny_rm(), max_length=48))
    tail = " then write add." * 12  # longer than the room the prompt keeps
    completion = "def add(a, b):\n    return a + b\n"
    pairs = [("x " * 60 + tail, completion), ("y z " * 40 + tail, completion)]
    ids = [rm.encode(p, c) for p, c in pairs]
    completion_ids = rm.tokenizer(completion + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    for x in ids:
        assert len(x) == 48 and x[-len(completion_ids):] == completion_ids
    outs = await rm.score(items(pairs))
    # The prompts differ only in what was cut, so the model saw the same tokens.
    assert ids[0] == ids[1]
    assert outs[0].reward == pytest.approx(outs[1].reward, abs=1e-5)
    full = await scorer.score(items(pairs))  # max_length 2048: nothing cut, and they differ
    assert abs(full[0].reward - full[1].reward) > 1e-4
    # A completion longer than max_length on its own keeps its end.
    long = rm.encode("hi", "word " * 200)
    assert len(long) == 48 and long[-2:] == rm.tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]


async def test_nan_logits_are_scorer_errors_for_that_pair_only(tiny_rm, tiny_model):
    from transformers import AutoTokenizer

    (nan_id,) = AutoTokenizer.from_pretrained(tiny_model)("def", add_special_tokens=False)["input_ids"]
    rm = RewardModelScorer.load("rm", rm_config(tiny_rm(nan_token=nan_id)))
    pairs = [("Write add.", "def add(a, b):\n    return a + b\n"), ("Hi", "~~")]
    assert nan_id in rm.encode(*pairs[0]) and nan_id not in rm.encode(*pairs[1])
    bad, good = await rm.score(items(pairs))
    assert (bad.status, bad.reward) == ("scorer_error", 0.0) and "nan" in bad.error
    assert good.status == "ok" and math.isfinite(good.reward)


async def test_a_model_that_raises_fails_its_batch_and_the_next_batch_runs(tiny_rm):
    # The model knows fewer ids than its tokenizer makes: ids past 259 (the byte alphabet and
    # specials) make the embedding raise, as a model paired with the wrong tokenizer would.
    rm = RewardModelScorer.load("rm", rm_config(tiny_rm(vocab_size=259), batch_size=2, use_chat_template=False))
    merged = ("Write add.", "def add(a, b):\n    return a + b\n")
    plain = [("~", "~"), ("|", "~|")]
    assert max(rm.encode(*merged)) >= 259 and all(max(rm.encode(*p)) < 259 for p in plain)
    first = await rm.score(items([merged, plain[0]]))
    assert [o.status for o in first] == ["scorer_error"] * 2
    assert all("raised IndexError" in o.error for o in first)
    second = await rm.score(items(plain, prefix="q"))
    assert [o.status for o in second] == ["ok", "ok"]


async def test_wrong_shaped_logits_are_scorer_errors(tiny_rm):
    import torch

    rm = RewardModelScorer.load("rm", rm_config(tiny_rm(num_labels=3), label_index=2))
    ok = await rm.score(items(PAIRS[:2]))
    assert [o.status for o in ok] == ["ok", "ok"]
    assert [o.reward for o in ok] == pytest.approx(direct_scores(tiny_rm(num_labels=3), PAIRS[:2], 2), abs=1e-4)
    rm.model.score = torch.nn.Linear(64, 1, bias=False)  # the head now gives one logit, not three
    outs = await rm.score(items(PAIRS[:2]))
    assert [o.status for o in outs] == ["scorer_error"] * 2
    assert "label_index 2 is out of range" in outs[0].error


def test_label_index_beyond_num_labels_stops_start_up(tiny_rm):
    cfg = RewardConfig(scorers=["rm"], default_scorer="rm",
                       reward_models={"rm": rm_config(tiny_rm(num_labels=3), label_index=5)})
    with pytest.raises(ValueError, match="label_index 5 .* num_labels = 3"):
        build_scorers(cfg, lambda: pytest.fail("no pool is needed"))


def test_a_missing_model_stops_start_up(tmp_path):
    from hotloop.models import ModelError

    cfg = RewardConfig(scorers=["rm"], default_scorer="rm",
                       reward_models={"rm": rm_config(tmp_path / "nothing-here")})
    with pytest.raises(ModelError):
        RewardCore.from_config(cfg)


def test_unused_reward_models_are_not_loaded(tmp_path):
    cfg = RewardConfig(scorers=["format"], default_scorer="format",
                       reward_models={"rm": rm_config(tmp_path / "nothing-here")})
    scorers, pool = build_scorers(cfg, lambda: pytest.fail("no pool is needed"))
    assert set(scorers) == {"format"} and pool is None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
async def test_on_cuda_auto_is_bf16_and_agrees_with_fp32(scorer, tiny_rm):
    import torch

    rm = RewardModelScorer.load("rm", RewardModelConfig(model=str(tiny_rm()), batch_size=4))  # device, dtype: auto
    assert rm.device == "cuda" and next(rm.model.parameters()).dtype == torch.bfloat16
    gpu = await rm.score(items())
    cpu = await scorer.score(items())  # fp32 on the CPU
    assert [o.status for o in gpu] == ["ok"] * len(PAIRS), [o.error for o in gpu]
    # bf16 keeps 8 bits of mantissa: about 1e-2 relative through two layers and the head.
    assert [o.reward for o in gpu] == pytest.approx([o.reward for o in cpu], rel=0.05, abs=0.1)
    single = [(await rm.score([item]))[0].reward for item in items()]
    assert single == pytest.approx([o.reward for o in gpu], rel=0.05, abs=0.1)
