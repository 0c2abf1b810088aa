"""`hotloop audit tenants`: answers attributed to the weights that wrote them, by likelihood.

Two tenants' adapters on the tiny model (its output layer sharpened, `sharp`); their answers
sampled from each adapter with transformers, as the engine would have served them, written as
a demo run's request records. Some
answers of tenant `a` are sampled from `b`'s adapter but carry `a`'s label and version: the
fault the audit is for (a label that says one thing, tokens written by another's weights)."""

from __future__ import annotations

import json

import pytest

from measure.users import TENANT_PROMPTS
from tests.conftest import make_adapter

MAX_NEW = 48


def sample(model_dir, adapter_dir, prompts, n_each, seed):
    """Answers of the adapter at temperature 1: (prompt index, text, finish reason). Only
    tokenizations the tokenizer itself would give are drawn (a token that would not survive
    decoding and encoding again is drawn anew): the audit scores an answer's text, encoded
    again, and the tiny model's random draws are mostly not what encoding gives back."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(adapter_dir)).eval()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": TENANT_PROMPTS[i]}],
                                       add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(text, add_special_tokens=False)
        for _ in range(n_each):
            answer, finish = [], "length"
            while len(answer) < MAX_NEW and finish == "length":
                with torch.no_grad():
                    probs = torch.softmax(model(input_ids=torch.tensor([prompt + answer])).logits[0, -1], -1)
                while True:
                    t = int(torch.multinomial(probs, 1, generator=gen))
                    if t == tok.eos_token_id:
                        finish = "stop"
                        break
                    if tok.encode(tok.decode(answer + [t]), add_special_tokens=False) == answer + [t]:
                        answer.append(t)
                        break
                    probs[t] = 0.0
            out.append((i, tok.decode(answer), finish))
    return out


def sharp(tiny_model, out):
    """The tiny model with its output layer 10x: its random init gives logits of ~0.3, so
    near-uniform next-token distributions that no adapter moves far (a per-token KL of ~0.1
    between two adapters' answers); a served model is sharper than that."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        m.lm_head.weight.mul_(10.0)
    m.save_pretrained(out)
    for f in tiny_model.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    return sharp(tiny_model, tmp_path_factory.mktemp("sharp-model"))


def record(tenant, k, version, prompt, text, finish, **kw):
    return {"tenant": tenant, "response_id": f"{tenant}-{k}", "version": version, "last_version": version,
            "prompt": prompt, "answer": text, "finish_reason": finish, "error": "", **kw}


def export(run_dir, name, adapter_dir, version):
    """The adapter as `GET /v1/adapter` gives it (the trainer's archive and its digest), saved
    the demo's way."""
    from apps.audit import ADAPTERS, save_export
    from hotloop import adapters

    data = adapters.pack(adapter_dir)
    return save_export(run_dir / ADAPTERS, name, version, adapters.sha256(data), data)


@pytest.fixture(scope="module")
def run_dir(model, tmp_path_factory):
    """A demo run: tenants `a` (v3) and `b` (v5) with exported adapters; `a`'s records hold 8
    answers of its own adapter, 2 of `b`'s under its label (`a-mis-*`), one of another version
    and one failed request (neither audited)."""
    root = tmp_path_factory.mktemp("audit")
    run = root / "run"
    run.mkdir()
    a = make_adapter(model, root / "a", seed=11)
    b = make_adapter(model, root / "b", seed=22)
    export(run, "a", a, 3)
    export(run, "b", b, 5)
    recs_a = [record("a", k, 3, *s) for k, s in enumerate(sample(model, a, [0, 1, 2, 3], 2, seed=1))]
    recs_a += [record("a", f"mis-{k}", 3, *s) for k, s in enumerate(sample(model, b, [4, 5], 1, seed=2))]
    recs_a += [record("a", "old", 2, 0, "an answer of an older version", "stop"),
               record("a", "err", 3, 0, "", "", error="HTTP 503")]
    recs_b = [record("b", k, 5, *s) for k, s in enumerate(sample(model, b, [0, 1, 2], 2, seed=3))]
    for name, recs in (("a", recs_a), ("b", recs_b)):
        (run / f"requests-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def test_answers_written_by_another_tenant_s_adapter_are_found_and_their_own_are_not(run_dir, model):
    from apps.audit import audit_run

    report = audit_run(run_dir, model=str(model), per_tenant=100, threads=2)
    a, b = report["tenants"]["a"], report["tenants"]["b"]
    assert (a["version"], a["answers"], a["sampled"]) == (3, 10, 10)  # not the old version nor the error
    assert sorted(a["other_tenant_answers"]) == ["a-mis-0", "a-mis-1"]
    # the two answers b's adapter wrote are b's best; the base may explain one of a's own a
    # little better than a's adapter does (a short answer, or one the adapter barely moved)
    assert a["best"]["other"] == 2 and a["best"]["own"] >= 6
    assert (b["answers"], b["other_tenant_answers"], b["best"]["other"]) == (6, [], 0)
    assert b["own_minus_other_nats"]["min"] > report["margin_nats"]
    assert b["own_minus_base_per_token"] > 0.1  # its answers are its adapter's, not the base's
    assert report["other_tenant_answers"] == 2 and report["sampled"] == 16
    saved = json.loads((run_dir / "tenants-audit.json").read_text())
    assert saved["other_tenant_answers"] == 2 and len(saved["tenants"]["a"]["rows"]) == 10


def test_the_command_samples_and_fails_on_a_wrong_answer_or_refuses_a_run_without_adapters(
        run_dir, model, tmp_path, capsys):
    from apps.cli import main

    # 4 of a's 10: whichever are drawn, b's 6 answers are all its own (exit 1 only for a)
    code = main(["audit", "tenants", str(run_dir), "--answers", "4", "--model", str(model)])
    report = json.loads((run_dir / "tenants-audit.json").read_text())
    assert report["tenants"]["a"]["sampled"] == 4 and report["tenants"]["b"]["sampled"] == 4
    drawn = [r["response_id"] for r in report["tenants"]["a"]["rows"]]
    mis = sorted(r for r in drawn if r.startswith("a-mis-"))  # b's answers drawn among a's 4
    assert sorted(report["tenants"]["a"]["other_tenant_answers"]) == mis
    assert code == (1 if mis else 0)
    out = capsys.readouterr().out
    assert "| a | v3 | 4 of 10 |" in out and "sampled answers are best explained" in out

    assert main(["audit", "tenants", str(tmp_path)]) == 2
    assert "no exported adapters" in capsys.readouterr().err
    assert main(["audit", "tenants", str(run_dir), "--answers", "0"]) == 2


def test_an_export_that_is_not_what_was_announced_is_refused(tmp_path, adapter_factory):
    from apps.audit import save_export
    from hotloop import adapters
    from hotloop.errors import InvalidArgument

    data = adapters.pack(adapter_factory(seed=3, r=4))
    with pytest.raises(InvalidArgument, match="do not match its digest"):
        save_export(tmp_path, "a", 1, "0" * 64, data)
    bad = b"not a tar" + data[9:]  # the digest matches; the archive is not an adapter's
    with pytest.raises(InvalidArgument):
        save_export(tmp_path, "a", 1, adapters.sha256(bad), bad)
    assert not (tmp_path / "a.json").exists()  # nothing recorded for the audit to read


def test_an_answer_the_base_explains_best_is_not_another_tenant_s():
    """`verdicts`: another tenant's adapter is the verdict only where it explains the answer
    best of all the models, and its own adapter by more than the margin. A base-like answer
    (d12: 10.8 nats less likely under its own adapter than under the base) that a lineage
    barely off the base explains 4.4 nats better than its own is not."""
    from apps.audit import Answer, verdicts

    a = Answer("direct", 136, "r1", "p", "text", cut_off=False)
    base_like = {"tokens": 139, "base": -300.0, "direct": -310.8, "short": -306.4, "exclaim": -330.0}
    v = verdicts(a, base_like, ["short", "exclaim"], margin=3.0)
    assert (v["best"], v["other"], v["wrong"]) == ("base", "short", False)
    assert v["own_minus_other"] == pytest.approx(-4.4) and v["own_minus_base"] == pytest.approx(-10.8)
    served_by_short = {**base_like, "short": -299.0}  # now short's adapter explains it best
    assert verdicts(a, served_by_short, ["short", "exclaim"], margin=3.0)["wrong"] is True
    close = {**base_like, "short": -299.0, "direct": -301.0}  # best, but within the margin
    assert verdicts(a, close, ["short", "exclaim"], margin=3.0)["wrong"] is False
