"""Run untrusted Python code against test cases, contained; outcomes are data, not exceptions.

Owns: detecting once, at start-up, how strongly this host can isolate a run and refusing to
start below the configured level (`IsolationUnavailable`); the worker processes runs are
forked from; running one `SandboxJob` (the code, then each test case) and classifying the
outcome into a `SandboxResult` (`ok`, `failed`, `timeout`, `oom`, `crash`, `error`); decoding
the values of `ValueCase`s (`strict.py`). Does not own: extracting code from a completion,
rewards, which cases are compared outside (`scorers.py`), concurrency (`pool.py`), tasks.

How a run is contained (each run: a fresh forked process tree, fresh writable directories):
- always (`process`): a new session; an environment holding only PATH and LANG (nothing of
  the service's, so its secrets are not in `os.environ`); `python -I -S` (no site-packages,
  no PYTHON* variables, no user site); a fresh working directory, removed after; rlimits on
  CPU seconds, address space, file size, open files, no core dumps; a wall-clock deadline
  after which the whole process tree is killed. A trusted worker process (see
  `_launcher.py`) forks the child that runs the code, is its subreaper, and kills every
  process the code left behind, including ones that called setsid. When the service runs as
  root the code runs as an unprivileged uid (nobody) with no_new_privs: root-owned files
  such as /etc/shadow or a 0600 secret are unreadable, signals to root processes fail, and
  RLIMIT_NPROC applies (root ignores it).
- `namespaces`: the worker has its own network namespace (no interface but a down loopback:
  no network at all, 127.0.0.1 of the host unreachable), its own pid namespace (a run sees
  only the worker, as pid 1, and its own processes; `kill(-1, 9)` cannot reach the host;
  everything dies with the worker), and its own mount namespace in which `hidden_paths`
  (/root, /home, /run, ...) are empty and the root filesystem is read-only, so nothing on
  the host can be written. Each run then makes its own mount and IPC namespaces, in which
  /tmp, /var/tmp and /dev/shm are new, small, empty tmpfs; the working directory lives in
  that /tmp. As root this uses `unshare`; otherwise a user namespace (`unshare --user
  --map-root-user`), where the code runs as the service's own uid mapped to root in it.
- `full`: additionally per-run cgroup v1 groups, made fresh for every run: `pids.max` (fork
  bombs) and a memory limit over all of the run's processes (an out-of-memory kill is
  reported as `oom`).

Worker reuse (a fork server, `IsolationReport.fork_server`), and what it changes. When the
service runs as root, a worker (one `unshare` + interpreter, with the common standard-library
modules imported) serves job after job: each run is a fresh `fork()` of it, with its own
rlimits, uid drop, no_new_privs, cgroups, mount and IPC namespaces and tmpfs, killed as a
process group and then, with everything else in the pid namespace, by `kill(-1)` from pid 1,
before the worker takes the next job. Shared by the runs of one worker, one after another:
- the network namespace: an unprivileged uid cannot configure it (no CAP_NET_ADMIN), and
  its sockets, abstract ones included, die with the run's processes;
- the pid namespace: the next run starts with no process of an earlier one alive (checked
  by waitpid, see `_launcher.kill_namespace`); only the pid counter goes on, so a run can
  tell how many processes ran before it in its worker;
- the worker's memory, which every child inherits copy-on-write: the worker never
  unmarshals a job (it reads the bytes into a buffer it zeroes after the fork), so no
  earlier job's code or tests are in it, only earlier nonces (worthless: each run has its
  own) and the setup (limits, mount plan). Modules imported by the worker start every run
  in the same state; the hash seed (set order) is the worker's, the same for its runs;
  `random` reseeds in each child;
- RLIMIT_NPROC of the sandbox uid, shared by concurrent runs as before.
The worker runs as root and never runs job code; the code runs as another uid without
capabilities, so it cannot signal, trace or read the worker (which is also non-dumpable).
Without that boundary, i.e. when the service is not root and the code would run as the
worker's own uid, every job gets a fresh launcher that exits after it (`fork_server=False`),
the same containment as one launcher per run.

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
only after all test cases ran, to a channel that the code never sees before that; the worker
reads it after the child exits and sends the record to the service on a pipe the child never
holds. So printing "passed", writing files, `sys.exit(0)`, `os._exit(0)`, closing stdio or
patching builtins/modules cannot fake a pass. Values of `ValueCase`s leave as plain data
only (exact builtin types, encoded without calling any method of the value), so the caller
compares them outside the code's reach: an object whose `__eq__` always returns True, or a
subclass of int/str overriding it, is refused rather than equal (see `scorers.py` for which
cases go that way). Residual risk: the nonce, and the harness's encoder, are in the child's
memory while the code runs, so code that deliberately reads or patches the harness
(`sys._getframe(1).f_locals`, gc, ctypes), writes a report line and exits wins the cases
judged inside the sandbox; for compared cases the expected values never enter the sandbox,
so a forged report must still carry the right values. And a case judged inside the sandbox
(any shape `scorers.py` does not compare outside) still asks the code's own objects whether
they are equal. Nothing run in the same process as the code can rule the first out; treat a
policy that learns such tricks as a finding, not a success.
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
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from hotloop.errors import FatalError

from . import strict
from .config import ISOLATION_ORDER, IsolationLevel, SandboxConfig
from .strict import Returned

log = logging.getLogger(__name__)

Status = Literal["ok", "failed", "timeout", "oom", "crash", "error"]

_LAUNCHER_SOURCE = (Path(__file__).parent / "_launcher.py").read_text()
# A worker's start-up (interpreter, mounts, imports) and a run's own setup happen before the
# worker's per-run deadline starts; the service waits this much longer before killing the
# worker itself (only a wedged host needs it).
_STARTUP_SLACK_S = 5.0
_RESULT_MAX = 8 << 20  # any one blob of a record (the launcher caps a report at 4 MiB)
_PRIVATE_DIRS = ("/var/tmp", "/dev/shm", "/run/lock")
_TMPFS_INODES = 4096
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class ValueCase:
    """A test case whose value leaves the sandbox instead of being judged inside it.

    `expression` is evaluated after the code, in its namespace; the value is encoded
    strictly (plain data of exact builtin types only, see `_launcher.encode_value`) and
    decoded in this process into `SandboxResult.values`, for the caller to compare.
    """

    expression: str


@dataclass(frozen=True)
class SandboxJob:
    """Code to run, then test cases run one by one in the code's namespace.

    A `str` case is a snippet (typically one assert, or a HumanEval test block plus
    `check(entry_point)`); it passes when it runs without raising. A `ValueCase` "passes"
    here when its value could be sent out; whether it is right is the caller's comparison.
    """

    code: str
    cases: tuple[str | ValueCase, ...]


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
    case_passed: tuple[bool, ...] = ()
    """One per case when the tests reported (else empty)."""
    values: tuple[Returned | None, ...] = ()
    """One per case when the tests reported (else empty): a `Returned` for each `ValueCase`,
    None for the others."""


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
    fork_server: bool = False
    """Runs are forked from long-lived pre-imported workers (one namespace set per worker,
    fresh mount/IPC namespaces per run); False: a fresh launcher process per run."""

    def describe(self) -> str:
        parts = [f"isolation={self.level}", f"uid={self.uid}"]
        parts.append("net+pid+mount namespaces" if self.namespaces else "no namespaces")
        if self.user_namespace:
            parts.append("user namespace")
        parts.append("cgroups pids+memory" if self.cgroups else "no cgroups")
        if self.namespaces:
            parts.append(f"hidden={','.join(self.hidden_paths) or '-'}")
        parts.append("fork-server workers" if self.fork_server else "a fresh launcher per run")
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
    workers: "_Workers | None" = None


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
            fork_server=self._plan.workers.reuse,
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
            plan.workers = self._workers_for(plan)
            why = self._probe(plan)
            if why is None:
                plan.notes = notes
                return plan
            notes.append(f"{plan.level}{' (as root)' if plan.uid is None and os.geteuid() == 0 else ''}: {why}")
            plan.workers.close()
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

    def _workers_for(self, plan: _Plan) -> _Workers:
        """The launchers of a plan. A worker serves many jobs only when the code runs as
        another, unprivileged uid than the worker (service started as root): that uid is the
        boundary that keeps a run from signalling, tracing or reading the worker, and through
        it any later run. Without it (a non-root service) every job gets a fresh launcher."""
        cfg = self._config
        setup = {
            "uid": plan.uid,
            "gid": plan.gid,
            "mounts": plan.mounts,
            "work_root": self._work_root,
            "wall_seconds": cfg.wall_seconds,
            "tail_bytes": cfg.output_tail_bytes,
            "limits": {
                "cpu_seconds": cfg.cpu_seconds,
                "address_space_bytes": cfg.memory_mb << 20,
                "file_size_bytes": cfg.file_size_mb << 20,
                "open_files": cfg.open_files,
                "nproc": cfg.max_processes if plan.uid is not None else None,
            },
        }
        reuse = plan.uid is not None
        setup["preimport"] = reuse  # worth its start-up cost only for a worker that serves many
        return _Workers(plan.argv, setup, reuse=reuse, cwd=self._work_root)

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
            # the worker is pid 1 of the namespace, and no other process is left in it
            cases.append("assert os.getppid() == 1, os.getppid()")
            cases.append("assert {p for p in os.listdir('/proc') if p.isdigit()} == {'1', str(os.getpid())}")
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
        self._plan.workers.close()
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

    def warm(self, n: int) -> None:
        """Start up to `n` idle workers now, so the first runs do not pay interpreter start-up
        (a no-op where each run gets a fresh launcher)."""
        self._plan.workers.warm(n)

    def _run(self, plan: _Plan, job: SandboxJob) -> SandboxResult:
        cfg = self._config
        start = time.perf_counter()
        nonce = secrets.token_hex(16)
        groups: dict[str, str] | None = None
        worker: _Worker | None = None
        healthy = False
        try:
            # Only the setup and the spawn are guarded: an OSError there is the host refusing
            # (no more processes, cgroup limits), reported as status "error".
            try:
                if plan.cgroups is not None:
                    groups = plan.cgroups.create(
                        f"run-{nonce[:12]}", cfg.max_processes, cfg.memory_mb << 20
                    )
                worker = plan.workers.acquire()
            except OSError as e:
                return _error_result(job, f"sandbox could not start the run: {e}", start)
            body = marshal.dumps({
                "code": job.code,
                "cases": [c.expression if isinstance(c, ValueCase) else c for c in job.cases],
                "kinds": ["e" if isinstance(c, ValueCase) else "x" for c in job.cases],
                "cgroup_procs": [os.path.join(g, "cgroup.procs") for g in (groups or {}).values()],
            })
            record, killed = worker.request(nonce, body, cfg.wall_seconds + _STARTUP_SLACK_S)
            healthy = record is not None and "launcher_error" not in record
            plan.workers.release(worker, healthy)
            rc, worker_stderr = worker.proc.returncode, "" if healthy else worker.stderr_tail()
            worker = None
            oom_kills = plan.cgroups.oom_kills(groups) if groups is not None else 0
            result = self._classify(job, record, killed, rc, oom_kills, start)
            if record is None and result.status == "error":  # the launcher's own complaint
                result = replace(result, error=f"{result.error}: {worker_stderr.strip()[-500:]}")
            return result
        finally:
            if worker is not None:  # an exception between acquire and release
                plan.workers.release(worker, False)
            if groups is not None:
                plan.cgroups.destroy(groups)

    def _classify(
        self, job: SandboxJob, record: dict | None, killed: bool, launcher_rc: int | None,
        oom_kills: int, start: float,
    ) -> SandboxResult:
        cfg = self._config
        total = len(job.cases)
        res = SandboxResult(
            status="crash", passed=0, failed=total, timed_out=False, exit_code=None, error="",
            stdout="", stderr="", seconds=time.perf_counter() - start,
        )
        if record is None:
            if killed:
                return replace(res, status="timeout", timed_out=True,
                               error=f"the run did not finish within {cfg.wall_seconds + _STARTUP_SLACK_S:.0f}s")
            if launcher_rc is not None and launcher_rc < 0:
                # e.g. code running as the launcher's own uid signalled it
                return replace(res, error=f"the sandbox launcher was killed by {_signame(-launcher_rc)}")
            return replace(res, status="error",
                           error=f"the sandbox launcher exited with {launcher_rc} and no record")
        if "launcher_error" in record:
            return replace(res, status="error", error=f"sandbox launcher failed: {record['launcher_error']}")
        code, cpu = record["exit_code"], record["cpu_seconds"]
        res = replace(res, exit_code=code, cpu_seconds=cpu, stdout=record["stdout"], stderr=record["stderr"])
        fields = record["report"].split("\t")
        if fields[0] == "setup":
            return replace(res, status="error", error=f"sandbox setup failed: {' '.join(fields[1:])}")
        bits = values = None
        # result, bits, oom, one value field per case, error (last: it may hold anything but
        # tabs and newlines)
        if code == 0 and fields[0] == "result" and len(fields) == 4 + total:
            if len(fields[1]) == total and set(fields[1]) <= {"0", "1"}:
                bits, oom, error = fields[1], fields[2] == "1", fields[-1]
                values = _decode_values(job, fields[3:-1])
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
        return replace(res, status=status, passed=passed, failed=total - passed, error=error,
                       case_passed=tuple(b == "1" for b in bits), values=values)


def _decode_values(job: SandboxJob, fields: list[str]) -> tuple[Returned | None, ...]:
    """The report's per-case value fields, decoded here (see `strict.py`)."""
    out: list[Returned | None] = []
    for case, f in zip(job.cases, fields):
        if not isinstance(case, ValueCase):
            out.append(None)
        elif f.startswith("="):
            try:
                out.append(Returned(value=strict.decode(f[1:])))
            except ValueError as e:
                out.append(Returned(refused=f"the value could not be read back: {e}"))
        elif f.startswith("!"):
            out.append(Returned(refused=f[1:]))
        else:  # the expression raised (the error field says how) or never ran
            out.append(Returned(refused="no value (the expression raised or did not run)", raised=True))
    return tuple(out)


