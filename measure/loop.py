"""The update loop seen from outside: which version trained on which feedback, and when each
version went live (`LoopTracker`), for the online demos and `hotloop bench update-loop`.

Follows one lineage's trainer through its `metrics.jsonl` (stream sequences per update), the
FEEDBACK stream (sequence -> response id) and `hotloop.weights.updated` on the bus. Does not
own the trainer or the users (`measure.users` records when a first token of each version
reached them).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from measure.users import Record, VersionClock, percentile


@dataclass
class Update:
    version: int
    seen_at: float  # unix seconds the demo saw the trainer's step record
    feedback: int
    score_mean: float
    response_ids: list[str] = field(default_factory=list)
    seconds: float = 0.0  # the update's stages, all together
    tokens: int = 0  # completion tokens trained
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage (turn_wait: a
    # lane of a shared trainer waiting for its turn)
    kl: float | None = None  # per-token KL of its batch to the base model (with kl_beta > 0)
    kl_coef: float | None = None  # the KL coefficient it trained with


class LoopTracker:
    """Follows one lineage's trainer from outside: its updates (metrics.jsonl) and the versions
    the bus announces for `tenant` (its own subject: `bus.weights_subject`). `loops()` pairs
    them with the users' feedback and first tokens."""

    def __init__(self, nats_url: str, metrics_path: Path, tenant: str = ""):
        self.nats_url, self.metrics_path, self.tenant = nats_url, metrics_path, tenant
        self.published_at: dict[int, float] = {}  # version -> unix seconds announced
        self.trained_in: dict[str, int] = {}  # response id -> first version trained on it
        self.trained_tenants: dict[str, int] = {}  # tenant a trained feedback names -> count
        self.updates: list[Update] = []
        self.settled: dict[str, int] = {}  # kind -> feedback the trainer dropped or dead-lettered
        self._offset = 0
        self._bus = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        from hotloop.bus import Bus, weights_subject
        from hotloop.proto.v1 import bus_pb2

        self._bus = await Bus.connect(self.nats_url, f"online-demo-{self.tenant}" if self.tenant
                                      else "online-demo")

        async def on_weights(msg, headers) -> None:
            if msg.tenant == self.tenant:
                self.published_at.setdefault(int(msg.info.version), time.time())

        await self._bus.subscribe(weights_subject(self.tenant), bus_pb2.WeightsUpdated, on_weights)
        self._task = asyncio.create_task(self._follow())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._bus:
            await self._bus.close()

    @property
    def trained_version(self) -> int:
        return max(self.published_at, default=0)

    async def _follow(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(0.25)

    async def poll(self) -> None:
        """Read new step records; resolve their stream sequences to response ids."""
        from hotloop.bus import decode
        from hotloop.proto.v1 import bus_pb2

        if not self.metrics_path.exists():
            return
        with open(self.metrics_path) as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind("\n") + 1  # a half-written last line waits for the next poll
        self._offset += len(chunk[:end].encode())
        for line in chunk[:end].splitlines():
            rec = json.loads(line) if line.strip() else {}
            if "settled" in rec:
                kind = rec["settled"]["kind"]
                self.settled[kind] = self.settled.get(kind, 0) + 1
            step = rec.get("step")
            if not step:
                continue
            up = Update(int(step["version"]), time.time(), int(step["feedback"]), float(step["score_mean"]),
                        seconds=sum(step["stage_seconds"].values()), tokens=int(step["tokens"]),
                        stages=dict(step["stage_seconds"]), kl=step.get("train", {}).get("kl"),
                        kl_coef=step.get("kl_coef"))
            for seq in step["seqs"]:
                raw = await self._bus.js.get_msg("FEEDBACK", seq)
                fb = decode(bus_pb2.FeedbackEvent, raw.data, dict(raw.headers or {}))
                up.response_ids.append(fb.response_id)
                self.trained_in.setdefault(fb.response_id, up.version)
                self.trained_tenants[fb.tenant] = self.trained_tenants.get(fb.tenant, 0) + 1
            self.updates.append(up)

    def loops(self, feedback_sent: dict[str, float], clock: VersionClock) -> list[dict]:
        """One entry per trained feedback whose version has reached a user yet; `live`: when
        the bus announced the version trained on it (None if unheard), which splits the loop
        into the trainer's side (sent -> live) and the users' (live -> a first token from it)."""
        out = []
        for rid, version in self.trained_in.items():
            sent, first = feedback_sent.get(rid), clock.first_at_least(version)
            if sent is not None and first is not None:
                out.append({"response_id": rid, "version": version, "sent": sent,
                            "live": self.published_at.get(version),
                            "first_token": first, "loop_ms": (first - sent) * 1e3})
        return sorted(out, key=lambda e: e["sent"])

    def lag(self, records: list[Record]) -> dict:
        """How far behind training the served versions were, at each response's first token:
        in versions, and in seconds since the first newer version was announced."""
        pub = sorted(self.published_at.items())
        versions, seconds = [], []
        for r in records:
            if r.error or r.version is None or r.ttft_ms is None:
                continue
            t = r.ts + r.ttft_ms / 1e3
            live = [v for v, at in pub if at <= t]
            newest = max(live, default=0)
            versions.append(max(0, newest - r.version))
            newer = [at for v, at in pub if v > r.version and at <= t]
            seconds.append(t - min(newer) if newer else 0.0)
        return {"versions": {"p50": percentile(versions, 50), "p99": percentile(versions, 99)},
                "seconds": {"p50": percentile(seconds, 50), "p99": percentile(seconds, 99)}}
