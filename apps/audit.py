"""`hotloop audit tenants RUN`: which weights wrote each tenant's answers, read from the tokens.

The many-tenant demo's `wrong_adapter_answers` compares labels: the lineage and version the
mesh says served an answer against the key's. This audit checks the answers themselves,
outside the engine that served them: for a sample of each tenant's answers from the version
it exported at the end of the run (`GET /v1/adapter` with the tenant's key, a peft
directory), the log-likelihood of the answer, token by token after its prompt, under the base
model and under every tenant's exported adapter (Hugging Face transformers with peft; the
engine's kernels are not involved). An answer sampled from tenant A's adapter is e^k times
more likely under A's adapter than under B's, where k grows with the answer's length and
with how far the two lineages moved apart; an answer served from B's adapter under A's label
shows the other way round.

What it reports, per tenant: how many sampled answers each model explains best; the answers
another tenant's adapter explains best of all the models, and better than the tenant's own by
more than `margin` nats (a likelihood ratio of e^3 by default: the audit's wrong-adapter
verdict; an answer the base model explains best is base-like, not another adapter's, however
a lineage barely off the base scores it); and how much more likely
its answers are under its own adapter than under the base, per token (a lineage served as the
base model would show ~0 or below). Two adapters that barely moved from the base cannot be told
apart, and the audit says so (`separable`: the median margin of its own adapter over the others).

Owns: reading a demo run's records and exported adapters, scoring, `tenants-audit.json`.
Does not own: the demo (`apps.tenant_demo` exports the adapters and calls `audit_run`).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

MARGIN_NATS = 3.0  # another tenant's adapter explains an answer e^3 (20x) better: a wrong one
ADAPTERS = "adapters"  # under the run directory: <tenant>/ (a peft directory) and <tenant>.json


@dataclass(frozen=True)
class Answer:
    """One answer as its user saw it, with the prompt it answered."""

    tenant: str
    version: int
    response_id: str
    prompt: str
    text: str
    cut_off: bool  # the token limit ended it (no end-of-turn token to score)


@dataclass(frozen=True)
class Exported:
    """A tenant's adapter as the demo exported it."""

    tenant: str
    version: int
    sha256: str
    path: Path  # a peft directory


def save_export(out: Path, tenant: str, version: int, sha256: str, tar_bytes: bytes) -> Exported:
    """Check an exported adapter (the tar `GET /v1/adapter` answers) against the digest the
    gateway sent with it, unpack it to `out/<tenant>/` (`hotloop.adapters.unpack`: the two
    adapter files, nothing else) and record its version and digest beside it
    (`out/<tenant>.json`). Raises InvalidArgument for bytes that are not what was announced."""
    from hotloop import adapters
    from hotloop.errors import InvalidArgument

    if adapters.sha256(tar_bytes) != sha256:
        raise InvalidArgument(f"tenant {tenant!r} v{version}: the export's bytes do not match "
                              f"its digest {sha256[:12]}")
    target = adapters.unpack(tar_bytes, out / tenant)
    (out / f"{tenant}.json").write_text(json.dumps({"version": version, "sha256": sha256}))
    return Exported(tenant, version, sha256, target)


def load_exports(run_dir: Path) -> dict[str, Exported]:
    """The adapters a run exported, by tenant."""
    found = {}
    for meta in sorted((run_dir / ADAPTERS).glob("*.json")):
        m = json.loads(meta.read_text())
        found[meta.stem] = Exported(meta.stem, int(m["version"]), m["sha256"], meta.with_suffix(""))
    return found


def load_answers(requests: Path, tenant: str, version: int, prompts: tuple[str, ...]) -> list[Answer]:
    """Every answer in `requests` (a user simulation's JSON lines) that `version` gave from
    its first token to its last."""
    out = []
    for line in requests.read_text().splitlines():
        r = json.loads(line)
        if r.get("error") or not r.get("answer") or not (r["version"] == r["last_version"] == version):
            continue
        out.append(Answer(tenant, version, r["response_id"], prompts[r["prompt"]], r["answer"],
                          r["finish_reason"] == "length"))
    return out


class Scorer:
    """The base model with every exported adapter loaded beside it (peft), scoring answers."""

    def __init__(self, model: Path, adapters: dict[str, Path], threads: int | None = None):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(str(adapters[name]), adapter_name=name)
        self.model.eval()
        self.names = names

    def score(self, answer: Answer) -> dict[str, float]:
        """The answer's log-likelihood after its prompt (nats), under "base" and each adapter,
        and its token count ("tokens")."""
        torch, tok = self.torch, self.tok
        prompt = tok.apply_chat_template([{"role": "user", "content": answer.prompt}],
                                         add_generation_prompt=True, tokenize=False)
        p = tok.encode(prompt, add_special_tokens=False)
        a = tok.encode(answer.text, add_special_tokens=False)
        if not answer.cut_off and tok.eos_token_id is not None:
            a.append(tok.eos_token_id)  # the model chose to end there: part of what it wrote
        ids = torch.tensor([p + a])
        out = {"tokens": float(len(a))}
        with torch.no_grad():
            with self.model.disable_adapter():
                out["base"] = self._loglik(ids, len(p))
            for name in self.names:
                self.model.set_adapter(name)
                out[name] = self._loglik(ids, len(p))
        return out

    def _loglik(self, ids, start: int) -> float:
        logits = self.model(input_ids=ids).logits[0, start - 1:-1].float()
        return float(self.torch.log_softmax(logits, -1).gather(-1, ids[0, start:, None]).sum())


