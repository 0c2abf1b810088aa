"""hotloop.service's runner in-process: a real gRPC server on port 0, the port file, and an
ordered shutdown."""

from __future__ import annotations

import asyncio
import json

from hotloop import config as hconfig
from hotloop import service
from hotloop.errors import FatalError
from hotloop.grpcutil import create_server


async def test_stopping_is_not_a_failure_while_cleanups_take_down_what_check_watches(tmp_path, monkeypatch):
    """The watchdog polls `check()`; the cleanups stop what it checks (the rollout's engine),
    so a poll during them would turn an ordinary stop into "fatal" and exit code 1."""
    monkeypatch.setattr(service, "WATCH_INTERVAL_S", 0.02)
    state = {"stopping": False, "checks": 0, "checks_while_stopping": 0}
    built: dict = {}
    port_file = tmp_path / "svc.port"

    def check() -> None:
        state["checks"] += 1
        if state["stopping"]:
            state["checks_while_stopping"] += 1
            raise FatalError("the engine is gone")

    async def slow_stop() -> None:  # an engine whose shutdown takes a while
        state["stopping"] = True
        await asyncio.sleep(0.3)

    async def build(mesh, cfg) -> service.Running:
        server, port, health = await create_server([], [], "127.0.0.1:0")
        built["server"] = server
        return service.Running(server, port, health, [slow_stop], check=check)

    mesh = hconfig.MeshConfig(run_dir=str(tmp_path))
    main = asyncio.create_task(service._main("svc", mesh, hconfig.ServiceSection(), build, str(port_file)))
    while state["checks"] < 3:  # serving, and watched
        assert not main.done(), main
        await asyncio.sleep(0.01)
    ports = json.loads(port_file.read_text())
    assert ports["port"] > 0 and ports["metrics_port"] > 0
    await built["server"].stop(0)  # what a signal leads to: the cleanups run next
    await asyncio.wait_for(main, 10)  # returns: no SystemExit
    assert state["stopping"] and state["checks_while_stopping"] == 0
