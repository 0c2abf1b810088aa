"""`hotloop demo-tenants` (`make demo-tenants`): three tenants on one engine, each with users of
its own who like something different, each tenant's model learning its own users' taste live.

Tenants (`TENANTS`, or `--tenants`): `short` (complete answers of 15 to N words:
`measure.users.Brevity`), `direct` (its first sentence says "you": `Direct`), `exclaim` (its
first sentence ends with "!": `Exclaim`). On the base model these three do not co-vary (see
`Direct` and `Exclaim`), so a rise of one in another tenant's answers is something that
tenant's lineage learned beside its own, and each is met on every kind of prompt. `bullets`
(lists: `Bullets`) is not a default: it is met on the requests for a list and almost nowhere
else, so twice its base rate asks for a habit on a third of the prompts, at a target that moves
with the few list answers of the idle phase.
Every tenant's users ask the same prompts (`TENANT_PROMPTS`, each drawn from a deck: every
prompt once before any again, `PromptDeck`), so each preference's base rate is the same for all
of them before training, and a rise of another tenant's preference in a
tenant's answers (`cross_delta_max`) is a leak, not a different prompt mix.

Owns:
- the tenants' API keys (one per tenant, a key file of `id:key` lines) and their `[tenants]`
  config, given to the mesh as overrides;
- which trainer processes learn the lineages (`trainer_plan`: by default the mesh's one
  trainer with a lane per tenant, `[online] tenants`, whose fair share on trained tokens keeps
  a fast-rating tenant from starving the others; or one `hotloop train online` per tenant);
- the phases: warm-up, idle (users only: each preference's base rate on the base model, every
  tenant's answers pooled, at least `--idle-answers` of them), training (each tenant's users
  rate answers by its preference; once a block of `--window` of a tenant's answers meets its
  target (twice its base rate by default) by more than its noise, its users pause rating, its
  lineage is held at the version it serves (the admin API's hold), and
  `--check-answers` answers of that version confirm the target, so they stop rating for good
  and the lineage stays held, or send them back to rating and resume it (`advance`), unless
  `--keep-rating`; the phase ends once every tenant's target was confirmed, unless
  `--no-stop`, or after `--train-s`; a tenant no check confirmed then goes back to the checked
  version that met its target best, if it serves another: `rollback_choice`, the admin API's
  reset with a version), evaluation (users only again, until every tenant's final version gave `--eval-answers`
  answers since its lineage stopped learning: the final shares, `final_answers`), then each
  tenant's adapter exported with the tenant's own key and, once the mesh has stopped, the
  audit (`apps.audit`): a sample of each tenant's answers scored under every tenant's adapter
  and the base, so the report says from the tokens, not only from the labels, whose weights
  wrote them;
- the learning (`training_overrides`): the KL penalty to the base model (`--kl-beta`, its
  reference computed in the trainer), what keeps each lineage near the base model beside what its
  users reward, the learning rate (`--lr`), and each update's baseline (its other feedback);
- the report `runs/<id>/tenants-report.{json,md}` and `tenants.png`: per tenant its share of
  its preference (base, final, target), the other preferences' rise in its answers, how long
  its answers are (cut off at the token limit, median words: `length`), the loop
  latency of its lineage (`LoopTracker` on the tenant's subject and its lane's metrics), the
  feedback its trainer trained and whose it was, its training turns (updates, tokens, time
  waiting for its turn: the fairness), and answers served from another lineage than the key's.

Does not own: the stack's start-up (`launch.stack`), the loop bookkeeping (`measure.loop`), the users and the
preferences (`measure.users`). Imports nothing from `services/` but the trainer's config
section, to see whether one trainer can learn several lineages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from hotloop.service import run_interruptible

from apps.audit import ADAPTERS
from apps.online_demo import WARMUP_MAX_S, loop_summary, target_share
from launch.processes import sigterm_interrupts
from launch.stack import DEFAULT_CONFIG, TRAINER_RUN, Stack, start_stack
from measure.loop import LoopTracker
from measure.users import (
    PREFERENCES,
    TENANT_PROMPTS,
    Preference,
    Record,
    SimConfig,
    Simulation,
    SlidingShare,
    Target,
    percentile,
)

TENANTS = ("short", "direct", "exclaim")
CROSS_LIMIT = 0.1  # the issue's bound on another preference's rise in a tenant's answers
PHASE_MAX_S = 600.0  # the longest the idle and evaluation phases wait for their answers
CLOSE_S = 20.0  # the longest the clean-up waits for the users' last requests, and for the trackers
# the gateway's export headers (services/gateway/http.py; apps import no service)
POLICY_VERSION_HEADER = "X-Hotloop-Policy-Version"
ADAPTER_SHA_HEADER = "X-Hotloop-Adapter-Sha256"
log = logging.getLogger(__name__)


def preferences(tenants: tuple[str, ...] | list[str] = TENANTS, max_words: int = 60, min_items: int = 2,
                min_words: int = 15, min_item_words: int = 4) -> dict[str, Preference]:
    """Each tenant's hidden preference, a tenant named after its users' preference (`--tenants`:
    any of `measure.users.PREFERENCES`). Base rates on `TENANT_PROMPTS`:
    see there (measure/users.py). `short` counts complete answers only (`Brevity.complete`):
    counted in words within the token limit, it rose in any lineage that learned a style of
    more tokens per word."""
    params = {"short": {"max_words": max_words, "min_words": min_words, "complete": True},
              "bullets": {"min_items": min_items, "min_item_words": min_item_words}}
    unknown = [t for t in tenants if t not in PREFERENCES]
    if unknown or len(set(tenants)) != len(tenants) or not tenants:
        raise ValueError(f"--tenants {','.join(tenants)}: name each tenant once, from "
                         f"{', '.join(PREFERENCES)}")
    return {t: PREFERENCES[t](**params.get(t, {})) for t in tenants}


# ---- keys and trainers ------------------------------------------------------------------------


def make_keys(path: Path, tenants: list[str]) -> dict[str, str]:
    """One API key per tenant, written as `<tenant>-user:<key>` lines (mode 0600); returns
    tenant -> key. The key id is what `[tenants.<name>] keys` names."""
    keys = {t: f"sk-hotloop-{secrets.token_hex(24)}" for t in tenants}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text("".join(f"{key_id(t)}:{k}\n" for t, k in keys.items()))
    return keys


def key_id(tenant: str) -> str:
    return f"{tenant}-user"


def tenant_overrides(keys_file: Path, tenants: list[str]) -> list[str]:
    """The mesh's `[security] user_tokens_file` and `[tenants.<name>] keys`."""
    return [f"security.user_tokens_file={keys_file}",
            *(f'tenants.{t}.keys=["{key_id(t)}"]' for t in tenants)]


KL_TARGET = 0.1  # per token, to the base model: where coherent lineages met their targets
KL_LAST = 10  # the report's KL of a lineage: the median of its last this many updates
NEGATIVE_WEIGHT = 0.25  # what a rating below the baseline teaches, against one above it
KL_HORIZON = 20  # feedback over which the KL coefficient may move by e^0.2 (the mesh's: 2)
BATCH_SIZE = 4  # feedback one update of a lineage takes, newest first (the mesh's: 2)
MAX_WAIT_S = 30.0  # feedback that waited longer for its lineage's turn is shed (the mesh's: 3)
CHECK_MARGIN_SE = 1.5  # a check confirms a version at its target plus this many standard errors
SERVE_AVERAGE = 0.8  # users are served a running average of each lineage's adapter


