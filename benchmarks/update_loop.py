"""`hotloop bench update-loop`: the online loop's latency, one feedback at a time, from
feedback sent to the first token a user receives from a version trained on it, with users
streaming meanwhile; and where each loop's time went, stage by stage, from the traces.

Owns: the loops (rate the newest answer nobody rated, wait for a version trained on it to
reach a user, or count the feedback lost), the stage budget (`loop_stages`) and its table.
Does not own the mesh, the trainer or the users: the online demo's stack (`launch.stack`),
its tracker (`measure.loop.LoopTracker`) and users (`measure.users`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from pathlib import Path

from launch.stack import DEFAULT_CONFIG, Stack, start_stack
from measure.loop import LoopTracker
from measure.users import Brevity, SimConfig, Simulation, percentile, summarize
from measure.traces import read_trace_spans
from benchmarks.common import exit_code, report, run_interruptible, say_as, sigterm_interrupts

say = say_as("update-loop")

LOOP_STAGES = ("ingest", "consume", "join", "reference", "train", "pack", "push", "load", "first_token")


def loop_stages(spans: list[dict], loops: list[dict]) -> dict[str, list[float]]:
    """Per-loop stage times (ms) along the loop's critical path, from the traces: the
    trainer's `online.step` children; push (publish started -> the replica started loading:
    archive, send); load (the replica's PushAdapter server span: verify, merge, swap); and the
    ends the traces cannot see: ingest (feedback sent -> the update started) and first token
    (the replica loaded it -> a user's first token from it, 0 when a token came first). The
    stages follow each other in time, so they add up to the loop. The announce on the bus runs
    after the load and is off the path."""
    by_id = {s["span_id"]: s for s in spans}
    children = defaultdict(list)
    for s in spans:
        children[s["parent"]].append(s)
    publish = {}
    for s in spans:
        if s["name"] == "publish" and s["attrs"].get("hotloop.version") is not None:
            publish[int(s["attrs"]["hotloop.version"])] = s
    out: dict[str, list[float]] = defaultdict(list)
    for lp in loops:
        pub = publish.get(lp["version"])
        step = by_id.get(pub["parent"]) if pub else None
        if pub is None or step is None or step["name"] != "online.step":
            continue
        kids = {c["name"]: c for c in children[step["span_id"]]}
        out["ingest"].append((step["start"] - lp["sent"]) * 1e3)
        for name in ("consume", "join", "reference", "train", "pack"):
            if name in kids:
                out[name].append((kids[name]["end"] - kids[name]["start"]) * 1e3)
        loads = [s for s in spans if s["trace"] == pub["trace"] and s["name"].endswith("PushAdapter")
                 and s["start"] >= pub["start"] and _is_server(s, by_id)]
        first = lp["first_token"]
        if loads:  # one replica here; with several, the slowest one bounds the path
            load = max(loads, key=lambda s: s["end"])
            out["push"].append((load["start"] - pub["start"]) * 1e3)
            # An in-flight swap serves the new weights before PushAdapter returns (it still
            # retires old versions): the load ends, for the loop, at the first token if sooner.
            out["load"].append((min(load["end"], first) - load["start"]) * 1e3)
            live = load["end"]
        else:
            out["push"].append((pub["end"] - pub["start"]) * 1e3)
            live = pub["end"]
        out["first_token"].append(max(0.0, first - live) * 1e3)
    return out


def _is_server(span: dict, by_id: dict) -> bool:
    """A gRPC server span: its parent is the client span of the same call (another process)."""
    parent = by_id.get(span["parent"])
    return parent is not None and parent["name"] == span["name"]


def main(args) -> int:
    """`hotloop bench update-loop`."""
    logging.basicConfig(level=os.environ.get("HOTLOOP_LOG_LEVEL", "WARNING"))
    config_path = args.config or str(DEFAULT_CONFIG)
    out = Path(args.out_dir) / time.strftime("update-loop-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    # One feedback per update: each loop is one feedback, trained alone, published, served.
    overrides = ["online.batch_size=1", "online.batch_window_s=0", "telemetry.exporter=jsonl", *args.set]
    say(f"starting the mesh; run files under {out}")
    try:
        with sigterm_interrupts():
            stack = start_stack(config_path, overrides, out, quiet=True)
    except KeyboardInterrupt:
        return exit_code(interrupted=True)
    result: dict = {}
    try:
        _, interrupted = run_interruptible(_bench(stack, args, out, result))
    finally:
        stack.stop()  # flushes every process's spans
    if interrupted and not result.get("loops_detail"):
        return exit_code(interrupted=True)
    spans = read_trace_spans(sorted((out / "mesh" / "traces").glob("*.jsonl")))
    stages = loop_stages(spans, result["loops_detail"])
    loop_ms = [e["loop_ms"] for e in result["loops_detail"]]
    summary = {
        "loop_ms": {"p50": percentile(loop_ms, 50), "p95": percentile(loop_ms, 95)},
        "loops": len(loop_ms),
        "lost_feedback": result["lost"],
        "stages_ms": {s: percentile(stages[s], 50) for s in LOOP_STAGES if stages.get(s)},
        "stages_p95_ms": {s: percentile(stages[s], 95) for s in LOOP_STAGES if stages.get(s)},
        "per_loop": [{"version": e["version"], "loop_ms": round(e["loop_ms"], 1)}
                     for e in result["loops_detail"]],
        "background": result["background"],
        "interrupted": interrupted,
    }
    report(summary, args.json, table=markdown(summary), markdown=True, say=say)
    return exit_code(interrupted)


async def _bench(stack: Stack, args, out: Path, result: dict) -> None:
    tracker = LoopTracker(stack.info.nats_url, stack.metrics_path)
    await tracker.start()
    result.update(loops_detail=[], lost=0, background={})
    # Background users stream without rating: they carry the new versions' first tokens.
    cfg = SimConfig(users=args.users, duration_s=24 * 3600, max_tokens=args.max_tokens,
                    feedback=False, phase="background", progress_s=0)
    sim = Simulation(stack.target, cfg, Brevity(args.max_words), out / "requests.jsonl")
    users = asyncio.create_task(sim.run())
    import httpx

    try:
        async with httpx.AsyncClient(timeout=30.0) as http:
            rated: set[str] = set()
            for i in range(args.loops):
                # rate the newest finished answer nobody rated yet
                while True:
                    fresh = [r for r in sim.records if r.response_id and not r.error and r.response_id not in rated]
                    if fresh:
                        break
                    if users.done():
                        users.result()
                        raise RuntimeError("the background users stopped")
                    await asyncio.sleep(0.05)
                rec = fresh[-1]
                rated.add(rec.response_id)
                before = max(tracker.trained_version, sim.clock.latest)
                sent = time.time()
                outcome = await sim.send_feedback(http, rec.response_id, rec.score)
                if outcome not in ("accepted", "duplicate"):
                    result["lost"] += 1
                    say(f"loop {i + 1}: feedback refused ({outcome})")
                    continue
                sim.feedback_sent[rec.response_id] = sent
                deadline = time.monotonic() + args.loop_timeout_s
                entry = None
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                    if (why := stack.dead()) is not None:
                        raise RuntimeError(why)
                    v = tracker.trained_in.get(rec.response_id)
                    if v is not None and v > before and sim.clock.first_at_least(v) is not None:
                        entry = [e for e in tracker.loops(sim.feedback_sent, sim.clock)
                                 if e["response_id"] == rec.response_id][0]
                        break
                if entry is None:
                    result["lost"] += 1
                    say(f"loop {i + 1}: no first token from a version trained on the feedback "
                        f"within {args.loop_timeout_s:g} s")
                    continue
                result["loops_detail"].append(entry)
                done = [e["loop_ms"] for e in result["loops_detail"]]
                say(f"loop {i + 1}/{args.loops}: {entry['loop_ms']:.0f} ms (v{entry['version']}; "
                    f"p50 so far {percentile(done, 50):.0f} ms)")
    finally:
        await sim.halt(users)
        await tracker.close()
        s = summarize(sim.records)
        result["background"] = {"users": args.users, "requests": s["requests"], "errors": s["errors"],
                                "ttft_ms_p50": s["ttft_ms"]["p50"], "itl_ms_p50": s["itl_ms"]["p50"]}


def markdown(summary: dict) -> str:
    """The loop's latency and its stage budget (p50 and p95 per stage, share of the p50s); past
    the 1000 ms aim, the largest stages and what would shrink each."""
    lm = summary["loop_ms"]
    stages = summary["stages_ms"]
    total = sum(v for v in stages.values() if v) or 1.0
    lines = ["# hotloop bench update-loop", "",
             f"{summary['loops']} loops, lost feedback {summary['lost_feedback']}: p50 "
             f"{_f(lm['p50'], '.0f')} ms, p95 {_f(lm['p95'], '.0f')} ms", "",
             "| stage | p50 ms | share | p95 ms |", "|---|---|---|---|"]
    for name, v in stages.items():
        lines.append(f"| {name} | {v:.0f} | {v / total:.0%} | {summary['stages_p95_ms'][name]:.0f} |")
    if lm["p50"] is not None and lm["p50"] >= 1000 and stages:
        lines += ["", f"p50 is {lm['p50'] - 1000:.0f} ms over the 1000 ms aim. Largest stages first:"]
        for name, v in sorted(stages.items(), key=lambda kv: -(kv[1] or 0))[:3]:
            lines.append(f"- {name}: {v:.0f} ms — {_HINTS.get(name, '')}")
    return "\n".join(lines) + "\n"


_HINTS = {
    "train": "one LoRA step on the CPU; fewer LoRA layers (target q/v only), a lower rank or "
             "bf16 on AMX hardware shrink it; on a GPU it is tens of ms",
    "load": "the replica's verify + merge + drain; the drain waits for in-flight requests in "
            "merged mode: in-flight weight updates (or LoRA slots) remove the wait",
    "first_token": "a version is live but no user request has produced a token from it yet: "
                   "in-flight updates switch running streams at the next token",
    "push": "packing and sending the adapter; a smaller adapter (rank, layers) is less to pack",
    "ingest": "gateway publish + JetStream delivery + the trainer's fetch (its fetch timeout)",
    "reference": "the KL reference pass: kl_beta = 0 removes it",
    "pack": "saving the adapter to disk before the push",
    "consume": "the batch window: batch_window_s = 0 with batch_size = 1",
}


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)
