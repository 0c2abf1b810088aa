"""Run untrusted Python code against test cases, contained; outcomes are data, not exceptions.

Owns: detecting once, at start-up, how strongly this host can isolate a run and refusing to
start below the configured level (`IsolationUnavailable`); running one `SandboxJob` (the
code, then each test case) and classifying the outcome into a `SandboxResult` (`ok`,
`failed`, `timeout`, `oom`, `crash`, `error`). Does not own: extracting code from a
completion, rewards, concurrency (`pool.py`), or anything about tasks.

How a run is contained (each run: a fresh directory, a fresh process tree):
- always (`process`): a new session; an environment holding only PATH and LANG (nothing of
  the service's, so its secrets are not in `os.environ`); `python -I -S` (no site-packages,
  no PYTHON* variables, no user site); a fresh temporary working directory, removed after;
  rlimits on CPU seconds, address space, file size, open files, no core dumps; a wall-clock
  deadline after which the whole process tree is killed. A trusted reaper process (see
  `_launcher.py`) forks the child that runs the code, is its subreaper, and kills every
  process the code left behind, including ones that called setsid. When the service runs as
  root the code runs as an unprivileged uid (nobody) with no_new_privs: root-owned files
  such as /etc/shadow or a 0600 secret are unreadable, signals to root processes fail, and
  RLIMIT_NPROC applies (root ignores it).
- `namespaces`: the run gets its own network namespace (no interface but a down loopback:
  no network at all, 127.0.0.1 of the host unreachable), its own pid namespace (it sees only
  its own processes; `kill(-1, 9)` cannot reach the host; everything dies with the reaper),
  and its own mount namespace in which /tmp, /var/tmp and /dev/shm are small private tmpfs,
  `hidden_paths` (/root, /home, /run, ...) are empty, and the root filesystem is read-only,
  so nothing on the host can be written. The working directory lives in the private /tmp.
  As root this uses `unshare`; otherwise a user namespace (`unshare --user --map-root-user`),
  where the code runs as the service's own uid mapped to root in the namespace.
- `full`: additionally per-run cgroup v1 groups: `pids.max` (fork bombs) and a memory
  limit over all of the run's processes (an out-of-memory kill is reported as `oom`).

What is NOT isolated, at any level:
- Reading world-readable files outside the hidden paths (the repository checkout, /etc,
  the interpreter's files) works, read-only. Add directories to `hidden_paths` to hide them.
- CPU time and memory bandwidth are shared with the host (no cpu cgroup); many runs at once
  slow each other down, and a run only gets `wall_seconds` of wall time.
- The kernel is shared: a kernel exploit escapes every level (no seccomp, no VM).
- Path-based unix sockets outside the hidden paths that the sandbox uid may write to stay
  reachable (abstract sockets are per network namespace and are not).
- Below `full`: no total memory bound over several processes (RLIMIT_AS is per process),
  and RLIMIT_NPROC is shared by all runs of the same uid. At `process` level there is no
  network isolation, writable world-writable directories (/tmp) stay writable, and other
  processes are visible. As a non-root service at `process` level the code runs as the
  service's uid and can read what the service can, including /proc/<service>/environ.

Result integrity (reward hacking): the child writes one line with a per-run random nonce,
only after all test cases ran, to a channel that the code never sees before that; the
reaper reads it after the child exits and writes the record the service reads to a file the
child never holds. So printing "passed", writing files, `sys.exit(0)`, `os._exit(0)`,
closing stdio or patching builtins/modules cannot fake a pass. Residual risk: the nonce is
in the child's memory while the code runs (it is a local of the harness frame that calls
the code), so code that deliberately reads it (`sys._getframe(1).f_locals`, gc, ctypes),
writes a report line and exits wins; so does code whose return values lie about equality
(an object whose `__eq__` always returns True). Nothing run in the same process as the
code can rule this out; treat a policy that learns such tricks as a finding, not a success.
"""

from __future__ import annotations

import functools
import logging
import marshal
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from hotloop.errors import FatalError

from .config import ISOLATION_ORDER, IsolationLevel, SandboxConfig