def training_overrides(kl_beta: float, lr: float, max_tokens: int) -> list[str]:
    """The demo's learning: the KL penalty to the base model (`[trainer.loss] kl_beta`), the
    exact KL over the vocabulary at every token (`kl_estimator = "full"`: with k3 lineages
    learned what their users did not ask for beside what they did, `exclaim` going short in
    four runs; with the exact KL more rarely), its reference
    from the trainer's own base with the adapter disabled (`[online] reference =
    "colocated"`: on 2 cores a reference process slowed the engine and the trainer; and only
    there are the base's whole distributions at hand), the LoRA learning rate (`[trainer.optimizer] lr`), each
    update's feedback baselined by its own other scores (`[online] leave_one_out`), and each
    lineage's KL coefficient steered toward a per-token KL of `KL_TARGET` (`[online]
    kl_target`, starting at `kl_beta`), and each answer's loss summed over its tokens and
    divided by the requests' `max_tokens` (`[trainer.loss] aggregation = "constant"`): divided
    by its own length, as "token" does in an update of one answer, a short rated answer moved
    its probability up to `max_tokens / length` times as far as a long one.
    Measured: without the KL the lineages collapsed onto one reply each; with it, lr 1e-3
    learned too slowly for a 900 s run and 2e-3 met every target in some runs. Against the
    running baseline, which lags the scores, updates pushed every answer down while a lineage
    scored below it, and lineages wandered into incoherent text; larger batches (6, gathered
    for 12 s) did not fix that and doubled the loop. With a fixed coefficient the lineages
    that turned incoherent had drifted to a per-token KL of 0.3-0.7; those that met their
    targets did at 0.03-0.1. A rating below the baseline weighs `NEGATIVE_WEIGHT` of itself
    (`[online] negative_weight`): `bullets`, three ratings in four at -1, stayed at its base
    over 242 updates without it and met its target with it in 2 of 5 runs, in none of 9
    without. Users are served each lineage's running average (`[online] serve_average` =
    `SERVE_AVERAGE`: after each update s <- 0.8 s + 0.2 theta, published as the version): on
    2 cores an update holds one rating once the first queue is gone, adjacent versions then
    differ by as much as 0.4 in a preference's share (one version of `short` at 0.16 inside a
    stretch at 0.43), and the version a check holds is one of the tens a block of answers
    spans; averaged, a version moves a fifth of an update. With the k3 estimate the average
    slowed `exclaim`; with the exact KL every check confirmed or refused what its blocks had
    seen. The coefficient moves at most e^0.2 per `KL_HORIZON` feedback (`[online]
    kl_horizon`): at the mesh's 2 it rose to 0.64 and `short`, met, fell back to 0.00; at 20
    it stays at 0.11-0.16. Three lanes take turns on one trainer core at ~1.3 s of trainer
    time per feedback (the step shares the layers below the adapter with its reference
    pass), so a rating waits for its lineage's turn: at the mesh's `max_wait_s` of 3 s a
    fifth of them were shed unused and each update held one. The demo takes up to
    `BATCH_SIZE` per update and sheds only past `MAX_WAIT_S`: the trainer core still bounds
    how many ratings teach (276-395 in 711-900 s of training), but 22-40% of the updates hold
    two or more, which `leave_one_out` baselines by each other, and what is shed is the
    surplus of a tenant rating faster than its share of turns (measured: `short` shed 107 of
    its 180 ratings, `direct` 23 of 182), at the cost of a longer loop (p50 14-23 s, p95 ~42
    s, against 13-14 s and 20-26 s)."""
    kl = [f"trainer.loss.kl_beta={kl_beta:g}", "trainer.loss.kl_estimator=full",
          "online.reference=colocated", f"online.kl_target={KL_TARGET:g}"
          ] if kl_beta > 0 else ["trainer.loss.kl_beta=0"]
    return [*kl, f"trainer.optimizer.lr={lr:g}", "online.leave_one_out=true",
            f"online.negative_weight={NEGATIVE_WEIGHT:g}", f"online.kl_horizon={KL_HORIZON}",
            f"online.serve_average={SERVE_AVERAGE:g}",
            f"online.batch_size={BATCH_SIZE}", f"online.max_wait_s={MAX_WAIT_S:g}",
            "trainer.loss.aggregation=constant", f"trainer.loss.norm_tokens={max_tokens}"]


def shared_trainer_built() -> bool:
    """Whether one online trainer can learn several lineages (`[online] tenants`)."""
    from services.trainer.config import OnlineConfig

    return "tenants" in OnlineConfig.model_fields


@dataclass
class TrainerPlan:
    """Which trainer processes learn the tenants' lineages, and where each lineage's step
    records are (a lane's `metrics.jsonl`)."""

    mode: str  # "per-tenant" | "shared"
    overrides: list[str]  # for every process of the mesh
    trainers: dict[str, list[str]] | None  # `start_stack`'s: name -> its own overrides
    metrics: dict[str, Path]  # tenant -> its lineage's metrics.jsonl


def trainer_plan(mode: str, tenants: list[str], out: Path) -> TrainerPlan:
    """The one place that decides how the tenants' trainers run. `per-tenant`: a `hotloop train
    online` process per tenant (`[online] tenant`, run id `trainer-<tenant>`). `shared`: the
    mesh's trainer role with `[online] tenants` (one process, one base model, a lane per tenant
    under `<out>/trainer/tenants/<tenant>/`: `lane_dir` in services/trainer/tenants/lanes.py,
    with `start_stack`'s `online.out_dir` and run id), following the tenant registry
    (`[online] follow_registry`). Either way a check holds the lineage it checks (`advance`):
    every trainer applies the registry's hold of its lineages (services/trainer/tenants/follow.py). `auto`:
    shared where the trainer has it, else per tenant."""
    if mode == "auto":
        mode = "shared" if shared_trainer_built() else "per-tenant"
    if mode == "shared":
        if not shared_trainer_built():
            raise ValueError("--trainers shared: this trainer learns one lineage per process "
                             "([online] has no `tenants`); use --trainers per-tenant")
        names = json.dumps(tenants)
        return TrainerPlan(mode, [f"online.tenants={names}", "online.follow_registry=true"], None,
                           {t: out / TRAINER_RUN / "tenants" / t / "metrics.jsonl" for t in tenants})
    if mode != "per-tenant":
        raise ValueError(f"--trainers {mode}: use auto, per-tenant or shared")
    return TrainerPlan(mode, [], {f"trainer-{t}": [f"online.tenant={t}", f"online.run_id=trainer-{t}"]
                                  for t in tenants},
                       {t: out / f"trainer-{t}" / "metrics.jsonl" for t in tenants})


# ---- the demo ---------------------------------------------------------------------------------


@dataclass
class TenantRun:
    """One tenant during the demo: its users, its lineage's tracker, its target."""

    name: str
    preference: Preference
    sim: Simulation
    tracker: LoopTracker
    base: float | None = None  # its preference's base rate when training began (idle answers
    # of every tenant finished by then: the target is set from it)
    target: float | None = None
    reached_at: float | None = None  # unix seconds a check confirmed its version at the target
    # (`--keep-rating`: its window first met the target beyond its noise, `met_target`)
    learned_until: float | None = None  # unix seconds its lineage stopped learning: a check
    # confirmed its version at the target (its users stop rating), or training ended
    rating_since: float | None = None  # unix seconds its users (last) began to rate
    blocks_read: int = 0  # blocks of `window` answers since then that the stop rule has read
    paused_at: float | None = None  # unix seconds its users stopped rating to check the
    # lineage's version against the target (None: rating, or done)
    checks: list[dict] = field(default_factory=list)  # every check: when, which version, on
    # how many answers, their share, accepted or not
    rollback: dict | None = None  # training ended unconfirmed: the checked version it went
    # back to (`rollback_choice`), or why it could not


