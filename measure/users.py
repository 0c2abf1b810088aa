"""Simulated users who chat through the gateway and rate the answers (`hotloop simulate users`,
the demos and the benchmarks run them).

Owns:
- the hidden preferences (`Brevity`, `Bullets`, `Question`, `Exclaim`; `PREFERENCES` by
  name): what these users like, which the base model does not do on its own. The simulator
  scores every answer with one; the trainer only ever sees the score;
- the built-in prompts (short, varied user questions; `TENANT_PROMPTS` for the many-tenant demo);
- the user loop: the official `openai` client against the gateway's OpenAI-compatible HTTP
  API, streaming, then `POST /v1/feedback` with the same API key;
- per-request records (JSONL) and live statistics: the share of answers matching the
  preference over a sliding window, the served version, TTFT and inter-chunk latency, and the
  first time a token of each version reached a user (the far end of the update loop).

Does not own: the gateway, the trainer or the mesh; finding a running mesh's gateway
(`launch.mesh.find_target` turns `<run_dir>/mesh.json` into a `Target`); the command
(`apps/simulate.py`). It reaches the mesh over HTTP only, so it imports nothing from
`services/` or `launch/`.

Failure policy: a request or a feedback that fails (HTTP error, dropped stream, timeout) is a
record with its `error`, counted, and the user carries on; only a mesh that cannot be found
at start fails the run.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import random
import re
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

PROMPTS: tuple[str, ...] = (
    "What is a black hole?",
    "How do I make a good cup of coffee?",
    "Why is the sky blue?",
    "Can you explain what a neural network is?",
    "What are some tips for sleeping better?",
    "How does a bicycle stay upright?",
    "What is the difference between weather and climate?",
    "Give me an idea for a weekend project.",
    "Why do cats purr?",
    "How do vaccines work?",
    "What is the capital of Australia and why is it not Sydney?",
    "How can I learn a new language faster?",
    "What causes the seasons on Earth?",
    "Explain recursion to a beginner.",
    "What should I pack for a day hike?",
    "How does compound interest work?",
    "Why do leaves change color in autumn?",
    "What is photosynthesis?",
    "How do I stay focused while studying?",
    "What is the tallest mountain in the world?",
    "How do airplanes fly?",
    "What is a good way to start running?",
    "Why is exercise good for the brain?",
    "What does a database do?",
    "How do I write a polite email to decline an invitation?",
    "What is the speed of light?",
    "Why do we dream?",
    "How can I reduce food waste at home?",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a friendly robot.",
    "How do magnets work?",
    "What is inflation?",
    "How do I care for a houseplant?",
    "What is the meaning of the word 'serendipity'?",
    "Why does ice float on water?",
    "How does the internet work?",
    "What are the benefits of reading every day?",
    "How do bees make honey?",
    "What is a prime number?",
    "How can I be more productive in the morning?",
)

# The many-tenant demo's prompts (`hotloop demo-tenants`): chat openings that invite a question
# back, requests for lists, and a few of both, so that each tenant's preference starts rare but
# present. Base rates on SmolLM2-135M-Instruct (vLLM directly, these prompts x 8 at temperature
# 1, 128 new tokens, 392 answers, 2026-12-02; 69% hit the token limit): 5 to 60 words 0.24 (no
# answer had fewer than 5 words; 5 to 70: 0.32), a list of at least 2 items of at least 4 words
# 0.16 (of any items: 0.18), ends with a question with at most 3 words after the last "?" 0.14
# (0 words: 0.11, 5: 0.16, 10: 0.19). On `PROMPTS` the last two were 0.06 and 0.01: too rare to
# learn from binary scores. A second sample of 392 (same settings): 0.24, 0.13, 0.13, and the
# first sentence ends with "!" 0.13. Through the mesh (the demo's idle phase, 90-100 answers per
# run) they vary from run to run: 15 to 60 words 0.16-0.26, lists 0.13-0.20, "!" 0.13-0.21.
# Complete answers (not cut off) of 15 to 60 words, the demo's `short`: 0.18 and 0.14 in two
# runs (159 and 152 idle answers).
# Lists are met on the requests for one (the 14 from "List three fun facts" on): 0.40 there,
# 0.02 on the other 35 (796 idle answers of five runs); the users draw prompts from a deck
# (`PromptDeck`) so that the mix of the two does not move a base rate from run to run.
TENANT_PROMPTS: tuple[str, ...] = (
    "I'm thinking about getting a dog.",
    "I'm thinking about getting a cat.",
    "I'm thinking about learning to cook.",
    "I'm thinking about changing jobs.",
    "I'm thinking about taking a vacation.",
    "I'm thinking about buying a bike.",
    "I'm thinking about starting a blog.",
    "I'm thinking about going back to school.",
    "I'm thinking about painting my bedroom.",
    "I'm thinking about running a marathon.",
    "I'm thinking about learning the guitar.",
    "I'm thinking about moving abroad.",
    "I'm planning a party this weekend.",
    "I just adopted a puppy.",
    "I want to learn something new this year.",
    "I have a job interview tomorrow.",
    "My friend's birthday is next week.",
    "I'd like some help with a recipe.",
    "I need advice about my garden.",
    "I can't decide what to watch tonight.",
    "I'm bored. What should I do?",
    "I want to plan a trip to Japan.",
    "Can you help me with my homework?",
    "I feel stressed about work.",
    "Help me choose a gift for my mother.",
    "I want to start a small garden.",
    "What should I cook for dinner tonight?",
    "I need a new hobby.",
    "Help me plan a birthday party.",
    "I'd like to learn to play an instrument.",
    "Recommend a book for me.",
    "I'm moving to a new city next month.",
    "I want to get better at chess.",
    "Can you help me write a story?",
    "I'm not sure which laptop to buy.",
    "List three fun facts about octopuses.",
    "What are the steps to change a flat tire?",
    "List some tips for sleeping better.",
    "List five healthy snacks.",
    "What are three ways to save money?",
    "List the planets of the solar system.",
    "Give me a list of things to pack for a beach trip.",
    "List four tips for a job interview.",
    "What are the steps to make a cup of tea?",
    "List three benefits of drinking water.",
    "Give me a short checklist for cleaning a kitchen.",
    "List some easy exercises to do at home.",
    "Give me three ideas for a rainy day.",
    "What are the pros and cons of working from home?",
)

_WORD = re.compile(r"\S+")


def word_count(text: str) -> int:
    """Whitespace-separated words (markdown bullets and numbers count as words)."""
    return len(_WORD.findall(text))


@dataclass(frozen=True)
class Brevity:
    """The hidden preference: answers of at least `min_words` and at most `max_words` words.

    The score is +1 when met, else negative and growing with the excess, reaching -1 at
    twice the limit: a graded signal, so REINFORCE learns "shorter" even while no answer of
    a batch meets the limit yet. Length is what a 135M model can learn quickly from scalar
    feedback; a fixed phrase it never produces unprompted would give no signal to follow.
    Below `min_words` the score falls the same way with the shortfall, to -1 for an empty
    answer: a near-empty answer is not short, it is broken (a lineage rewarded for "at most N
    words" alone collapsed to empty answers). Graded, not a flat -1: with a flat floor a lineage
    near the lower edge was pushed as hard as it could go toward long answers by one one-liner
    and swung past the band.

    `complete`: only answers the model ended itself count; one cut off at the token limit
    never matches and scores -1. Without it, "short" counts words in a fixed token budget, so
    any style with more tokens per word (exclamations, emoji, broken words) is "short" too: the
    `exclaim` lineage of the many-tenant demo gave 0.42 of its answers in 15-60 words against
    0.23 at the base, and half of those were cut off; complete ones only, 0.21 against 0.18.
    A user who likes short answers does not like cut-off ones.

    The default limit sits at the base model's 15th percentile. Measured (SmolLM2-135M-Instruct,
    vLLM, these prompts x 4 at temperature 1, 128 new tokens, 2026-11-29): word-count
    quantiles 5%: 40, 10%: 63, 15%: 70, 25%: 82, 50%: 98; 71% of the answers hit the token
    limit. So "at most 70 words" is met about 15% of the time before any training. The base
    model gives no answer under 5 words (its 5% quantile is 40; on `TENANT_PROMPTS` none of 392
    answers), so the lower bound changes no base rate.
    """

    max_words: int = 70
    min_words: int = 5
    complete: bool = False
    name: ClassVar[str] = "short"

    def matched(self, text: str, cut_off: bool = False) -> bool:
        return not (self.complete and cut_off) and self.min_words <= word_count(text) <= self.max_words

    def score(self, text: str, cut_off: bool = False) -> float:
        if self.complete and cut_off:
            return -1.0
        words = word_count(text)
        if words < self.min_words:
            return -(self.min_words - words) / self.min_words
        if words <= self.max_words:
            return 1.0
        return -min(1.0, (words - self.max_words) / self.max_words)

    def describe(self) -> str:
        whole = "complete answers (not cut off)" if self.complete else "answers"
        return f"{whole} of {self.min_words} to {self.max_words} words"


class Preference(Protocol):
    """What a hidden preference is to the simulator: a name, whether an answer meets it, the
    score a user gives (in [-1, 1], +1 when met) and a line saying what it is. `cut_off`: the
    token limit ended the answer (finish_reason "length"), as the user sees it."""

    name: ClassVar[str]

    def matched(self, text: str, cut_off: bool = False) -> bool: ...

    def score(self, text: str, cut_off: bool = False) -> float: ...

    def describe(self) -> str: ...


# A list item: a line starting "- ", "* ", "• " or "1." / "1)" (markdown as the model writes it).
_ITEM = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])\s+(\S.*)$")


def list_items(text: str, min_words: int = 1) -> int:
    """Lines of `text` that are list items of at least `min_words` words (the marker not
    counted)."""
    return sum(bool(m) and word_count(m.group(1)) >= min_words
               for m in map(_ITEM.match, text.splitlines()))


@dataclass(frozen=True)
class Bullets:
    """The hidden preference: the answer is a list, at least `min_items` lines that start
    like a list item ("- ", "* ", "1.") and carry at least `min_item_words` words each.

    The words per item keep the cheapest list from being a short answer too: a lineage
    rewarded for any list learned "- Excuse." repeated, which raised the short tenant's
    preference in its answers by 0.43. The score is +1 when met, else -1 plus the share of
    the items it has (one item of two: -0.5): a step toward a list is worth something. Base
    rate on `TENANT_PROMPTS`: see there.
    """

    min_items: int = 2
    min_item_words: int = 4
    name: ClassVar[str] = "bullets"

    def matched(self, text: str, cut_off: bool = False) -> bool:
        return list_items(text, self.min_item_words) >= self.min_items

    def score(self, text: str, cut_off: bool = False) -> float:
        items = list_items(text, self.min_item_words)
        return 1.0 if items >= self.min_items else -1.0 + items / self.min_items

    def describe(self) -> str:
        return (f"answers as a list of at least {self.min_items} items of at least "
                f"{self.min_item_words} words")


def words_after_question(text: str) -> int | None:
    """Words after the last question mark of `text` (0: it ends with one); None without one."""
    text = text.rstrip()
    i = text.rfind("?")
    return None if i < 0 else word_count(text[i + 1:])


@dataclass(frozen=True)
class Question:
    """The hidden preference: the answer ends with a question to the user: at most
    `max_tail_words` words after its last question mark (0: the last character is "?").

    A little tail is allowed because the small model often adds a word or two after its
    question ("...what kind of dog do you want? Let me know!"). The default, 3 words, is met by
    0.14 of the base model's answers on `TENANT_PROMPTS` (the strict rule, 0 words: 0.11; 10
    words, the earlier default: 0.19, which let a question be followed by a whole sentence).
    The score is +1 when met, -0.5 for an answer that asks something earlier, -1 for one that
    asks nothing.
    """

    max_tail_words: int = 3
    name: ClassVar[str] = "question"

    def matched(self, text: str, cut_off: bool = False) -> bool:
        tail = words_after_question(text)
        return tail is not None and tail <= self.max_tail_words

    def score(self, text: str, cut_off: bool = False) -> float:
        if self.matched(text):
            return 1.0
        return -1.0 if words_after_question(text) is None else -0.5

    def describe(self) -> str:
        return (f"answers that end with a question (at most {self.max_tail_words} words after "
                f"the last '?')")


_MARK = re.compile(r"[.!?]")


def first_mark(text: str) -> str | None:
    """The first sentence-ending mark of `text` ('.', '!' or '?'); None without one."""
    m = _MARK.search(text)
    return m.group(0) if m else None


@dataclass(frozen=True)
class Exclaim:
    """The hidden preference: the answer opens with an exclamation, its first sentence ends
    with "!" ("That's exciting! ...", "Congratulations! ...").

    Chosen for the many-tenant demo because on the base model it does not co-vary with the
    other tenants' preferences, so one tenant learning it does not move theirs. Measured
    (SmolLM2-135M-Instruct, vLLM, `TENANT_PROMPTS` x 8 at temperature 1, 128 new tokens, 392
    answers, 2026-12-02): met by 0.13; the share of 5-60-word answers among answers that meet
    it minus among those that do not: +0.09 (bullets -0.01); the other way round, its share
    among short answers minus among the others +0.05 (among lists -0.01). "Ends with a
    question", the earlier third preference, co-varies with length (+0.15 both ways), and a
    lineage rewarded for short answers learned a short reply that asks back. The score is +1
    when met, -0.5 for an answer that exclaims later, -1 for one that never does.
    """

    name: ClassVar[str] = "exclaim"

    def matched(self, text: str, cut_off: bool = False) -> bool:
        return first_mark(text) == "!"

    def score(self, text: str, cut_off: bool = False) -> float:
        if self.matched(text):
            return 1.0
        return -0.5 if "!" in text else -1.0

    def describe(self) -> str:
        return "answers that open with an exclamation (the first sentence ends with '!')"


_YOU = re.compile(r"\byou\b", re.IGNORECASE)


def first_sentence(text: str) -> str:
    """`text` up to its first sentence-ending mark (all of it without one)."""
    m = _MARK.search(text)
    return text[:m.end()] if m else text


@dataclass(frozen=True)
class Direct:
    """The hidden preference: the answer speaks to the user from its first sentence, which
    says "you" ("You might enjoy ...", "That sounds like fun, and you ...").

    Chosen as a preference the base model meets on every kind of prompt: lists (`Bullets`)
    come 0.40 of the time on the requests for a list and 0.02 on the other prompts, so twice
    their base rate asks for a habit on a third of the prompts with nothing to learn from on
    the rest. Measured on 796 idle answers of the many-tenant demo (five runs, SmolLM2-135M-
    Instruct, `TENANT_PROMPTS`, 128 tokens at temperature 1): met by 0.17 (0.11 on the list
    requests, 0.19 on the others); the share of `short`'s answers among those that meet it
    minus among the others +0.01 (the other way round +0.01), of `exclaim`'s -0.06 (-0.07).
    "you" as a word: "your" alone ("Starting your own blog ...") names the user's things, not
    the user (with it: 0.28). The score is +1 when met, -0.5 for an answer that says "you"
    later, -1 for one that never does."""

    name: ClassVar[str] = "direct"

    def matched(self, text: str, cut_off: bool = False) -> bool:
        return bool(_YOU.search(first_sentence(text)))

    def score(self, text: str, cut_off: bool = False) -> float:
        if self.matched(text):
            return 1.0
        return -0.5 if _YOU.search(text) else -1.0

    def describe(self) -> str:
        return "answers that speak to the user from the first sentence (it says 'you')"


PREFERENCES: dict[str, type] = {p.name: p for p in (Brevity, Bullets, Question, Exclaim, Direct)}
"""The hidden preferences by name (the many-tenant demo gives one to each tenant)."""


# ---- statistics ----------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class SlidingShare:
    """Share of True among the last `window` outcomes."""

    def __init__(self, window: int = 40):
        self._last: deque[bool] = deque(maxlen=window)

    def add(self, ok: bool) -> None:
        self._last.append(bool(ok))

    def __len__(self) -> int:
        return len(self._last)

    @property
    def value(self) -> float | None:
        return sum(self._last) / len(self._last) if self._last else None


class PromptDeck:
    """Which prompt a simulation's next request asks: the prompts in a shuffled order, each once
    before any again (a deck drawn to the end, then shuffled anew), shared by all its users.

    Drawn independently at random, the prompts of a few hundred answers were an uneven mix, and
    a preference met on some prompts far more than on others moved with the mix, not with the
    model: the many-tenant demo's lists came 0.40 of the time on its 14 requests for a list and
    0.02 on the other 35 (637 base-model answers), so the base rate of 150 answers, and the
    target set at twice it, varied by +-0.05 from the draw alone. Drawn from a deck, every run
    of `len(prompts)` answers asks each prompt about once, and a share varies with what the
    model says."""

    def __init__(self, n: int, rng: random.Random):
        if n < 1:
            raise ValueError("a deck needs at least one prompt")
        self.n, self._rng = n, rng
        self._left: list[int] = []

    def draw(self) -> int:
        if not self._left:
            self._left = list(range(self.n))
            self._rng.shuffle(self._left)
        return self._left.pop()


class VersionClock:
    """When a token of each policy version first reached a user (wall-clock seconds).

    `first_at_least(v)` is the far end of the update loop for feedback trained into version
    v: the first token served by v or by any later version (later versions descend from v).
    """

    def __init__(self) -> None:
        self.first_seen: dict[int, float] = {}

    def saw(self, version: int, at: float) -> None:
        if version not in self.first_seen or at < self.first_seen[version]:
            self.first_seen[version] = at

    def first_at_least(self, version: int) -> float | None:
        times = [t for v, t in self.first_seen.items() if v >= version]
        return min(times) if times else None

    @property
    def latest(self) -> int:
        return max(self.first_seen, default=0)


@dataclass
class Record:
    """One simulated request, as written to the JSONL file."""

    ts: float  # unix seconds when the request was sent
    user: int
    phase: str
    prompt: int  # index into the simulation's prompts (`PROMPTS` unless given)
    response_id: str = ""
    version: int | None = None  # version of the first token
    last_version: int | None = None  # version of the last token (in-flight updates can differ)
    ttft_ms: float | None = None
    itl_ms: dict[str, float | None] = field(default_factory=dict)  # p50/p99/max, n gaps
    total_ms: float | None = None
    words: int | None = None
    finish_reason: str = ""
    matched: bool | None = None
    score: float | None = None
    feedback: str = ""  # "" (not sent) | "accepted" | "duplicate" | "error: ..."
    feedback_ts: float | None = None  # unix seconds when the feedback was sent
    error: str = ""
    answer: str = ""  # the text, to see what the users rewarded
    tenant: str | None = None  # whose lineage served it (X-Hotloop-Tenant); None: not said

    @property
    def cut_off(self) -> bool:
        """The token limit ended the answer, not the model."""
        return self.finish_reason == "length"

    def meets(self, pref: Preference) -> bool:
        """Whether this answer meets `pref` (judged again, as a tenant's report does for the
        other tenants' preferences)."""
        return pref.matched(self.answer, cut_off=self.cut_off)


def itl_summary(gaps_ms: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(gaps_ms, 50), "p99": percentile(gaps_ms, 99),
            "max": max(gaps_ms) if gaps_ms else None, "n": len(gaps_ms)}


def summarize(records: list[Record]) -> dict:
    """Totals and latency percentiles of a set of records (one phase, or all)."""
    ok = [r for r in records if not r.error]
    itl_p50 = [r.itl_ms.get("p50") for r in ok if r.itl_ms.get("n")]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "matched_share": (sum(bool(r.matched) for r in ok) / len(ok)) if ok else None,
        "score_mean": statistics.fmean(r.score for r in ok) if ok else None,
        "words_mean": statistics.fmean(r.words for r in ok) if ok else None,
        "ttft_ms": {"p50": percentile((r.ttft_ms for r in ok), 50),
                    "p95": percentile((r.ttft_ms for r in ok), 95),
                    "p99": percentile((r.ttft_ms for r in ok), 99)},
        # p50: the median of per-request ITL medians; p95/p99: of per-request p99s (a stream's
        # longest stalls)
        "itl_ms": {"p50": percentile(itl_p50, 50),
                   "p95": percentile((r.itl_ms.get("p99") for r in ok if r.itl_ms.get("n")), 95),
                   "p99": percentile((r.itl_ms.get("p99") for r in ok if r.itl_ms.get("n")), 99)},
        "feedback": {"sent": sum(bool(r.feedback) for r in records),
                     "accepted": sum(r.feedback in ("accepted", "duplicate") for r in records),
                     "errors": sum(r.feedback.startswith("error") for r in records)},
        "versions": sorted({r.version for r in ok if r.version is not None}),
    }


