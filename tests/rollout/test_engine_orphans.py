"""`kill -9` of a process that built a vLLM engine takes the engine's processes down with it
(hotloop/enginewatch.py, a vLLM general plugin that sets PR_SET_PDEATHSIG in EngineCore and
every worker). Real processes: `python -m services.rollout` and `hotloop bench hot-update`
on the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ENGINE_NAMES = ("EngineCore", "VLLM::Worker")


def engine_descendants(pid: int) -> list[psutil.Process]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in kids:
        try:
            if any(n in " ".join(p.cmdline()) or n in p.name() for n in ENGINE_NAMES):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def kill_and_check(proc: subprocess.Popen, engines: list[psutil.Process]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    gone, alive = psutil.wait_procs(engines, timeout=5)
    for p in alive:  # never leave an engine behind, even when the test fails
        p.kill()
    assert not alive, f"engine processes survived their parent: {[p.pid for p in alive]}"


def wait_for_engines(proc: subprocess.Popen, want: int, timeout: float, ready=lambda: True):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process exited early with {proc.returncode}"
        engines = engine_descendants(proc.pid)
        if len(engines) >= want and ready():
            return engines
        time.sleep(0.5)
    raise AssertionError(f"no engine processes under {proc.pid} after {timeout}s")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("HOTLOOP_ENGINE_PDEATHSIG", None)  # the process under test must arm it itself
    e.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return e


def test_killed_benchmark_leaves_no_engine(tiny_model, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "apps.cli", "bench", "hot-update", "--model", str(tiny_model),
         "--pushes", "2", "--rank", "8"],
        cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        engines = wait_for_engines(proc, 2, 300)
        kill_and_check(proc, engines)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_engine_bound_to_a_core_starts_all_its_processes_there_and_dies_with_the_service(
        tiny_model, tmp_path):
    """`cpu_omp_threads_bind` = a core: the worker and the engine core process (which spins
    waiting for the worker) run there, and the service itself keeps every core it had. Then
    `kill -9` of the service, once it serves (the engine fully up), takes the engine down."""
    cpus = sorted(os.sched_getaffinity(0))
    core = cpus[-1]
    port_file = tmp_path / "port.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.rollout", "--port-file", str(port_file),
         "--set", f"model.name={tiny_model}", "--set", "model.max_model_len=512",
         "--set", "rollout.kv_cache_gib=1", "--set", f'rollout.cpu_omp_threads_bind="{core}"',
         "--set", f"run_dir={tmp_path / 'run'}"],
        cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        engines = wait_for_engines(proc, 2, 300, ready=port_file.exists)
        for p in engines:
            assert p.cpu_affinity() == [core], (p.name(), p.cpu_affinity())
        service = psutil.Process(proc.pid)
        assert sorted(service.cpu_affinity()) == cpus
        assert all(sorted(t_aff) == cpus for t_aff in
                   (os.sched_getaffinity(t.id) for t in service.threads()))
        kill_and_check(proc, engines)
    finally:
        if proc.poll() is None:
            proc.kill()