log = logging.getLogger(__name__)

Status = Literal["ok", "failed", "timeout", "oom", "crash", "error"]

_LAUNCHER_SOURCE = (Path(__file__).parent / "_launcher.py").read_text()
# Python start-up and mount setup happen before the reaper's deadline starts; the service
# waits this much longer before killing the launcher itself (only a wedged host needs it).
_STARTUP_SLACK_S = 5.0
_RESULT_MAX = 1 << 20
_PRIVATE_DIRS = ("/var/tmp", "/dev/shm", "/run/lock")
_TMPFS_INODES = 4096
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class SandboxJob:
    """Code to run, then test cases run one by one in the code's namespace.

    Each case is a snippet (typically one assert, or a HumanEval test block plus
    `check(entry_point)`); it passes when it runs without raising.
    """

    code: str
    cases: tuple[str, ...]


@dataclass(frozen=True)
class SandboxResult:
    status: Status
    """ok: every case passed; failed: some did not (including code that raised while
    loading); timeout: wall or CPU limit; oom: out of memory (MemoryError or the memory
    cgroup); crash: died without reporting (signal, exit, closed channel); error: the sandbox
    itself failed (the host's fault, not the sample's)."""
    passed: int
    failed: int
    timed_out: bool
    exit_code: int | None
    """Exit code of the process that ran the code; negative: killed by that signal."""
    error: str
    """Why the sample did not pass: the first failing case's exception, the limit hit, ..."""
    stdout: str
    stderr: str
    seconds: float
    cpu_seconds: float = 0.0


@dataclass(frozen=True)
class IsolationReport:
    """What the host allowed, detected once by probe runs at start-up."""

    level: IsolationLevel
    namespaces: bool
    user_namespace: bool
    cgroups: bool
    uid: int
    """Host uid the code runs as."""
    hidden_paths: tuple[str, ...]
    notes: tuple[str, ...] = ()
    """Why each stronger level was not available."""

    def describe(self) -> str:
        parts = [f"isolation={self.level}", f"uid={self.uid}"]
        parts.append("net+pid+mount namespaces" if self.namespaces else "no namespaces")
        if self.user_namespace:
            parts.append("user namespace")
        parts.append("cgroups pids+memory" if self.cgroups else "no cgroups")
        if self.namespaces:
            parts.append(f"hidden={','.join(self.hidden_paths) or '-'}")
        return ", ".join(parts)


class IsolationUnavailable(FatalError):
    """The host cannot give the isolation the configuration requires."""