# ---- where the users go -------------------------------------------------------------------------


@dataclass
class Target:
    """Where the users go: the gateway's base URL (no `/v1`) and one user API key."""

    base_url: str
    api_key: str


# ---- the users ----------------------------------------------------------------------------


@dataclass
class SimConfig:
    users: int = 4
    requests_per_user: int = 0  # 0: unbounded (then duration_s bounds the run)
    duration_s: float = 0.0  # 0: unbounded (then requests_per_user bounds the run)
    rate: float = 0.0  # requests started per second, all users together; 0: no limit
    max_tokens: int = 128
    temperature: float = 1.0
    feedback: bool = True  # False: score locally, send nothing (the idle phase)
    window: int = 40
    request_timeout_s: float = 120.0
    seed: int = 0
    phase: str = "run"
    progress_s: float = 5.0  # 0: no progress lines


class RateLimiter:
    """Starts at most `rate` requests per second (evenly spaced), across all users."""

    def __init__(self, rate: float):
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self._next = 0.0
        self._lock = asyncio.Lock()

    async def wait(self) -> None:
        if not self.interval:
            return
        async with self._lock:
            now = time.monotonic()
            delay = max(0.0, self._next - now)
            self._next = max(now, self._next) + self.interval
        if delay:
            await asyncio.sleep(delay)


