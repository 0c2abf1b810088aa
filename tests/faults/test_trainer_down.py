"""The online trainer as a real process (`python -m services.trainer`, as `hotloop up` starts
it) in a real mesh: NATS, a rollout replica (vLLM, lora mode, tiny model) on port 0 and the
gateway (HTTP, official openai client). Users are served and give feedback through the
gateway; the trainer trains on it and pushes versions to the replica. Then the trainer goes
away: SIGKILL (users keep being served on its last version) and SIGTERM (it stops within
seconds, and what it had not acked stays in JetStream for the next run)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from tests.gateway.conftest import KEY, start_gateway

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
REPO = Path(__file__).resolve().parents[2]
TOKEN = "faults-admin-token"
HI = [{"role": "user", "content": "Say hello."}]
IDLE_S = 3.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(tiny_model, tmp_path_factory):
    from launch.natsserver import NatsServer
    from services.rollout.config import RolloutConfig
    from services.rollout.core import RolloutCore
    from services.rollout.server import serve as serve_rollout

    cfg = RolloutConfig(update_mode="lora", max_lora_rank=16, max_prompt_tokens=200, max_n=4,
                        max_new_tokens=32, default_max_tokens=8, kv_cache_gib=1, swap_drain_timeout_s=30)
    core = RolloutCore(cfg, tiny_model, base_model=str(tiny_model), max_model_len=512,
                       storage_dir=tmp_path_factory.mktemp("rollout") / "adapters")
    nats = NatsServer(tmp_path_factory.mktemp("nats")).start()
    await core.start()
    server, port, _ = await serve_rollout(core, "127.0.0.1:0", TOKEN)
    rollout = f"127.0.0.1:{port}"
    gw = await start_gateway([rollout], nats.url, max_tokens=32, default_max_tokens=8)
    yield nats.url, rollout, gw
    await gw.stop()
    await server.stop(0)
    await core.stop()
    nats.stop()


class Trainer:
    """`python -m services.trainer` with its own run directory and durable consumer."""

    def __init__(self, tmp: Path, nats_url: str, rollout: str, model: Path, name: str):
        self.dir = tmp / name
        self.dir.mkdir()
        self.port_file = self.dir / "port.json"
        self.log = self.dir / "trainer.log"
        self.durable = f"faults-{name}"
        sets = {
            "nats.url": nats_url, "endpoints.rollout": json.dumps([rollout]), "model.name": str(model),
            "security.admin_token": TOKEN, "run_dir": str(self.dir),
            "model.dtype": "float32", "trainer.torch_threads": "1",
            "online.batch_size": "1", "online.batch_window_s": "0", "online.durable": self.durable,
            "online.out_dir": str(self.dir), "online.run_id": "run",
            "online.max_staleness_versions": "1000",  # earlier tests' feedback trains too
        }
        cmd = [sys.executable, "-m", "services.trainer", "--port-file", str(self.port_file)]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOTLOOP__")}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         env={**env, "PYTHONUNBUFFERED": "1"})

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""

    async def ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            assert self.proc.poll() is None, f"trainer exited {self.proc.returncode}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"trainer not ready in {timeout_s}s:\n{self.tail()}"
            await asyncio.sleep(0.1)

    def records(self, kind: str) -> list[dict]:
        """metrics.jsonl's records of one kind ("step", "settled")."""
        path = self.dir / "run" / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [r[kind] for r in map(json.loads, lines) if kind in r]

    def steps(self) -> list[dict]:
        return self.records("step")

    async def trained(self, n: int, timeout_s: float = 120) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while sum(s["feedback"] for s in self.steps()) < n:
            assert self.proc.poll() is None, f"trainer exited {self.proc.returncode}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"{n} feedback not trained in {timeout_s}s:\n{self.tail()}"
            await asyncio.sleep(0.1)
        return self.steps()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


async def serve(gw, n: int = 1):
    """One user request through the gateway, n choices."""
    return await gw.openai().chat.completions.create(model="tiny", messages=HI, max_tokens=8, n=n)