class _Worker:
    """One launcher process (see `_launcher.py`) and the pipes to it.

    The service writes job frames to its stdin and reads record frames from its stdout; no
    run ever holds either pipe. Its stderr is read only when it fails (it writes nothing there
    otherwise: the runs' output goes to per-run memfds).
    """

    def __init__(self, argv: list[str], setup: bytes, cwd: str):
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=cwd, env=_ENV, start_new_session=True, bufsize=0,
        )
        self._buf = b""
        self._stderr_tail = b""
        try:
            self.proc.stdin.write(len(setup).to_bytes(8, "little") + setup)
        except BrokenPipeError:
            pass  # it died at once; the first request reports how

    def request(self, nonce: str, body: bytes, timeout: float) -> tuple[dict | None, bool]:
        """Send one job, wait for its record; (record or None, whether the deadline passed)."""
        deadline = time.monotonic() + timeout
        try:
            self.proc.stdin.write(b"J" + nonce.encode() + len(body).to_bytes(8, "little") + body)
        except BrokenPipeError:
            return None, False
        head = self._read_until(b"\n", deadline)
        if head is None:
            return None, time.monotonic() >= deadline
        fields = head.decode("utf-8", "replace").rstrip("\n").split("\t")
        if fields[0] != nonce:
            return None, False  # not this job's record: the worker is broken; treated as no record
        kind, rest = fields[1], fields[2:]
        try:
            sizes = [int(x) for x in rest[-3 if kind == "record" else -1:]]
        except ValueError:
            return None, False
        if any(n < 0 or n > _RESULT_MAX for n in sizes):
            return None, False
        blobs = []
        for n in sizes:
            blob = self._read_exact(n, deadline)
            if blob is None:
                return None, time.monotonic() >= deadline
            blobs.append(blob.decode("utf-8", "replace"))
        if kind == "launcher_error":
            return {"launcher_error": blobs[0]}, False
        code, timed_out, cpu, max_rss = rest[:4]
        return {
            "exit_code": int(code), "timed_out": timed_out == "1", "cpu_seconds": float(cpu),
            "max_rss_kb": int(max_rss), "stdout": blobs[0], "stderr": blobs[1], "report": blobs[2],
        }, False

    def _fill(self, deadline: float) -> bool:
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return False
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return False
        self._buf += chunk
        return True

    def _read_until(self, sep: bytes, deadline: float) -> bytes | None:
        while sep not in self._buf:
            if len(self._buf) > _RESULT_MAX or not self._fill(deadline):
                return None
        line, _, self._buf = self._buf.partition(sep)
        return line + sep

    def _read_exact(self, n: int, deadline: float) -> bytes | None:
        while len(self._buf) < n:
            if not self._fill(deadline):
                return None
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def finish(self, grace: float) -> None:
        """No more jobs: close its stdin, give it `grace` seconds to exit, then kill its group.

        Nothing else reaps it (no `poll()` anywhere), so until `wait()` below its pid, and with
        it the group id, cannot be reused by an unrelated process."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        _wait_exit(self.proc.pid, grace)
        _killpg(self.proc.pid)  # unshare's group: after a clean exit nothing is left in it
        self.proc.wait()
        # Whatever it wrote before dying; non-blocking, so a straggler holding the pipe
        # cannot stall the caller.
        os.set_blocking(self.proc.stderr.fileno(), False)
        try:
            self._stderr_tail = self.proc.stderr.read() or b""
        except BlockingIOError:
            pass
        self.proc.stdout.close()
        self.proc.stderr.close()

    def stderr_tail(self) -> str:
        """What the launcher itself wrote to stderr (after `finish`: it has exited)."""
        data = self._stderr_tail
        return data[-2000:].decode("utf-8", "replace")


class _Workers:
    """The idle workers of one plan; thread-safe.

    With `reuse`, a worker serves job after job (a fork server); one that failed, ran over
    its deadline or answered out of turn is killed and replaced by a fresh one. Without it,
    each job gets a fresh launcher that exits after it (the code would run as the launcher's
    own uid, so nothing but a new process keeps one run from reaching the next; see the
    module docstring).
    """

    def __init__(self, argv: list[str], setup: dict, reuse: bool, cwd: str):
        self._argv, self._setup, self.reuse, self._cwd = argv, marshal.dumps(setup), reuse, cwd
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def _spawn(self) -> _Worker:
        return _Worker(self._argv, self._setup, self._cwd)

    def warm(self, n: int) -> None:
        if not self.reuse:
            return
        with self._lock:
            missing = max(0, n - len(self._idle))
        fresh = [self._spawn() for _ in range(missing)]
        with self._lock:
            self._idle.extend(fresh)

    def acquire(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._spawn()

    def release(self, worker: _Worker, healthy: bool) -> None:
        """Back to the idle list, or ended: a one-job launcher exits at the end of its input;
        an unhealthy one is killed at once."""
        if healthy and self.reuse:
            with self._lock:
                if not self._closed:
                    self._idle.append(worker)
                    return
        worker.finish(grace=0.0 if not healthy else _STARTUP_SLACK_S)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            w.finish(grace=_STARTUP_SLACK_S)


def _first_component(hidden: str, plan: _Plan) -> str:
    """The one entry a hidden directory may show: the path down to an exposed prefix."""
    for path in plan.mounts["expose"] if plan.mounts else ():
        if path.startswith(hidden + "/"):
            return path[len(hidden) + 1 :].split("/")[0]
    return ""


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