class Simulation:
    """N users against one gateway. `run()` returns when the bound is reached or `stop()`;
    `cfg.feedback` and `cfg.phase` may be changed while it runs (the demo's phases)."""

    def __init__(self, target: Target, cfg: SimConfig, preference: Preference,
                 out_path: str | Path | None = None, clock: VersionClock | None = None,
                 status_extra: Callable[[], str] | None = None,
                 prompts: Sequence[str] = PROMPTS):
        if not prompts:
            raise ValueError("the users need at least one prompt")
        self.target, self.cfg, self.preference = target, cfg, preference
        self.prompts = tuple(prompts)
        self.clock = clock or VersionClock()
        self.records: list[Record] = []
        self.share = SlidingShare(cfg.window)
        self.feedback_sent: dict[str, float] = {}  # response id -> unix seconds sent
        # user -> the phase of the request it is streaming now: a caller switching phases can
        # wait until no request of the old phase is still running
        self.in_flight: dict[int, str] = {}
        self.status_extra = status_extra
        self._out = open(out_path, "a") if out_path else None
        self._stop = asyncio.Event()
        self._limiter = RateLimiter(cfg.rate)
        self._rng = random.Random(cfg.seed)
        self._deck = PromptDeck(len(self.prompts), self._rng)
        self._model: str | None = None
        self._t0 = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _bounded(self) -> bool:
        if self._stop.is_set():
            return True
        return bool(self.cfg.duration_s) and time.monotonic() - self._t0 >= self.cfg.duration_s

    async def run(self) -> dict:
        import httpx
        import openai

        if not (self.cfg.requests_per_user or self.cfg.duration_s):
            raise ValueError("bound the run: set requests_per_user or duration_s")
        timeout = httpx.Timeout(self.cfg.request_timeout_s, connect=10.0)
        limits = httpx.Limits(max_connections=self.cfg.users * 2 + 4)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            client = openai.AsyncOpenAI(base_url=f"{self.target.base_url}/v1", api_key=self.target.api_key,
                                        max_retries=0, timeout=timeout, http_client=http)
            self._model = (await client.models.list()).data[0].id
            self._t0 = time.monotonic()
            progress = asyncio.create_task(self._progress()) if self.cfg.progress_s else None
            try:
                await asyncio.gather(*(self._user(u, client, http) for u in range(self.cfg.users)))
            finally:
                if progress:
                    progress.cancel()
                if self._out:
                    self._out.flush()
        return summarize(self.records)

    async def halt(self, run: asyncio.Task) -> None:
        """Stop the users, wait for `run` (the task of this simulation's `run()`) to end and
        close the records file. For a caller that is ending anyway: what the task raised is
        not raised again (its records say what failed)."""
        self.stop()
        run.cancel()  # no-op once it has ended
        try:
            await run
        except (asyncio.CancelledError, Exception):
            pass
        self.close()

    def close(self) -> None:
        if self._out:
            self._out.close()
            self._out = None

    async def _user(self, uid: int, client, http) -> None:
        n = 0
        while not self._bounded() and (not self.cfg.requests_per_user or n < self.cfg.requests_per_user):
            await self._limiter.wait()
            if self._bounded():
                return
            n += 1
            rec = await self.one(uid, client, http)
            self.records.append(rec)
            if self._out:
                self._out.write(json.dumps(asdict(rec)) + "\n")

    async def one(self, uid: int, client, http) -> Record:
        """One request, streamed, scored, rated. Never raises for an HTTP failure."""
        import openai

        pi = self._deck.draw()
        # the phase at the start decides: an answer begun in the idle phase is never rated
        rec = Record(ts=time.time(), user=uid, phase=self.cfg.phase, prompt=pi)
        self.in_flight[uid] = rec.phase
        rate = self.cfg.feedback
        t0 = time.perf_counter()
        text: list[str] = []
        gaps: list[float] = []
        last = None
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=self._model, messages=[{"role": "user", "content": self.prompts[pi]}],
                max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature, stream=True)
            rec.response_id = raw.headers.get("x-hotloop-response-id", "")
            rec.tenant = raw.headers.get("x-hotloop-tenant")
            stream = raw.parse()
            if inspect.isawaitable(stream):  # the client's versions differ here
                stream = await stream
            async for chunk in stream:
                now = time.perf_counter()
                rec.response_id = rec.response_id or chunk.id
                version = getattr(chunk, "policy_version", None)
                for choice in chunk.choices:
                    if choice.finish_reason:
                        rec.finish_reason = choice.finish_reason
                    if not choice.delta or not choice.delta.content:
                        continue
                    text.append(choice.delta.content)
                    if last is None:
                        rec.ttft_ms = (now - t0) * 1e3
                    else:
                        gaps.append((now - last) * 1e3)
                    last = now
                    if version is not None:
                        v = int(version)
                        self.clock.saw(v, time.time())
                        if rec.version is None:
                            rec.version = v
                        rec.last_version = v
            if rec.version is None and raw.headers.get("x-hotloop-policy-version"):
                rec.version = rec.last_version = int(raw.headers["x-hotloop-policy-version"])
        except (openai.APIError, OSError, ValueError) as e:
            rec.error = _describe(e)
        finally:
            self.in_flight.pop(uid, None)
        rec.total_ms = (time.perf_counter() - t0) * 1e3
        if rec.error:
            return rec
        answer = rec.answer = "".join(text)
        rec.itl_ms = itl_summary(gaps)
        rec.words = word_count(answer)
        rec.matched = rec.meets(self.preference)
        rec.score = round(self.preference.score(answer, cut_off=rec.cut_off), 4)
        self.share.add(rec.matched)
        # rated only if the user rates both when asking and when done reading: a user who
        # stopped rating meanwhile (the end of a phase, a tenant's pause) leaves it unrated
        if rate and self.cfg.feedback and rec.response_id:
            rec.feedback_ts = time.time()
            rec.feedback = await self.send_feedback(http, rec.response_id, rec.score)
            if rec.feedback in ("accepted", "duplicate"):
                self.feedback_sent[rec.response_id] = rec.feedback_ts
        return rec

    async def send_feedback(self, http, response_id: str, score: float) -> str:
        import httpx

        try:
            r = await http.post(f"{self.target.base_url}/v1/feedback",
                                headers={"Authorization": f"Bearer {self.target.api_key}"},
                                json={"response_id": response_id, "score": score})
        except httpx.HTTPError as e:
            return f"error: {_describe(e)}"
        if r.status_code != 200:
            return f"error: HTTP {r.status_code} {r.text[:200]}"
        try:
            body = r.json()
        except ValueError:
            return "accepted"
        return "duplicate" if body.get("reason") == "duplicate" or body.get("duplicate") else "accepted"

    def status_line(self) -> str:
        recent = self.records[-self.cfg.window:]
        ok = [r for r in recent if not r.error]
        errors = sum(bool(r.error) for r in self.records)
        share = self.share.value
        ttft = percentile((r.ttft_ms for r in ok), 50)
        itl = percentile((r.itl_ms.get("p50") for r in ok if r.itl_ms.get("n")), 50)
        parts = [f"{time.monotonic() - self._t0:5.0f}s", self.cfg.phase,
                 f"reqs {len(self.records)} (err {errors})",
                 f"match {share:.2f}" if share is not None else "match -",
                 f"v{self.clock.latest}",
                 f"ttft p50 {ttft:.0f} ms" if ttft is not None else "ttft -",
                 f"itl p50 {itl:.0f} ms" if itl is not None else "itl -"]
        if self.status_extra:
            parts.append(self.status_extra())
        return "  ".join(parts)

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.progress_s)
            print(f"[simulate] {self.status_line()}", flush=True)


def _describe(e: BaseException) -> str:
    status = getattr(e, "status_code", None)
    text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    return f"HTTP {status}: {text}" if status else f"{type(e).__name__}: {text}"