@dataclass
class Phases:
    """How long each phase of the demo lasts. No defaults here: `hotloop demo-tenants`'s flags
    hold them (one place), and this is built from them."""

    idle_s: float
    """Users only, on the base model, at least this long..."""
    idle_answers: int
    """... and until every tenant's idle answers together number this many (the base rates'
    sample; at most `PHASE_MAX_S` more). A target is twice its base rate, so the base's noise
    doubles into it: from 150 answers `short`'s target drew 0.32-0.43 across runs (one
    standard error of the target ~0.065), from 300 ~0.046, for ~75 s more of idle phase:
    the flag's default is 300."""
    train_s: float
    """The longest training phase."""
    target_factor: float
    """A tenant's target: this many times its preference's base rate (at most 0.8)."""
    until_target: bool
    """End training once a check confirmed every tenant's version at its target."""
    stop_rating: bool
    """A tenant at its target stops rating (its users keep asking), so its lineage stays where
    it met its users' taste while the others catch up (`advance`: once a block of `window`
    answers meets the target its users pause, and `check_answers` fresh answers of the version
    it then serves confirm it or send them back to rating). Else it keeps rating, and the
    shared trainer's fair share keeps its faster feedback from starving the others, but its
    lineage goes on moving: measured, it drifted along other preferences as well."""
    check_answers: int
    """A check's sample: this many answers of the version a paused tenant serves, to requests
    sent after its users paused."""
    eval_answers: int
    """After training, users only again until every tenant's final version gave this many
    answers since its lineage stopped learning (the final shares, `final_answers`; at most
    `PHASE_MAX_S`). 0: no evaluation."""
    export: bool
    """At the end (the mesh still up), each tenant's latest adapter is exported with its own
    key (`GET /v1/adapter`) into `<out>/adapters/`, for the audit (`apps.audit`)."""


@dataclass
class TenantsState:
    """Everything the report needs; filled while the demo runs, so an interrupted demo still
    reports what it saw."""

    run_id: str
    out: Path
    prefs: dict[str, Preference]
    window: int
    trainers: str = ""
    runs: dict[str, TenantRun] = field(default_factory=dict)
    training_started: float | None = None
    training_ended: float | None = None
    gateway_counters: dict = field(default_factory=dict)
    exports: dict = field(default_factory=dict)  # tenant -> exported version, or why not
    audit: dict | None = None  # `apps.audit.audit_run`'s report, or {"error": ...}
    interrupted: bool = False
    failed: str = ""
    settings: dict = field(default_factory=dict)


def ok_records(records: list[Record], phase: str, since: float = 0.0) -> list[Record]:
    return [r for r in records if r.phase == phase and not r.error and r.ts >= since]


def share(records: list[Record], pref: Preference) -> float | None:
    """The share of `records` meeting `pref`, judged on their text (and whether it was cut off)."""
    return sum(r.meets(pref) for r in records) / len(records) if records else None


def base_rates(state: TenantsState) -> dict[str, float | None]:
    """Each preference's share of the idle answers of every tenant together: all of them come
    from the base model on the same prompts, so pooling is one sample three times the size."""
    idle = [r for run in state.runs.values() for r in ok_records(run.sim.records, "idle")]
    return {name: share(idle, pref) for name, pref in state.prefs.items()}


def length(records: list[Record]) -> dict[str, float | None]:
    """How long `records`' answers are: the share cut off at the token limit and the median
    word count. Beside the preferences, what a lineage learns unasked: no user rates length but
    `short`'s, and the KL to the base holds it loosely (most lineages go to answers that run
    to the token limit, a few to short greetings; docs/results.md, "Many tenants (`make
    demo-tenants`)")."""
    return {"cut_off": sum(r.cut_off for r in records) / len(records) if records else None,
            "words_p50": percentile((r.words for r in records if r.words is not None), 50)}


def final_window(run: TenantRun, since: float, window: int) -> list[Record]:
    """The tenant's last `window` answers of the training phase."""
    return ok_records(run.sim.records, "training", since)[-window:]


def final_version(run: TenantRun) -> int:
    """The newest version of the tenant's lineage: announced, or seen in an answer."""
    served = (r.last_version or 0 for r in run.sim.records if not r.error)
    return max(max(run.tracker.published_at, default=0), max(served, default=0))


def version_answers(run: TenantRun, since: float, version: int) -> list[Record]:
    """Every answer `version` gave first token to last, to a request of the training phase or
    the evaluation sent at or after `since`."""
    return [r for r in run.sim.records if r.phase in ("training", "eval") and not r.error
            and r.ts >= since and r.version == r.last_version == version]


def final_answers(run: TenantRun, since: float, window: int) -> tuple[list[Record], str]:
    """What the tenant's final shares are measured on, and which:
    - "final_version": every answer its lineage's final version gave, first token to last,
      to a request sent after the lineage stopped learning (`learned_until`: its users stopped
      rating at its target, or training ended), in the training phase and the evaluation
      alike. A lineage frozen at its target early has hundreds of these, a far smaller noise
      than an evaluation of 60; the answers before the stop are left out, since the stop was
      decided on them (a window that met its target is a lucky one as often as not);
    - "training", without any of those (a run stopped before): the last `window` answers of
      training."""
    if run.learned_until is not None:
        last = version_answers(run, run.learned_until, final_version(run))
        if last:
            return last, "final_version"
    return final_window(run, since, window), "training"


def met_target(window: list[Record], pref: Preference, target: float, size: int) -> bool:
    """Whether a full window of `size` answers meets `target` by more than its sampling noise
    (one standard error of a share at the target): a window of 40 at a true share of 0.20
    touches 0.27 by chance, and a lineage frozen on such a lucky window falls back below its
    target in the evaluation (measured: bullets 0.28 in its window, 0.16 evaluated)."""
    return len(window) == size and share(window, pref) >= target + standard_error(target, size)


def advance(run: TenantRun, now: float, window: int, check_answers: int,
            margin_se: float = CHECK_MARGIN_SE) -> str | None:
    """One turn of the stop rule of a tenant still learning (`Phases.stop_rating`); returns
    what changed: "paused", "accepted", "resumed", or None.

    - Rating: its answers since its users began to rate are read in consecutive blocks of
      `window`, each once, when it is complete; once a block meets the target by more than
      its noise (`met_target`, the check's own margin), they pause (keep asking, stop rating,
      also what they are reading), and the caller holds its lineage (`hold`), so it stops
      moving: without the hold, the feedback sent before the pause goes on training (measured:
      `short` checked the version two updates later, back at its base share (0.15), where the
      block had met its target at 0.6). Not a sliding window: read again after every answer,
      hundreds of times a run, it crosses the bar by chance far more often than one sample of
      `window` does and is read at its luckiest, so the checks refused most pauses, even of
      versions a fifth of an update apart. A block lags the lineage it measures (a tenant's
      3 users finish 0.2-0.35 answers a second while its lineage publishes a version every
      3-10 s): stopping on it went on training past the target (a target of 0.30 ended at
      0.71), and the further a lineage goes, the more it moves its other styles too.
    - Paused: once the version it then serves (the newest: an update under way when the hold
      came lands first, and without a hold feedback sent before the pause still trains) gave
      enough answers to requests sent after the pause, their share decides: at or above the
      target by `margin_se` standard errors of `check_answers` answers, accepted, its lineage
      is done (it stays held) and its users stay silent; below, they resume rating, the
      caller resumes the lineage, and the next block counts from then. Decided as soon as
      the rest of `check_answers` cannot change the verdict (the same verdict, sooner: a
      check of 40 took 200 s). The block that
      triggered the check is not its evidence: a block that met a target by chance is as
      likely as one that met it by learning, and a lineage frozen on one falls back below
      the target (measured: 0.46 targeted, window at it, 0.37 after). Why 1.5 standard
      errors (`CHECK_MARGIN_SE`), not one as for a block: the check accepts, and a version
      accepted is judged on its final share at the target. With 40 answers at a target of
      0.35, one standard error accepts a version truly at 0.35 one time in eight, 1.5 one
      time in fourteen (one at 0.45: 0.56 and 0.44 of the time), and both misses of that kind
      were versions at or below their target accepted on a lucky check (`direct` 0.44 of 39,
      then 0.30; `short` 0.50 of 40, then 0.37 of 360)."""
    if run.learned_until is not None or run.target is None:
        return None
    if run.paused_at is None:
        rated = ok_records(run.sim.records, "training", run.rating_since or 0.0)
        complete = len(rated) // window
        if complete == run.blocks_read:  # no new block to read
            return None
        run.blocks_read = complete
        if not met_target(rated[(complete - 1) * window:complete * window], run.preference,
                          run.target, window):
            return None
        run.paused_at, run.sim.cfg.feedback = now, False
        return "paused"
    version = final_version(run)
    fresh = version_answers(run, run.paused_at, version)[:check_answers]
    hits = sum(r.meets(run.preference) for r in fresh)
    bar = run.target + margin_se * standard_error(run.target, check_answers)
    need = math.ceil(bar * check_answers - 1e-9)
    # decided as soon as the rest of the sample cannot change the verdict
    if hits < need and hits + check_answers - len(fresh) >= need:
        return None
    accepted = hits >= need
    run.checks.append({"at": now, "paused_at": run.paused_at, "version": version,
                       "answers": len(fresh), "share": share(fresh, run.preference),
                       "accepted": accepted})
    if accepted:
        run.reached_at = run.learned_until = now
        return "accepted"
    run.paused_at, run.rating_since, run.sim.cfg.feedback = None, now, True
    run.blocks_read = 0
    return "resumed"


