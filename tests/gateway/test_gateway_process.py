"""The gateway as a process: `hotloop up` starts it with a generated key file and records its
HTTP URL; without keys it refuses to start. The replica is the scripted one, in a thread."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import openai
import pytest

from hotloop import config
from launch.mesh import Mesh, MeshInfo

from .fake_rollout import WORDS, start_fake


@pytest.fixture
def replica_in_thread():
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict = {}

    def run():
        asyncio.set_event_loop(loop)
        box["fake"], box["server"], box["addr"] = loop.run_until_complete(start_fake(version=5))
        started.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(30)
    yield box["addr"]
    asyncio.run_coroutine_threadsafe(box["server"].stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


def test_up_starts_the_gateway_with_a_generated_key_file(tmp_path, replica_in_thread):
    overrides = [f"run_dir={tmp_path}", f'endpoints.rollout=["{replica_in_thread}"]', "model.name=tiny"]
    cfg = config.load_mesh(config.raw_config(None, overrides, environ={}))
    mesh = Mesh(cfg, None, overrides, ["gateway"], quiet=True)
    try:
        info = mesh.start(timeout_s=60)
        saved = MeshInfo.load(tmp_path)
        assert saved.gateway_url == info.gateway_url and info.gateway_url.startswith("http://127.0.0.1:")
        assert oct((tmp_path / "user-keys").stat().st_mode & 0o777) == "0o600"
        key = saved.user_key()
        client = openai.OpenAI(base_url=saved.gateway_url, api_key=key, max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "".join(WORDS) and r.model_extra["policy_version"] == 5
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=saved.gateway_url, api_key="sk-not-a-key", max_retries=0).models.list()
        log = (tmp_path / "logs" / "gateway.log").read_text()
        assert key not in log
    finally:
        mesh.stop()
    assert not (tmp_path / "mesh.json").exists()


def test_gateway_without_keys_refuses_to_start(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "services.gateway", "--set", f"run_dir={tmp_path}",
         "--set", 'endpoints.rollout=["127.0.0.1:1"]', "--set", "nats.url=nats://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in __import__("os").environ.items() if not k.startswith("HOTLOOP__")},
    )
    assert p.returncode != 0
    assert "no user API keys configured" in p.stderr
    assert "Traceback" not in p.stderr


def test_the_gateway_finds_replicas_behind_a_dns_name(tmp_path, replica_in_thread):
    """`[endpoints] rollout = ["dns:///host:port"]` (a scaled compose service, a headless
    Service) routes to every address the name resolves to; here `localhost`."""
    import httpx

    port = replica_in_thread.rsplit(":", 1)[1]
    overrides = [f"run_dir={tmp_path}", f'endpoints.rollout=["dns:///localhost:{port}"]', "model.name=tiny"]
    cfg = config.load_mesh(config.raw_config(None, overrides, environ={}))
    mesh = Mesh(cfg, None, overrides, ["gateway"], quiet=True)
    try:
        info = mesh.start(timeout_s=60)
        client = openai.OpenAI(base_url=info.gateway_url, api_key=MeshInfo.load(tmp_path).user_key(),
                               max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert r.model_extra["policy_version"] == 5
        ready = httpx.get(info.gateway_url.removesuffix("/v1") + "/ready").json()
        assert ready["status"] == "ready"
    finally:
        mesh.stop()
    assert f"dns:///localhost:{port} resolves to [" in (tmp_path / "logs" / "gateway.log").read_text()


def test_a_malformed_dns_entry_refuses_to_start(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "services.gateway", "--set", f"run_dir={tmp_path}",
         "--set", 'security.user_tokens=["sk-test-key-1"]',
         "--set", 'endpoints.rollout=["dns:///rollout"]', "--set", "nats.url=nats://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in __import__("os").environ.items() if not k.startswith("HOTLOOP__")},
    )
    assert p.returncode != 0
    assert "want dns:///<host>:<port>" in p.stderr and "Traceback" not in p.stderr