class _Cgroups:
    """Per-run cgroup v1 groups (pids, memory) under a parent made inside our own cgroup.

    Nesting under the service's own groups keeps whatever limits the host put on the service
    in force for the runs too.
    """

    CONTROLLERS = ("pids", "memory")
    PREFIX = "hotloop-sbx-"

    def __init__(self) -> None:
        mounts = _cgroup_v1_mounts()
        own = _own_cgroups()
        tag = f"{self.PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.parents: dict[str, str] = {}
        for c in self.CONTROLLERS:
            if c not in mounts or c not in own:
                raise OSError(f"cgroup v1 controller {c!r} is not mounted")
            mount_point, mount_root = mounts[c]
            rel = own[c][len(mount_root):] if own[c].startswith(mount_root) else own[c]
            base = os.path.join(mount_point, rel.lstrip("/"))
            _remove_stale_groups(base)
            parent = os.path.join(base, tag)
            os.mkdir(parent)  # raises when not writable: the level is then unavailable
            self.parents[c] = parent

    def create(self, name: str, max_pids: int, memory_bytes: int) -> dict[str, str]:
        groups = {c: os.path.join(p, name) for c, p in self.parents.items()}
        for path in groups.values():
            os.mkdir(path)
        _write(os.path.join(groups["pids"], "pids.max"), str(max_pids))
        mem = groups["memory"]
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
        if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
            # memory+swap at the same limit: the run cannot page its way past the limit
            _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
        return groups

    @staticmethod
    def oom_kills(groups: dict[str, str]) -> int:
        with open(os.path.join(groups["memory"], "memory.oom_control")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        # Kernels before 4.13 have no oom_kill counter; under_oom is the best left.
        return 0

    @staticmethod
    def destroy(groups: dict[str, str]) -> None:
        """Kill whatever is still in the groups, then remove them."""
        for path in groups.values():
            for _ in range(500):
                with open(os.path.join(path, "cgroup.procs")) as f:
                    pids = [int(p) for p in f.read().split()]
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if not pids:
                    try:
                        os.rmdir(path)
                        break
                    except OSError:  # EBUSY while the last tasks finish exiting
                        pass
                time.sleep(0.002)
            else:
                log.warning("could not remove cgroup %s", path)

    def close(self) -> None:
        for path in self.parents.values():
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass


def _remove_stale_groups(base: str) -> None:
    """Remove parents left by sandboxes whose process is gone (killed before `close`)."""
    for name in os.listdir(base):
        if not name.startswith(_Cgroups.PREFIX):
            continue
        pid = int(name[len(_Cgroups.PREFIX):].split("-")[0])
        try:
            os.kill(pid, 0)
            continue  # alive (or a reused pid): not ours to touch
        except ProcessLookupError:
            pass
        parent = os.path.join(base, name)
        runs = {d: os.path.join(parent, d) for d in os.listdir(parent) if d.startswith("run-")}
        _Cgroups.destroy(runs)
        try:
            os.rmdir(parent)
        except OSError as e:
            log.warning("could not remove stale cgroup %s: %s", parent, e)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _cgroup_v1_mounts() -> dict[str, tuple[str, str]]:
    """controller -> (mount point, root of the hierarchy that is mounted there)."""
    out: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) < 3 or rfields[0] != "cgroup":
                continue
            for opt in rfields[2].split(","):
                out.setdefault(opt, (fields[4], fields[3]))
    return out


def _own_cgroups() -> dict[str, str]:
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(","):
                if c:
                    out[c] = path
    return out


@dataclass
class _Plan:
    """How runs are launched at one isolation level."""

    level: IsolationLevel
    argv: list[str]
    namespaces: bool = False
    user_namespace: bool = False
    uid: int | None = None
    gid: int | None = None
    cgroups: _Cgroups | None = None
    mounts: dict | None = None
    notes: list[str] = field(default_factory=list)