def rollback_choice(run: TenantRun) -> dict | None:
    """For a tenant whose target no check confirmed when training ended: the check whose
    version met the target best (its share at or above the target, refused only for falling
    short of the margin), when that version is not the one it serves. The lineage wanders on
    after a refused check, and can end below where a check had measured it (`short`: two
    checks at 0.41 of 37 against a target of 0.35, its final version 0.21): the demo then
    serves that version again, as an operator would (`POST /admin/tenants/<name>/reset` with
    the version). The choice is made on the check's answers, so the final share is measured
    on fresh ones only (`learned_until` is set when the version serves)."""
    if run.reached_at is not None or run.target is None:
        return None
    met = [c for c in run.checks if c["version"] and c["share"] is not None
           and c["share"] >= run.target]
    if not met:
        return None
    best = max(met, key=lambda c: (c["share"], c["version"]))
    return best if best["version"] != final_version(run) else None


def standard_error(p: float | None, n: int) -> float | None:
    """The standard error of a share `p` of `n` answers (binomial)."""
    return (p * (1 - p) / n) ** 0.5 if p is not None and n else None


def wrong_adapter(run: TenantRun, r: Record) -> bool:
    """An answer to this tenant's key from another lineage than its own: the gateway's
    X-Hotloop-Tenant names another (or none), or it was served by a version its own lineage
    never announced; refusals of the gateway ("lineage of tenant ...") count too."""
    if r.error:
        return "lineage of tenant" in r.error
    newest = max(run.tracker.published_at, default=0)
    return r.tenant != run.name or (r.version is not None and r.version > newest)


def tenants_status(state: TenantsState, t0: float) -> str:
    parts = [f"{time.monotonic() - t0:5.0f}s"]
    for run in state.runs.values():
        recent = SlidingShare(state.window)
        for r in run.sim.records:
            if not r.error:
                recent.add(r.meets(run.preference))
        v = recent.value
        target = f"/{run.target:.2f}" if run.target is not None else ""
        parts.append(f"{run.name} v{run.sim.clock.latest} (trained v{run.tracker.trained_version}) "
                     f"{'-' if v is None else f'{v:.2f}'}{target} n{len(run.sim.records)}")
    return "  ".join(parts)


async def run_tenants(state: TenantsState, stack: Stack, keys: dict[str, str], metrics: dict[str, Path],
                      users: int, phases: Phases, max_tokens: int, progress_s: float) -> None:
    """The phases (`Phases`): warm-up, idle, training, evaluation; a check holds the lineage
    it checks (`hold`)."""
    cfgs = []
    for i, (name, pref) in enumerate(state.prefs.items()):
        tracker = LoopTracker(stack.info.nats_url, metrics[name], tenant=name)
        await tracker.start()
        cfg = SimConfig(users=users, duration_s=WARMUP_MAX_S + phases.idle_s + phases.train_s + 2 * PHASE_MAX_S,
                        max_tokens=max_tokens,
                        feedback=False, phase="warmup", window=state.window, progress_s=0, seed=i)
        cfgs.append(cfg)
        sim = Simulation(Target(stack.target.base_url, keys[name]), cfg, pref,
                         state.out / f"requests-{name}.jsonl", prompts=TENANT_PROMPTS)
        state.runs[name] = TenantRun(name, pref, sim, tracker)
    runs = list(state.runs.values())
    tasks = [asyncio.create_task(run.sim.run()) for run in runs]
    t0 = time.monotonic()
    progress = asyncio.create_task(_progress(state, t0, progress_s))

    def phase(name: str, feedback: bool) -> None:
        for cfg in cfgs:
            cfg.phase, cfg.feedback = name, feedback

    def running() -> bool:
        return not any(t.done() for t in tasks)

    try:
        while running() and time.monotonic() - t0 < WARMUP_MAX_S and \
                any(len(run.sim.records) < users for run in runs):
            await _tick(tasks, stack, state)
        phase("idle", False)
        idle_until = time.monotonic() + phases.idle_s

        def idle_answers() -> int:
            return sum(len(ok_records(run.sim.records, "idle")) for run in runs)

        # ... and until the tenants' idle answers are enough of a sample (the targets are set
        # from them, and the cross rises measured against them), every tenant's among them
        while running() and (time.monotonic() < idle_until or (
                time.monotonic() < idle_until + PHASE_MAX_S
                and (idle_answers() < phases.idle_answers
                     or not all(ok_records(run.sim.records, "idle") for run in runs)))):
            await _tick(tasks, stack, state)
        base = base_rates(state)
        for run in runs:
            run.base = base[run.name]
            run.target = target_share(run.base, phases.target_factor)
        if running():
            n = sum(len(ok_records(run.sim.records, "idle")) for run in runs)
            print(f"[demo-tenants] idle phase: {n} answers; base rates "
                  + ", ".join(f"{k} {_f(v)}" for k, v in base.items())
                  + "; targets " + ", ".join(f"{run.name} {run.target:.2f}" for run in runs),
                  flush=True)
        phase("training", True)
        state.training_started = time.time()
        for run in runs:
            run.rating_since = state.training_started
        train_until = time.monotonic() + phases.train_s
        while running() and time.monotonic() < train_until:
            await _tick(tasks, stack, state)
            for run in runs:
                if phases.stop_rating:
                    # a paused or finished tenant's users keep asking (its share stays
                    # measured) but do not rate: its lane goes idle and leaves the trainer to
                    # the tenants still learning
                    event = advance(run, time.time(), state.window, phases.check_answers)
                    _say(run, event, state.training_started)
                    if event in ("paused", "resumed"):
                        await hold(stack, run.name, event == "paused")
                elif run.reached_at is None and met_target(
                        final_window(run, state.training_started, state.window), run.preference,
                        run.target, state.window):
                    run.reached_at = time.time()
                    print(f"[demo-tenants] {run.name}: its window met the target after "
                          f"{run.reached_at - state.training_started:.0f} s of training", flush=True)
            if phases.until_target and all(run.reached_at is not None for run in runs):
                break
        state.training_ended = time.time()
        for run in runs:
            run.learned_until = run.learned_until or state.training_ended
        for run in runs:
            if running() and (best := rollback_choice(run)) is not None:
                await roll_back(stack, run, best)

        def evaluated(run: TenantRun) -> int:
            last, measured_on = final_answers(run, state.training_started, state.window)
            return len(last) if measured_on == "final_version" else 0

        if running() and phases.eval_answers:
            # the final shares: users only, until every tenant's final version gave enough
            # answers since its lineage stopped learning (a lineage frozen at its target early
            # has them already; an update of feedback still in flight may land in this phase)
            phase("eval", False)
            print(f"[demo-tenants] training over; evaluating each tenant's final version on at "
                  f"least {phases.eval_answers} answers without feedback", flush=True)
            eval_until = time.monotonic() + PHASE_MAX_S
            while running() and time.monotonic() < eval_until and any(
                    evaluated(run) < phases.eval_answers for run in runs):
                await _tick(tasks, stack, state)
        for run in runs:
            run.sim.stop()
        await asyncio.gather(*tasks)
        if phases.export and state.training_started and not state.failed:
            state.exports = await export_adapters(stack.target.base_url, keys, state.out / ADAPTERS)
    finally:
        if state.training_started and not state.training_ended:
            state.training_ended = time.time()
        progress.cancel()
        for run in runs:  # every tenant's users stop asking and rating before anything is awaited
            run.sim.stop()
        state.gateway_counters = await _gateway_counters(stack)
        await _within(CLOSE_S, "the users' last requests", *(
            run.sim.halt(task) for run, task in zip(runs, tasks)))
        for run in runs:
            await run.tracker.poll()
        await _within(CLOSE_S, "the trackers' bus connections", *(run.tracker.close() for run in runs))