async def rate(gw, r, score: float) -> None:
    """The user's feedback on each choice of response `r`."""
    async with httpx.AsyncClient() as http:
        for choice in range(len(r.choices)):
            fb = await http.post(f"{gw.base_url}/feedback", headers={"Authorization": f"Bearer {KEY}"},
                                 json={"response_id": r.id, "choice": choice, "score": score})
            assert fb.status_code == 200 and fb.json()["accepted"], fb.text


async def stream_size(gw) -> int:
    """Feedback in the stream: a new trainer's durable consumer starts at the first of them,
    so it trains this module's earlier feedback too."""
    return (await gw.bus.js.stream_info("FEEDBACK")).state.messages


async def test_with_the_trainer_killed_users_are_served_on_its_last_version(mesh, tiny_model, tmp_path):
    nats_url, rollout, gw = mesh
    trainer = Trainer(tmp_path, nats_url, rollout, tiny_model, "killed")
    try:
        await trainer.ready()
        await rate(gw, await serve(gw), 1.0)
        last = (await trainer.trained(await stream_size(gw)))[-1]["version"]
        deadline = time.monotonic() + 30
        while (await serve(gw)).model_extra["policy_version"] != last:  # the push has landed
            assert time.monotonic() < deadline, f"the gateway never served v{last}"
        trainer.kill()  # SIGKILL: no cleanup of any kind

        # users keep being served on the last version, and their feedback is still taken
        # (stored in JetStream for the trainer's next run)
        await asyncio.sleep(1.0)  # past the gateway's health polls
        for stream in (False, True, False):
            r = await gw.openai().chat.completions.create(model="tiny", messages=HI, max_tokens=8,
                                                          stream=stream)
            if stream:
                chunks = [c async for c in r]
                assert chunks and {c.model_extra["policy_version"] for c in chunks} == {last}
            else:
                assert r.choices[0].finish_reason in ("stop", "length")
                assert r.model_extra["policy_version"] == last
        await rate(gw, r, -1.0)
        assert gw.core.router.states[0].healthy
    finally:
        trainer.kill()


async def test_sigterm_stops_the_trainer_within_seconds_and_leaves_unacked_feedback_in_jetstream(
        mesh, tiny_model, tmp_path):
    nats_url, rollout, gw = mesh
    trainer = Trainer(tmp_path, nats_url, rollout, tiny_model, "stopped")
    try:
        await trainer.ready()
        await rate(gw, await serve(gw), 1.0)
        await trainer.trained(await stream_size(gw))
        # waiting for feedback, as a trainer mostly is: its pull requests expire every second
        await asyncio.sleep(IDLE_S)
        for i in range(3):  # 12 feedback: seconds of training at one update each
            await rate(gw, await serve(gw, n=4), 1.0 if i % 2 else -1.0)
        total = await stream_size(gw)
        await trainer.trained(total - 11)  # training again, with more feedback fetched or waiting
        t0 = time.monotonic()
        trainer.proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(trainer.proc.wait, 60)
        stop_s = time.monotonic() - t0
    finally:
        trainer.kill()
    assert rc == 0, trainer.tail()
    assert stop_s < 5.0, f"took {stop_s:.1f}s to stop:\n{trainer.tail()}"
    trained = sum(s["feedback"] for s in trainer.steps())
    settled = len(trainer.records("settled"))  # refused (stale, malformed) and acked: none here
    # every feedback was trained (or settled) and acked, or it is still in JetStream for the
    # next run: none lost. The server applies the trainer's last acks from its own queue, so a
    # read can still count some as waiting: read until the sum holds or 10 s pass.
    deadline = time.monotonic() + 10
    while True:
        info = await gw.bus.js.consumer_info("FEEDBACK", trainer.durable)
        waiting = info.num_pending + info.num_ack_pending
        if trained + settled + waiting == total or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert trained >= 1 and waiting >= 1, (trained, info)
    assert trained + settled + waiting == total, (trained, settled, info)