def _tail(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        return f.read().decode("utf-8", "replace")


class Sandbox:
    """Runs jobs one at a time per call (thread-safe: concurrent calls use separate runs)."""

    def __init__(self, config: SandboxConfig):
        self._config = config
        self._python = os.path.realpath(config.python or sys.executable)
        self._work_root = config.work_root or tempfile.gettempdir()
        self._plan = self._detect()
        self.report = IsolationReport(
            level=self._plan.level,
            namespaces=self._plan.namespaces,
            user_namespace=self._plan.user_namespace,
            cgroups=self._plan.cgroups is not None,
            uid=self._plan.uid if self._plan.uid is not None else os.geteuid(),
            hidden_paths=tuple(self._plan.mounts["hide"]) if self._plan.mounts else (),
            notes=tuple(self._plan.notes),
        )
        log.info("sandbox: %s", self.report.describe())

    # ---- start-up ----------------------------------------------------------------------

    def _detect(self) -> _Plan:
        """Probe from the strongest level down; stop at the first that works."""
        required = ISOLATION_ORDER.index(self._config.isolation)
        notes: list[str] = []
        for plan_factory in self._candidates():
            plan = plan_factory(notes)
            if plan is None:
                continue
            if ISOLATION_ORDER.index(plan.level) < required:
                break
            why = self._probe(plan)
            if why is None:
                plan.notes = notes
                return plan
            notes.append(f"{plan.level}{' (as root)' if plan.uid is None and os.geteuid() == 0 else ''}: {why}")
            if plan.cgroups is not None:
                plan.cgroups.close()
        raise IsolationUnavailable(
            f"sandbox isolation {self._config.isolation!r} is required but this host does not "
            f"allow it: {'; '.join(notes) or 'no level available'}. Lower "
            "`reward.sandbox.isolation` to accept weaker isolation."
        )

    def _candidates(self):
        cfg = self._config
        root = os.geteuid() == 0
        unshare = shutil.which("unshare")
        # -u: the child exits with os._exit (no flushing), so stdio must not be buffered
        python = [self._python, "-I", "-S", "-B", "-u", "-c", _LAUNCHER_SOURCE]
        ns_flags = ["--net", "--pid", "--fork", "--mount-proc", "--kill-child", "--"]
        drop = {"uid": cfg.sandbox_uid, "gid": cfg.sandbox_gid} if root else {}

        def namespaced(level: IsolationLevel, with_cgroups: bool):
            def make(notes: list[str]) -> _Plan | None:
                if unshare is None:
                    notes.append(f"{level}: no `unshare` binary (util-linux) on PATH")
                    return None
                if with_cgroups and not root:
                    notes.append(f"{level}: needs root (cgroups and a separate uid)")
                    return None
                cgroups = None
                if with_cgroups:
                    try:
                        cgroups = _Cgroups()
                    except OSError as e:
                        notes.append(f"{level}: cgroup v1 pids/memory not writable ({e})")
                        return None
                userns = [] if root else ["--user", "--map-root-user"]
                return _Plan(
                    level, [unshare, *userns, *ns_flags, *python], namespaces=True,
                    user_namespace=not root, cgroups=cgroups, mounts=self._mounts, **drop,
                )

            return make

        def plain(as_root: bool):
            def make(notes: list[str]) -> _Plan:
                return _Plan("process", python, **({} if as_root else drop))

            return make

        candidates = [namespaced("full", True), namespaced("namespaces", False), plain(False)]
        if root:
            candidates.append(plain(True))  # last resort: the code runs as root (reported)
        return candidates

    @functools.cached_property
    def _mounts(self) -> dict:
        """The mount plan of the namespace levels (computed once: it asks the interpreter)."""
        hide: list[str] = []
        for p in sorted({os.path.realpath(p) for p in self._config.hidden_paths}):
            if os.path.isdir(p) and not any(p.startswith(h + "/") for h in hide):
                hide.append(p)
        prefix = subprocess.run(
            [self._python, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"],
            capture_output=True, text=True, check=True, env=_ENV,
        ).stdout.strip()
        prefix = os.path.realpath(prefix)
        expose = [prefix] if any(prefix.startswith(h + "/") for h in hide) else []
        return {
            "tmpfs_bytes": self._config.file_size_mb << 20,
            "tmpfs_inodes": _TMPFS_INODES,
            "hide": hide,
            "expose": expose,
            "private": list(_PRIVATE_DIRS),
        }

    def _probe(self, plan: _Plan) -> str | None:
        """Run a job that checks the plan's promises from the inside; None when all hold."""
        cases = ["import math, json, re, collections, itertools, functools, string, socket, typing"]
        cases.append("assert math.gcd(12, 18) == 6")
        if plan.uid is not None:
            cases.append(f"assert os.getuid() == {plan.uid} and os.getgid() == {plan.gid}")
        if plan.namespaces:
            cases.append("assert os.getpid() == 2, os.getpid()")  # the reaper is pid 1
            cases.append("assert [n for _, n in socket.if_nameindex()] == ['lo']")
            cases.append("assert os.listdir('/tmp') == ['work'], os.listdir('/tmp')")
            for h in plan.mounts["hide"] if plan.mounts else ():
                cases.append(f"assert set(os.listdir({h!r})) <= {{{_first_component(h, plan)!r}}}")
        if plan.cgroups is not None:
            cases.append("assert 'hotloop-sbx-' in open('/proc/self/cgroup').read()")
        result = self._run(plan, SandboxJob("import os\n", tuple(cases)))
        if result.status == "ok":
            return None
        return f"probe run {result.status}: {result.error} {result.stderr[-300:]}".strip()

    def close(self) -> None:
        if self._plan.cgroups is not None:
            self._plan.cgroups.close()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- runs ---------------------------------------------------------------------------

    def run(self, job: SandboxJob) -> SandboxResult:
        """Run one job; every outcome, including a failure of the sandbox itself, is a result."""
        return self._run(self._plan, job)

    def _run(self, plan: _Plan, job: SandboxJob) -> SandboxResult:
        cfg = self._config
        start = time.perf_counter()
        nonce = secrets.token_hex(16)
        groups: dict[str, str] | None = None
        run_dir = ""
        try:
            # Only the setup and the spawn are guarded: an OSError there is the host refusing
            # (disk full, no more processes, cgroup limits), reported as status "error".
            try:
                run_dir = tempfile.mkdtemp(prefix="hotloop-sbx-", dir=self._work_root)
                out_path, err_path = os.path.join(run_dir, "stdout"), os.path.join(run_dir, "stderr")
                result_path = os.path.join(run_dir, "result")
                workdir = os.path.join(run_dir, "work")
                if plan.mounts is None:  # with a mount namespace the launcher makes its own
                    os.mkdir(workdir, 0o700)
                    if plan.uid is not None:
                        os.chown(workdir, plan.uid, plan.gid)
                if plan.cgroups is not None:
                    groups = plan.cgroups.create(
                        f"run-{nonce[:12]}", cfg.max_processes, cfg.memory_mb << 20
                    )
                payload = {
                    "nonce": nonce,
                    "code": job.code,
                    "cases": list(job.cases),
                    "wall_seconds": cfg.wall_seconds,
                    "uid": plan.uid,
                    "gid": plan.gid,
                    "workdir": workdir,
                    "mounts": plan.mounts,
                    "cgroup_procs": [os.path.join(g, "cgroup.procs") for g in (groups or {}).values()],
                    "limits": {
                        "cpu_seconds": cfg.cpu_seconds,
                        "address_space_bytes": cfg.memory_mb << 20,
                        "file_size_bytes": cfg.file_size_mb << 20,
                        "open_files": cfg.open_files,
                        "nproc": cfg.max_processes if plan.uid is not None else None,
                    },
                }
                with open(out_path, "wb") as out, open(err_path, "wb") as err:
                    result_fd = os.open(result_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    payload["result_fd"] = result_fd
                    try:
                        proc = subprocess.Popen(
                            plan.argv, stdin=subprocess.PIPE, stdout=out, stderr=err,
                            pass_fds=(result_fd,), cwd=run_dir, env=_ENV, start_new_session=True,
                        )
                    finally:
                        os.close(result_fd)
            except OSError as e:
                return _error_result(job, f"sandbox could not start the run: {e}", start)
            try:
                proc.stdin.write(marshal.dumps(payload))
                proc.stdin.close()
            except BrokenPipeError:
                pass  # the launcher died before reading; its exit status tells the rest
            killed = not _wait_exit(proc.pid, cfg.wall_seconds + _STARTUP_SLACK_S)
            _killpg(proc.pid)  # on time: anything left in the launcher's group (normally nothing)
            proc.wait()
            oom_kills = plan.cgroups.oom_kills(groups) if groups is not None else 0
            record = _read_record(result_path, nonce)
            tail = cfg.output_tail_bytes
            return self._classify(
                job, record, killed, proc.returncode, oom_kills,
                _tail(out_path, tail), _tail(err_path, tail), start,
            )
        finally:
            if groups is not None:
                plan.cgroups.destroy(groups)
            if run_dir:
                shutil.rmtree(run_dir, onerror=_log_rmtree_error)

    def _classify(
        self, job: SandboxJob, record: dict | None, killed: bool, launcher_rc: int,
        oom_kills: int, stdout: str, stderr: str, start: float,
    ) -> SandboxResult:
        cfg = self._config
        total = len(job.cases)
        res = SandboxResult(
            status="crash", passed=0, failed=total, timed_out=False, exit_code=None, error="",
            stdout=stdout, stderr=stderr, seconds=time.perf_counter() - start,
        )
        if record is None:
            if killed:
                return replace(res, status="timeout", timed_out=True,
                               error=f"the run did not finish within {cfg.wall_seconds + _STARTUP_SLACK_S:.0f}s")
            if launcher_rc < 0:
                # e.g. the code signalled its whole process group, which the launcher shares
                return replace(res, error=f"the sandbox launcher was killed by {_signame(-launcher_rc)}")
            return replace(res, status="error",
                           error=f"the sandbox launcher exited with {launcher_rc} and no record")
        if "launcher_error" in record:
            return replace(res, status="error", error=f"sandbox launcher failed: {record['launcher_error']}")
        code, cpu = record["exit_code"], record["cpu_seconds"]
        res = replace(res, exit_code=code, cpu_seconds=cpu)
        fields = (record["report"] or "").split("\t")
        if fields[0] == "setup":
            return replace(res, status="error", error=f"sandbox setup failed: {' '.join(fields[1:])}")
        bits = None
        if code == 0 and fields[0] == "result" and len(fields) == 4:
            if len(fields[1]) == total and set(fields[1]) <= {"0", "1"}:
                bits, oom, error = fields[1], fields[2] == "1", fields[3]
        timeout = ""
        if record["timed_out"] or killed:
            timeout = f"wall-clock limit of {cfg.wall_seconds:g}s"
        # SIGXCPU at the soft limit, SIGKILL at the hard one (soft + 1 s) when SIGXCPU was
        # ignored. rusage lags the kernel's own CPU clock a little, hence the margin.
        elif code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= 0.8 * cfg.cpu_seconds):
            timeout = f"CPU limit of {cfg.cpu_seconds}s"
        res = replace(res, timed_out=bool(timeout))
        if oom_kills:
            # Checked before timeouts: a run whose processes were OOM-killed and that then
            # hung is out of memory first.
            return replace(res, status="oom", error=f"{oom_kills} process(es) killed by the run's "
                           f"memory limit of {cfg.memory_mb} MB")
        if timeout:
            return replace(res, status="timeout", error=timeout)
        if code == -signal.SIGXFSZ:
            return replace(res, error=f"file size limit of {cfg.file_size_mb} MB")
        if bits is None:
            how = f"killed by {_signame(-code)}" if code < 0 else f"exited with code {code}"
            return replace(res, error=f"the code {how} before the tests reported")
        passed = bits.count("1")
        status: Status = "oom" if oom else ("ok" if passed == total else "failed")
        return replace(res, status=status, passed=passed, failed=total - passed, error=error)


def _first_component(hidden: str, plan: _Plan) -> str:
    """The one entry a hidden directory may show: the path down to an exposed prefix."""
    for path in plan.mounts["expose"] if plan.mounts else ():
        if path.startswith(hidden + "/"):
            return path[len(hidden) + 1 :].split("/")[0]
    return ""


def _read_record(path: str, nonce: str) -> dict | None:
    """The launcher's record (see `_launcher.main`), or None when it wrote none."""
    with open(path, "rb") as f:
        data = f.read(_RESULT_MAX).decode("utf-8", "replace")
    for line in reversed(data.splitlines()):
        if not line.startswith(nonce + "\t"):
            continue
        kind, _, rest = line[len(nonce) + 1 :].partition("\t")
        if kind == "launcher_error":
            return {"launcher_error": rest}
        code, timed_out, cpu, max_rss, report = rest.split("\t", 4)
        return {
            "exit_code": int(code), "timed_out": timed_out == "1", "cpu_seconds": float(cpu),
            "max_rss_kb": int(max_rss), "report": report or None,
        }
    return None


def _error_result(job: SandboxJob, error: str, start: float) -> SandboxResult:
    return SandboxResult(
        status="error", passed=0, failed=len(job.cases), timed_out=False, exit_code=None,
        error=error, stdout="", stderr="", seconds=time.perf_counter() - start,
    )


def _wait_exit(pid: int, timeout: float) -> bool:
    """Wait until the process exits (without reaping it); False on timeout.

    A pidfd wakes up at the exit itself; Popen.wait(timeout) would poll with sleeps.
    """
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    return bool(ready)


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _log_rmtree_error(func, path, exc_info) -> None:
    log.warning("could not remove %s (%s): %s", path, func.__name__, exc_info[1])