async def _within(seconds: float, what: str, *aws) -> None:
    """Await `aws` together for at most `seconds`; past that, say so, cancel what is left and
    go on: a stop, on SIGTERM above all, must reach the
    mesh's stop and the report, whatever one connection's close does. Seen once (2 cores,
    another mesh beside it): the demo, signalled, still had one tenant's users rating 90 s
    later, its clean-up stuck before their turn."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=seconds)
    if pending:
        log.warning("%s: %d of %d did not finish within %g s; going on", what, len(pending),
                    len(tasks), seconds)
        print(f"[demo-tenants] {what}: {len(pending)} did not finish within {seconds:g} s; "
              "going on", flush=True)
        for t in pending:
            t.cancel()


async def export_adapters(gateway_url: str, keys: dict[str, str], out: Path) -> dict:
    """Each tenant's latest adapter, exported as its users could (`GET /v1/adapter` with the
    tenant's key) and unpacked under `out` (`apps.audit.save_export`); tenant -> its version,
    or the reason it has none (a lineage never trained answers 404)."""
    import httpx

    from apps.audit import save_export
    from hotloop.errors import InvalidArgument

    got: dict = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for tenant, key in keys.items():
            try:
                r = await http.get(f"{gateway_url}/v1/adapter",
                                   headers={"Authorization": f"Bearer {key}"})
            except httpx.HTTPError as e:
                got[tenant] = f"export failed: {e!r}"
                continue
            if r.status_code != 200:
                got[tenant] = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            try:
                version = int(r.headers[POLICY_VERSION_HEADER])
                save_export(out, tenant, version, r.headers[ADAPTER_SHA_HEADER], r.content)
            except (KeyError, ValueError, OSError, InvalidArgument) as e:  # the audit skips it
                got[tenant] = f"export unreadable: {e!r}"
                continue
            got[tenant] = version
    return got


async def roll_back(stack: Stack, run: TenantRun, check: dict, wait_s: float = 60.0) -> None:
    """Serve `check`'s version of the tenant again (`rollback_choice`): hold the lineage (no
    queued feedback trains it further), reset it to that version through the admin API (the
    trainer publishes it as the next version), and wait until the lineage's latest version is
    above what it was; the final share counts the answers from then (`learned_until`). A
    failure is recorded in `run.rollback`, and the lineage stays as it was."""
    import httpx

    url = f"{stack.target.base_url}/admin/tenants/{run.name}"
    auth = {"Authorization": f"Bearer {stack.info.admin_token()}"}
    run.rollback = {"to": check["version"], "from": final_version(run),
                    "check_share": check["share"], "check_answers": check["answers"]}
    try:
        await hold(stack, run.name, True)
        async with httpx.AsyncClient(timeout=30) as http:
            before = (await http.get(url, headers=auth)).json()["latest_version"]
            r = await http.post(f"{url}/reset", json={"version": check["version"]}, headers=auth)
            if r.status_code != 202:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            deadline = time.monotonic() + wait_s
            while (latest := (await http.get(url, headers=auth)).json()["latest_version"]) <= before:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no new version of {run.name} within {wait_s:.0f} s")
                await asyncio.sleep(0.5)
    except Exception as e:  # the run goes on with the lineage as it was
        run.rollback["error"] = f"{type(e).__name__}: {e}"
        print(f"[demo-tenants] {run.name}: could not go back to v{check['version']}: "
              f"{run.rollback['error']}", flush=True)
        return
    run.rollback["as"] = latest
    run.learned_until = time.time()
    print(f"[demo-tenants] {run.name}: no check confirmed its target; back to v{check['version']} "
          f"(its check: {check['share']:.2f} of {check['answers']}, target {run.target:.2f}), "
          f"serving as v{latest}", flush=True)


async def hold(stack: Stack, tenant: str, held: bool) -> None:
    """Hold `tenant`'s lineage at the version it serves, or resume it, through the gateway's
    admin API (`POST /admin/tenants/<name>/hold|resume`, the mesh's admin token)."""
    import httpx

    url = f"{stack.target.base_url}/admin/tenants/{tenant}/{'hold' if held else 'resume'}"
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(url, headers={"Authorization": f"Bearer {stack.info.admin_token()}"})
    if r.status_code != 202:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")


def _held(lm: dict) -> str:
    """The loop cell's note of the loops a check's hold delayed (`loop_report`), if any."""
    u = lm.get("unheld")
    if not lm.get("held") or not u:
        return ""
    return f"; {lm['held']} held, the other {u['n']}: {_f(u['p50'], '.0f')} / {_f(u['p95'], '.0f')}"


def _say(run: TenantRun, event: str | None, t0: float) -> None:
    if event is None:
        return
    at = f"after {time.time() - t0:.0f} s of training"
    if event == "paused":
        print(f"[demo-tenants] {run.name}: a block of its answers met the target {at}; its users "
              f"pause rating while its version is checked", flush=True)
        return
    c = run.checks[-1]
    verdict = "target confirmed; its users stop rating" if event == "accepted" else \
        "below the target; its users rate again"
    print(f"[demo-tenants] {run.name}: v{c['version']} met its preference in {c['share']:.2f} of "
          f"{c['answers']} answers (target {run.target:.2f}): {verdict} ({at})", flush=True)


async def _progress(state: TenantsState, t0: float, every_s: float) -> None:
    if every_s <= 0:
        return
    while True:
        await asyncio.sleep(every_s)
        print(f"[demo-tenants] {tenants_status(state, t0)}", flush=True)


async def _tick(tasks: list[asyncio.Task], stack: Stack, state: TenantsState) -> None:
    """Wait a second (or until some users stop); a dead mesh process stops the users."""
    await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
    if not state.failed and (why := stack.dead()) is not None:
        state.failed = why
        print(f"[demo-tenants] {why}\n[demo-tenants] stopping", flush=True)
        for run in state.runs.values():
            run.sim.stop()


async def _gateway_counters(stack: Stack) -> dict:
    """The gateway's counters (`/v1/hotloop/status` with the admin token: they cover every
    tenant, so a user key's view has none), for its refusals of answers from another
    tenant's lineage (`wrong_tenant`); {} when it cannot be asked."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10.0) as http:
            r = await http.get(f"{stack.target.base_url}/v1/hotloop/status",
                               headers={"Authorization": f"Bearer {stack.info.admin_token()}"})
            r.raise_for_status()
            return r.json().get("counters", {})
    except (httpx.HTTPError, ValueError, OSError) as e:
        log.warning("the gateway's status could not be read: %r", e)
        return {}


# ---- the report -------------------------------------------------------------------------------


def tenant_record(state: TenantsState, run: TenantRun) -> dict:
    since = state.training_started or float("inf")
    last, measured_on = final_answers(run, since, state.window)
    final = share(last, run.preference)
    # met: the final version's share is at the target; without its answers, the window's verdict
    reached = (final is not None and run.target is not None and final >= run.target
               if measured_on == "final_version" else run.reached_at is not None)
    base = base_rates(state)
    n_base = sum(len(ok_records(r.sim.records, "idle")) for r in state.runs.values())
    own_idle = ok_records(run.sim.records, "idle")
    cross = {}
    for name, pref in state.prefs.items():
        if name == run.name:
            continue
        b, f = base.get(name), share(last, pref)
        se_b, se_f = standard_error(b, n_base), standard_error(f, len(last))
        cross[name] = {"base": b, "final": f, "delta": f - b if b is not None and f is not None else None,
                       # the delta's sampling noise (both shares binomial, independent samples)
                       "se": (se_b ** 2 + se_f ** 2) ** 0.5 if se_b is not None and se_f is not None else None}
    deltas = [c["delta"] for c in cross.values() if c["delta"] is not None]
    tracker, sim = run.tracker, run.sim
    own_ids = {r.response_id for r in sim.records if r.response_id}
    trained = set(tracker.trained_in)
    records = [r for r in sim.records if r.phase in ("idle", "training", "eval")]
    t0 = state.training_started
    return {
        "name": run.name,
        "preference": run.preference.describe(),
        "key_id": key_id(run.name),
        # base: every idle answer, some finished after the switch (all from the base model)
        "share": {"base": base[run.name], "base_at_switch": run.base,
                  "base_own": share(own_idle, run.preference),
                  "final": final, "target": run.target, "reached": reached,
                  "confirmed": run.reached_at is not None,
                  "time_to_target_s": run.reached_at - t0 if run.reached_at and t0 else None,
                  "checks": [{"at_s": c["at"] - t0, "paused_s": c["at"] - c["paused_at"],
                              "version": c["version"], "answers": c["answers"],
                              "share": c["share"], "accepted": c["accepted"]}
                             for c in run.checks] if t0 else [],
                  "rollback": run.rollback,
                  "window": len(last), "final_from": measured_on, "final_version": final_version(run),
                  "learned_s": run.learned_until - t0 if run.learned_until and t0 else None,
                  "base_answers": n_base},
        "cross": cross,
        "cross_delta_max": max(deltas) if deltas else None,
        # base: every tenant's idle answers, as the shares'; final: the final share's answers
        "length": {"base": length([r for other in state.runs.values()
                                   for r in ok_records(other.sim.records, "idle")]),
                   "final": length(last)},
        "loop_ms": loop_report(tracker.loops(sim.feedback_sent, sim.clock),
                               hold_spans(run, state.training_ended or time.time())),
        "versions": {"trained": tracker.trained_version, "served": sim.clock.latest,
                     "announced": sorted(tracker.published_at)},
        "feedback": {
            "sent": sum(r.feedback in ("accepted", "duplicate") for r in records),
            "trained": len(trained),
            "trained_tenants": dict(tracker.trained_tenants),  # whose feedback its trainer took
            "trained_not_own": len(trained - own_ids),  # response ids this tenant's users never got
            "dropped_by_reason": dict(tracker.settled),
            "updates": len(tracker.updates),
        },
        "turns": training_turns(tracker),
        "answers": {"idle": len(own_idle), "training": len(ok_records(sim.records, "training")),
                    "eval": len(ok_records(sim.records, "eval")),
                    "errors": sum(bool(r.error) for r in sim.records)},
        "wrong_adapter_answers": sum(wrong_adapter(run, r) for r in sim.records),
        "ttft_ms": {"p50": percentile((r.ttft_ms for r in records if not r.error), 50),
                    "p99": percentile((r.ttft_ms for r in records if not r.error), 99)},
    }


def hold_spans(run: TenantRun, now: float) -> list[tuple[float, float]]:
    """When a check held `run`'s lineage (unix seconds): each check's pause to its verdict,
    and a pause still open at `now`."""
    spans = [(c["paused_at"], c["at"]) for c in run.checks]
    if run.paused_at is not None:
        spans.append((run.paused_at, now))
    return spans


def across_a_hold(loop: dict, holds: list[tuple[float, float]]) -> bool:
    """Whether a loop's feedback was sent before a hold ended and its version first reached a
    user after that hold began: it waited (some of) the check out, the demo's pause."""
    return any(loop["sent"] < end and loop["first_token"] > start for start, end in holds)


def loop_report(loops: list[dict], holds: list[tuple[float, float]]) -> dict:
    """`loop_summary` of every loop, and `unheld`: of those no check's hold delayed
    (`across_a_hold`), which `held` counts. A check pauses the tenant's users for a minute or
    more, and feedback sent just before trains only once they rate again: such loops can make
    a tenant's p95 (measured: 80 s against a p50 of 13 s), the demo's pause rather than the
    loop."""
    free = [e["loop_ms"] for e in loops if not across_a_hold(e, holds)]
    return {**loop_summary(loops), "held": len(loops) - len(free),
            "unheld": {"p50": percentile(free, 50), "p95": percentile(free, 95), "n": len(free)}}


def training_turns(tracker: LoopTracker) -> dict:
    """The tenant's training turns, from its lane's step records: one update is one turn on the
    trainer (with a shared trainer, granted by its fair share on trained tokens)."""
    ups = tracker.updates
    waits = [u.stages.get("turn_wait", 0.0) for u in ups]
    kls = [u.kl for u in ups if u.kl is not None]
    return {"updates": len(ups), "feedback": sum(u.feedback for u in ups),
            "tokens": sum(u.tokens for u in ups),
            "train_s": sum(u.stages.get("train", 0.0) for u in ups),
            "turn_wait_s": sum(waits), "turn_wait_p50_s": percentile(waits, 50),
            "turn_wait_max_s": max(waits, default=None),
            # how far the lineage moved from the base model: its last updates' per-token KL
            # (incoherent answers showed at 0.3 and above), and the coefficient that held it
            "kl_last": percentile(kls[-KL_LAST:], 50) if kls else None,
            "kl_coef_last": ups[-1].kl_coef if ups else None}


def tenants_report(state: TenantsState) -> dict:
    tenants = [tenant_record(state, run) for run in state.runs.values()]
    tokens = sum(t["turns"]["tokens"] for t in tenants)
    for t in tenants:
        t["turns"]["tokens_share"] = t["turns"]["tokens"] / tokens if tokens else None
    crosses = [t["cross_delta_max"] for t in tenants]
    return {
        "run_id": state.run_id,
        "interrupted": state.interrupted,
        "failed": state.failed,
        "trainers": state.trainers,
        "tenants": tenants,
        "wrong_adapter_answers": sum(t["wrong_adapter_answers"] for t in tenants),
        "gateway_wrong_tenant": state.gateway_counters.get("wrong_tenant"),
        "acceptance": {
            "targets_reached": bool(tenants) and all(t["share"]["reached"] for t in tenants),
            "cross_delta_max_le_0_1": bool(tenants) and all(c is not None and c <= CROSS_LIMIT for c in crosses),
            "no_wrong_adapter_answers": sum(t["wrong_adapter_answers"] for t in tenants) == 0,
            # the tokens' own evidence (`apps.audit`): None where no audit ran
            "audit_no_other_tenant_answers": (state.audit["other_tenant_answers"] == 0
                                              if state.audit and "error" not in state.audit else None),
        },
        "exports": state.exports,
        "audit": audit_summary(state.audit),
        "training_s": (state.training_ended - state.training_started
                       if state.training_started and state.training_ended else 0.0),
        "settings": state.settings,
    }


def audit_summary(audit: dict | None) -> dict | None:
    """The audit without its per-answer rows (those stay in `tenants-audit.json`)."""
    if not audit or "error" in audit:
        return audit
    return {**audit, "tenants": {t: {k: v for k, v in s.items() if k != "rows"}
                                 for t, s in audit["tenants"].items()}}


def write_tenants_report(state: TenantsState) -> dict:
    report = tenants_report(state)
    out = state.out
    (out / "tenants-report.json").write_text(json.dumps(report, indent=2))
    _plot(state, out / "tenants.png")
    lines = [f"# hotloop many-tenant run `{state.run_id}`{' (interrupted)' if state.interrupted else ''}", "",
             *([f"**The run stopped early:** {state.failed.splitlines()[0]}", ""] if state.failed else []),
             f"{len(report['tenants'])} tenants on one engine, each with users who rate answers by a preference its "
             f"trainer never sees; trainers: {report['trainers']}; {report['training_s']:.0f} s of training.",
             "",
             "| tenant | preference | base | final | target | confirmed after | cross max (rise of others) "
             "| cut off (median words), base -> final "
             "| loop p50 / p95 ms (p50 to live + after; without the loops a check held) | versions "
             "| feedback sent / trained "
             "| wrong adapter |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in report["tenants"]:
        s, lm, fb = t["share"], t["loop_ms"], t["feedback"]
        checks = f" ({len(s['checks'])} checks)" if len(s["checks"]) > 1 else ""
        reached = f"{s['time_to_target_s']:.0f} s{checks}" if s["confirmed"] else "no"
        if (rb := s.get("rollback")) and "as" in rb:
            reached += f"; back to v{rb['to']} ({_f(rb['check_share'])} of {rb['check_answers']})"
        cross = ", ".join(f"{k} {_f(c['delta'], '+.2f')} ± {_f(c['se'])}" for k, c in t["cross"].items())
        lines.append(f"| {t['name']} | {t['preference']} | {_f(s['base'])} | {_f(s['final'])} | "
                     f"{_f(s['target'])} | {reached} | {_f(t['cross_delta_max'], '+.2f')} ({cross}) | "
                     f"{_length(t['length']['base'])} -> {_length(t['length']['final'])} | "
                     f"{_f(lm['p50'], '.0f')} / {_f(lm['p95'], '.0f')} ({_f(lm.get('to_live_p50'), '.0f')} "
                     f"+ {_f(lm.get('after_live_p50'), '.0f')}){_held(lm)} | {t['versions']['served']} | "
                     f"{fb['sent']} / {fb['trained']} | {t['wrong_adapter_answers']} |")
    acc = report["acceptance"]
    lines += ["", "Training turns (each lane's step records; one update is one turn on the trainer):", "",
              "| tenant | updates | feedback trained | tokens trained (share) | training s "
              f"| waited for its turn s (p50 / max per update) | KL to base (last {KL_LAST} updates, "
              "median) / coefficient |", "|---|---|---|---|---|---|---|"]
    for t in report["tenants"]:
        u = t["turns"]
        lines.append(f"| {t['name']} | {u['updates']} | {u['feedback']} | {u['tokens']} "
                     f"({_f(u['tokens_share'], '.0%')}) | {u['train_s']:.0f} | {u['turn_wait_s']:.0f} "
                     f"({_f(u['turn_wait_p50_s'], '.1f')} / {_f(u['turn_wait_max_s'], '.1f')}) | "
                     f"{_f(u['kl_last'], '.3f')} / {_f(u['kl_coef_last'], '.3f')} |")
    lines += ["", f"- every tenant reached its target: {acc['targets_reached']}; every cross rise <= "
              f"{CROSS_LIMIT}: {acc['cross_delta_max_le_0_1']}; answers from another lineage: "
              f"{report['wrong_adapter_answers']} (the gateway refused {_f(report['gateway_wrong_tenant'], 'd')})",
              "- reached: the final share is at the target; confirmed: once a block of `window` of the "
              "tenant's answers met its target by more than one standard error its users paused "
              "rating, and the version it then served met "
              f"the target by {CHECK_MARGIN_SE:g} standard errors in `check_answers` fresh answers (then "
              "its users stop rating; below, they rate again); with `--keep-rating`, its window met "
              "the target by more than one standard error; back to: training ended unconfirmed, "
              "and the demo served again the checked version that met the target best (its "
              "check's answers are not in its final share)",
              "- base: the preference's share of every tenant's idle answers (the base model on the same "
              "prompts); final: of the answers the tenant's final version gave to requests sent after "
              "its lineage stopped learning (at its target, or when training ended), the evaluation's "
              "among them (without any, its last `window` answers of training); cross: the same for the other "
              "tenants' preferences, in this tenant's answers, ± the delta's standard error (binomial "
              "sampling noise of both shares); cut off: the share of the same answers ended by the "
              "token limit, not the model (what no user but `short`'s rates)",
              *audit_lines(state.audit),
              "", "![shares and loop latency per tenant](tenants.png)", "",
              "## Settings", "", "```json", json.dumps(state.settings, indent=2), "```"]
    (out / "tenants-report.md").write_text("\n".join(lines) + "\n")
    return report


def _length(x: dict) -> str:
    return f"{_f(x['cut_off'])} ({_f(x['words_p50'], '.0f')})"


def audit_lines(audit: dict | None) -> list[str]:
    """The report's section on the audit (`apps.audit`)."""
    if audit is None:
        return []
    head = ["", "## Which weights wrote the answers (`hotloop audit tenants`)", ""]
    if "error" in audit:
        return [*head, f"The audit did not run: {audit['error']}"]
    from apps.audit import lines

    return [*head, f"Each tenant's adapter exported with its own key at the end; {audit['per_tenant']} "
            "of its answers from that version (at most) scored under every tenant's adapter and the "
            "base model (transformers + peft, outside the engine). An answer counts as from another "
            f"tenant's adapter where that one explains it best of all, and better than its own by "
            f"more than {audit['margin_nats']:g} nats: {audit['other_tenant_answers']} of "
            f"{audit['sampled']}.", "",
            *lines(audit)]


def _plot(state: TenantsState, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    runs = list(state.runs.values())
    fig, axes = plt.subplots(len(runs) + 1, 2, figsize=(12, 3.2 * (len(runs) + 1)), squeeze=False)
    for row, run in zip(axes, runs):
        records = [r for r in run.sim.records if not r.error]
        t0 = state.training_started or (records[0].ts if records else time.time())
        ax = row[0]
        for name, pref in state.prefs.items():
            window, xs, ys = SlidingShare(state.window), [], []
            for r in records:
                window.add(r.meets(pref))
                xs.append(r.ts - t0)
                ys.append(window.value)
            own = name == run.name
            ax.plot(xs, ys, lw=2.0 if own else 1.0, alpha=1.0 if own else 0.6,
                    label=f"{name}{' (its own)' if own else ''}")
        if run.target is not None:
            ax.axhline(run.target, color="green", ls="--", lw=0.8, label=f"target {run.target:.2f}")
        for v, at in sorted(run.sim.clock.first_seen.items()):
            if v:
                ax.axvline(at - t0, color="tab:gray", lw=0.5, alpha=0.4)
        ax.axvline(0, color="black", lw=0.8)  # training starts ...
        if state.training_ended and records and records[-1].phase == "eval":
            ax.axvline(state.training_ended - t0, color="black", lw=0.8, ls=":")  # ... and ends
        ax.set_ylim(0, 1)
        ax.set_ylabel("share")
        ax.set_title(f"tenant {run.name}: {run.preference.describe()}\n(grey: a new version served; "
                     f"dotted: training ends)", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
        loops = sorted(run.tracker.loops(run.sim.feedback_sent, run.sim.clock), key=lambda e: e["sent"])
        holds = hold_spans(run, state.training_ended or time.time())
        for held, style in ((False, {"color": "tab:blue"}),
                            (True, {"color": "tab:gray", "label": "waited out a check's hold"})):
            some = [e for e in loops if across_a_hold(e, holds) == held]
            if some:
                row[1].scatter([e["sent"] - t0 for e in some], [e["loop_ms"] for e in some], s=6, **style)
        if any(across_a_hold(e, holds) for e in loops):
            row[1].legend(fontsize=7, loc="upper right")
        if loops:
            row[1].set_yscale("log")
        row[1].set_title(f"tenant {run.name}: loop latency (feedback -> first token of a version "
                         f"trained on it), ms", fontsize=9)
        row[1].grid(alpha=0.3)
    # the fairness: each tenant's updates (training turns) and trained tokens over time
    t0 = state.training_started or time.time()
    for run in runs:
        ups = sorted(run.tracker.updates, key=lambda u: u.seen_at)
        xs, tokens = [0.0] + [u.seen_at - t0 for u in ups], [0]
        for u in ups:
            tokens.append(tokens[-1] + u.tokens)
        axes[-1][0].step(xs, range(len(xs)), where="post", label=run.name)
        axes[-1][1].step(xs, tokens, where="post", label=run.name)
    axes[-1][0].set_title("updates (training turns) per tenant, from its lane's step records", fontsize=9)
    axes[-1][1].set_title("tokens trained per tenant", fontsize=9)
    for ax in axes[-1]:
        ax.axvline(0, color="black", lw=0.8)
        ax.grid(alpha=0.3)
        if runs:
            ax.legend(fontsize=7, loc="upper left")
    for ax in axes[-1]:
        ax.set_xlabel("seconds since training started")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args) -> int:
    """`hotloop demo-tenants`."""
    logging.basicConfig(level=os.environ.get("HOTLOOP_LOG_LEVEL", "WARNING"))
    config_path = args.config or str(DEFAULT_CONFIG)
    run_id = args.run_id or time.strftime("tenants-%Y%m%d-%H%M%S")
    out = (Path(args.out_dir) / run_id).resolve()
    tenants = [t.strip() for t in args.tenants.split(",")] if args.tenants else list(TENANTS)
    small = [f"--{k.replace('_', '-')} {v}" for k, v in (("users", args.users), ("window", args.window),
             ("check_answers", args.check_answers),
             ("max_tokens", args.max_tokens), ("max_words", args.max_words), ("min_items", args.min_items),
             ("min_item_words", args.min_item_words))
             if v < 1] + [f"--{k.replace('_', '-')} {v:g}" for k, v in (("idle_s", args.idle_s),
                          ("train_s", args.train_s), ("min_words", args.min_words),
                          ("idle_answers", args.idle_answers), ("eval_answers", args.eval_answers),
                          ("kl_beta", args.kl_beta), ("audit_answers", args.audit_answers)) if v < 0]
    if args.lr <= 0:
        small.append(f"--lr {args.lr:g}")
    if args.target_factor <= 1:
        small.append(f"--target-factor {args.target_factor:g} (a target must be above the base rate)")
    if args.min_words > args.max_words:
        small.append(f"--min-words {args.min_words} above --max-words {args.max_words}")
    if small:
        print(f"hotloop demo-tenants: {', '.join(small)}: out of range", flush=True)
        return 2
    try:
        prefs = preferences(tenants, args.max_words, args.min_items, args.min_words,
                            args.min_item_words)
        plan = trainer_plan(args.trainers, tenants, out)
    except ValueError as e:
        print(f"hotloop demo-tenants: {e}", flush=True)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    keys_file = out / "tenant-keys"
    keys = make_keys(keys_file, tenants)
    phases = Phases(idle_s=args.idle_s, idle_answers=args.idle_answers, train_s=args.train_s,
                    target_factor=args.target_factor, until_target=not args.no_stop,
                    stop_rating=not args.keep_rating, check_answers=args.check_answers,
                    eval_answers=args.eval_answers, export=args.audit_answers > 0)
    learning = training_overrides(args.kl_beta, args.lr, args.max_tokens)
    state = TenantsState(run_id, out, prefs, args.window, trainers=plan.mode, settings={
        "config": config_path, "overrides": args.set, "users_per_tenant": args.users,
        "idle_s": args.idle_s, "idle_answers": args.idle_answers, "train_s": args.train_s,
        "eval_answers": args.eval_answers, "check_answers": args.check_answers, "max_tokens": args.max_tokens,
        "preferences": {k: p.describe() for k, p in prefs.items()}, "window": args.window,
        "until_target": not args.no_stop, "stop_rating_at_target": not args.keep_rating,
        "target_factor": args.target_factor, "kl_beta": args.kl_beta,
        "kl_target": KL_TARGET if args.kl_beta > 0 else None, "lr": args.lr,
        "check_margin_se": CHECK_MARGIN_SE, "learning": learning, "trainers": plan.mode,
        "checks_hold": True, "audit_answers": args.audit_answers})
    # the demo's learning first, so that a --set of the user's overrides it
    overrides = [*learning, *args.set,
                 *tenant_overrides(keys_file, tenants), *plan.overrides]
    print(f"[demo-tenants] starting the mesh (NATS, rollout with vLLM, gateway) and the trainers "
          f"({plan.mode}) for tenants {', '.join(tenants)}; run files under {out}", flush=True)
    try:
        with sigterm_interrupts():  # start_stack stops what started
            stack = start_stack(config_path, overrides, out, quiet=args.quiet, trainers=plan.trainers)
    except KeyboardInterrupt:
        print("[demo-tenants] interrupted during start-up; stopped", flush=True)
        return 130
    try:
        print(f"[demo-tenants] gateway {stack.target.base_url}/v1; {args.users} users per tenant; idle "
              f"phase {args.idle_s:g} s, then up to {args.train_s:g} s of training", flush=True)
        _, state.interrupted = run_interruptible(run_tenants(
            state, stack, keys, plan.metrics, args.users, phases, args.max_tokens, args.progress))
    finally:
        why = stack.stop()
    if why and not state.failed:
        state.failed = why
        print(f"[demo-tenants] {why}", flush=True)
    if args.audit_answers > 0 and not state.interrupted and any(
            isinstance(v, int) for v in state.exports.values()):
        state.audit = audit(out, args.audit_answers)
    report = write_tenants_report(state)
    for t in report["tenants"]:
        s = t["share"]
        print(f"[demo-tenants] {t['name']}: {_f(s['base'])} -> {_f(s['final'])} (target {_f(s['target'])}, "
              f"{'reached' if s['reached'] else 'not reached'}"
              f"{'; confirmed after %.0f s' % s['time_to_target_s'] if s['confirmed'] else ''}); "
              f"cross max {_f(t['cross_delta_max'], '+.2f')}; loop p50 {_f(t['loop_ms']['p50'], '.0f')} ms; "
              f"v{t['versions']['served']}; wrong adapter {t['wrong_adapter_answers']}", flush=True)
    print(f"[demo-tenants] report: {out / 'tenants-report.md'}", flush=True)
    return 130 if state.interrupted else 1 if state.failed else 0


def audit(out: Path, per_tenant: int) -> dict:
    """`apps.audit.audit_run` on this run, once the mesh has stopped (its cores are free);
    a failure is the report's, not the run's."""
    from apps.audit import audit_run

    print(f"[demo-tenants] audit: scoring up to {per_tenant} answers per tenant under every "
          "tenant's exported adapter and the base", flush=True)
    try:
        report = audit_run(out, per_tenant=per_tenant, threads=os.cpu_count())
    except Exception as e:  # noqa: BLE001 - the run's report is written either way
        log.exception("the audit failed")
        return {"error": f"{type(e).__name__}: {e}"}
    print(f"[demo-tenants] audit: {report['other_tenant_answers']} of {report['sampled']} answers "
          "best explained by another tenant's adapter (and better than by their own by the margin)",
          flush=True)
    return report


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)