def verdicts(answer: Answer, scores: dict[str, float], others: list[str], margin: float) -> dict:
    """One scored answer: the model that explains it best, its own adapter's margin over the
    best other tenant's (negative: another explains it better) and over the base."""
    own = scores[answer.tenant]
    best_other = max(others, key=lambda n: scores[n]) if others else None
    models = ["base", answer.tenant, *others]
    return {"response_id": answer.response_id, "tokens": int(scores["tokens"]),
            "best": max(models, key=lambda n: scores[n]),
            "own_minus_other": own - scores[best_other] if best_other else None,
            "other": best_other, "own_minus_base": own - scores["base"],
            # another tenant's adapter explains it best of all, and its own by the margin: an
            # answer the base explains best is no evidence of another adapter (measured: a
            # base-like answer of `direct`'s, 10.8 nats likelier under the base than under its
            # own adapter, was 4.4 likelier under `short`'s, a lineage barely off the base)
            "wrong": best_other is not None and scores[best_other] - own > margin
            and scores[best_other] >= scores["base"]}


def summarize(tenant: str, exported: Exported, n_answers: int, rows: list[dict]) -> dict:
    def p50(xs):
        return statistics.median(xs) if xs else None

    best = {"own": 0, "base": 0, "other": 0}
    for r in rows:
        best["own" if r["best"] == tenant else "base" if r["best"] == "base" else "other"] += 1
    tokens = sum(r["tokens"] for r in rows)
    margins = [r["own_minus_other"] for r in rows if r["own_minus_other"] is not None]
    return {"version": exported.version, "sha256": exported.sha256, "answers": n_answers,
            "sampled": len(rows), "best": best,
            "other_tenant_answers": [r["response_id"] for r in rows if r["wrong"]],
            "own_minus_other_nats": {"min": min(margins) if margins else None, "p50": p50(margins)},
            # the sample's own-vs-base log-likelihood ratio per token: the served lineage's
            # distance from the base, as its answers show it
            "own_minus_base_per_token": sum(r["own_minus_base"] for r in rows) / tokens if tokens else None,
            "rows": rows}


def audit_run(run_dir: Path, model: str | None = None, per_tenant: int = 20, margin: float = MARGIN_NATS,
              seed: int = 0, threads: int | None = None, prompts: tuple[str, ...] | None = None) -> dict:
    """Audit a tenant demo's run (see the module's doc); writes `<run_dir>/tenants-audit.json`
    and returns what it wrote. `model`: the base (default: what the first adapter names)."""
    from tqdm import tqdm

    from hotloop.models import resolve

    if prompts is None:
        from measure.users import TENANT_PROMPTS as prompts
    run_dir = Path(run_dir)
    exports = load_exports(run_dir)
    if not exports:
        raise FileNotFoundError(f"{run_dir / ADAPTERS}: no exported adapters (<tenant>.json + <tenant>/)")
    if model is None:
        first = next(iter(exports.values()))
        model = json.loads((first.path / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = resolve(model)
    rng = random.Random(seed)
    answers: dict[str, list[Answer]] = {}
    sampled: dict[str, list[Answer]] = {}
    for t, e in exports.items():
        requests = run_dir / f"requests-{t}.jsonl"
        answers[t] = load_answers(requests, t, e.version, prompts) if requests.exists() else []
        sampled[t] = rng.sample(answers[t], min(per_tenant, len(answers[t])))
    scorer = Scorer(base, {t: e.path for t, e in exports.items()}, threads)
    total = sum(map(len, sampled.values()))
    tenants = {}
    # A bar on a terminal; none in a log file (`disable=None`), where carriage returns pile up.
    with tqdm(total=total, desc="[audit] answers scored", unit="answer", disable=None) as bar:
        for t, e in exports.items():
            others = [o for o in exports if o != t]
            rows = []
            for a in sampled[t]:
                rows.append(verdicts(a, scorer.score(a), others, margin))
                bar.update()
            tenants[t] = summarize(t, e, len(answers[t]), rows)
    report = {"model": str(base), "margin_nats": margin, "per_tenant": per_tenant, "tenants": tenants,
              "other_tenant_answers": sum(len(s["other_tenant_answers"]) for s in tenants.values()),
              "sampled": total}
    (run_dir / "tenants-audit.json").write_text(json.dumps(report, indent=2))
    return report


def lines(report: dict) -> list[str]:
    """The audit as Markdown lines (a table per tenant row)."""
    out = ["| tenant | version | sampled of | best: own / base / other | own over the best other, "
           "nats (min / p50) | own over base per token | from another tenant's adapter |",
           "|---|---|---|---|---|---|---|"]
    def f(x, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for t, s in report["tenants"].items():
        b, m = s["best"], s["own_minus_other_nats"]
        out.append(f"| {t} | v{s['version']} | {s['sampled']} of {s['answers']} | {b['own']} / {b['base']} / "
                   f"{b['other']} | {f(m['min'], '.1f')} / {f(m['p50'], '.1f')} | "
                   f"{f(s['own_minus_base_per_token'], '+.3f')} | {len(s['other_tenant_answers'])} |")
    return out


def main(args) -> int:
    """`hotloop audit tenants RUN`."""
    from hotloop.models import ModelError

    if args.answers < 1 or args.margin < 0:
        print("hotloop audit tenants: --answers must be at least 1 and --margin at least 0",
              file=sys.stderr)
        return 2
    try:
        report = audit_run(Path(args.run), args.model, args.answers, args.margin, args.seed)
    except (FileNotFoundError, ValueError, KeyError, ModelError) as e:
        print(f"hotloop audit tenants: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines(report)))
    n = report["other_tenant_answers"]
    print(f"{n} of {report['sampled']} sampled answers are best explained by another tenant's adapter, "
          f"and better than by their own by more than {report['margin_nats']:g} nats; "
          f"{Path(args.run) / 'tenants-audit.json'}")
    return 1 if n else 0
