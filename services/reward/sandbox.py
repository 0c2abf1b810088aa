"""Run untrusted Python code against a task's tests, contained; outcomes are data, not exceptions.

Owns: detecting once, at start-up, how strongly this host can isolate a run and refusing to
start below the configured level (`IsolationUnavailable`); the worker processes runs are
forked from; running one `SandboxJob` (the code in one process, the tests in another) and
classifying the outcome into a `SandboxResult` (`ok`, `failed`, `timeout`, `oom`, `crash`,
`error`). Does not own: extracting code from a completion, rewards (`scorers.py`), the calls
between the code and its tests (`_calls.py`), concurrency (`pool.py`), tasks.

## The verdict is computed where the code cannot reach

Every run has two processes (`_launcher.py`):
- the *candidate* runs the sample's code and answers calls, and holds nothing else of the
  run: it is forked before the tests are even read, so no test, expected value, result
  channel or counting code was ever in its memory;
- the *judge* runs the task's trusted prefix (for HumanEval: the prompt's imports, helpers
  and stub) and every test case, in its own process, as another uid, not dumpable. Whatever
  a test takes from the code (the entry point, the code's classes and globals) is a proxy:
  calling it sends plain arguments to the candidate and gets a plain value, a handle to one
  of the code's objects, or an exception back. Comparisons, asserts and the count of passed
  cases all happen in the judge, which writes the only report.

What this guarantees, against code that does anything it likes inside its own process
(rewrite the harness, its frames, `__main__`, builtins or `__code__` objects, install
profiling or tracing hooks, walk the garbage collector, write any bytes to any descriptor it
holds, exit at any moment):
- it cannot write, forge or reach the report: the report channel is the judge's, a memfd the
  candidate never held, and no nonce or other secret exists in the candidate to forge one;
- it cannot read an expected value: they exist only in the judge's memory, which another uid
  that is also not dumpable cannot trace, read through /proc or signal (in a user namespace,
  where both share a uid, the candidate gives up every capability; it can still kill the
  judge, which makes the run a crash with nothing passed);
- it cannot make an object "equal" to an expected value: only exact builtin plain data
  crosses by value, strictly decoded in the judge; anything else (an `__eq__` that always
  says True, an int subclass) is a handle, and a handle equals only itself;
- it cannot replace the tests' own helpers: names a test uses resolve to the judge's
  builtins, the standard library and the task's prefix before the code's globals, so the
  code cannot stand in for `abs`, `math` or a prompt's helper such as HumanEval's `poly`;
- it cannot read the tasks from disk (namespace levels): the worker's root holds only the
  visible paths (the interpreter and system libraries, read-only), with every site-packages
  directory hidden, so neither the repository, the run directories nor an installed
  dataset's files exist in the sandbox;
- a missing, refused, malformed or oversized value fails its case; a case fails closed.

What it still does not guarantee:
- the tests decide: a test that passes on a weak property (`assert f(x)` for any truthy
  value, a bare `except:` around a call) passes any code with that property, as it would
  anywhere. A test that catches every exception with `except BaseException` also catches
  the judge's "the code is gone" signal;
- a test can be answered by computing the answer: arguments reach the candidate by design,
  and a test whose arguments reveal the expected value (passing it in) reveals it;
- objects that are not plain data cannot be compared across the boundary: a test that
  compares two of the code's objects with `==` (rather than their fields) fails even for a
  right answer, and `Fraction`, `Decimal` and other non-builtin value types cross as handles;
- the code's globals and objects stay the code's own: a test that calls a method the code
  defines gets whatever that method answers.

## How a run is contained (each run: fresh forked processes, fresh writable directories)
- always (`process`): a new session; an environment holding only PATH and LANG (nothing of
  the service's, so its secrets are not in `os.environ`); `python -I -S` (no site-packages,
  no PYTHON* variables, no user site); a fresh working directory, removed after; rlimits on
  CPU seconds, address space, file size, open files, no core dumps; a wall-clock deadline
  after which every process of the run is killed. A trusted worker process (see
  `_launcher.py`) forks the candidate and the judge, is their subreaper, and kills every
  process the code left behind, including ones that called setsid. When the service runs as
  root the code runs as an unprivileged uid (nobody) and the tests as another, both with
  no_new_privs: root-owned files such as /etc/shadow or a 0600 secret are unreadable,
  signals to root processes fail, and RLIMIT_NPROC applies (root ignores it).
- `namespaces`: the worker has its own network namespace (no interface but a down loopback:
  no network at all, 127.0.0.1 of the host unreachable), its own pid namespace (a run sees
  only the worker, as pid 1, and its own processes; `kill(-1, 9)` cannot reach the host;
  everything dies with the worker), and its own mount namespace whose root is a new,
  read-only tree of only the `visible_paths` (system directories and the interpreter's
  prefix, read-only) minus the hidden ones (every site-packages and dist-packages directory
  of the interpreter, and `hidden_paths`), /proc and a few /dev nodes; the host's root is
  detached (pivot_root). Each candidate then makes its own mount and IPC namespaces, in
  which /tmp, /var/tmp and /dev/shm are new, small, empty tmpfs; the working directory lives
  in that /tmp. As root this uses `unshare`; otherwise a user namespace (`unshare --user
  --map-root-user`), where both processes run as the service's own uid mapped to root in
  it, without capabilities.
- `full`: additionally cgroup v1 groups of each worker's own, which every process of its runs
  is born in: `pids.max` (fork bombs) and a memory limit over all of a run's processes (the
  configured `memory_mb`, plus a fixed share for the worker and the tests' process; an
  out-of-memory kill is reported as `oom`). The worker is never the OOM killer's choice; the
  code's process is its first. A run's processes are all gone before the next run starts,
  so the groups hold one run at a time.

Worker reuse (a fork server, `IsolationReport.fork_server`), and what it changes. When the
service runs as root, a worker (one `unshare` + interpreter, with the common standard-library
modules imported) serves job after job: each run is a fresh pair of `fork()`s of it, with
their own rlimits, uids, no_new_privs, cgroups, and (for the candidate) mount and IPC
namespaces and tmpfs, killed as process groups and then, with everything else in the pid
namespace, by `kill(-1)` from pid 1, before the worker takes the next job. Shared by the runs
of one worker, one after another:
- the network namespace: an unprivileged uid cannot configure it (no CAP_NET_ADMIN), and
  its sockets, abstract ones included, die with the run's processes;
- the pid namespace: the next run starts with no process of an earlier one alive (checked
  by waitpid, see `_launcher.kill_namespace`); only the pid counter goes on, so a run can
  tell how many processes ran before it in its worker;
- the worker's memory, which every child inherits copy-on-write: the worker never
  unmarshals a job (it reads each frame into a buffer it zeroes after the fork), so no
  earlier job's code or tests are in it, only the setup (limits, mount plan). Modules
  imported by the worker start every run in the same state; the hash seed (set order) is
  the worker's, the same for its runs; `random` reseeds in each child;
- RLIMIT_NPROC of the sandbox uid, shared by concurrent runs as before.
The worker runs as root and never runs job code; the code runs as another uid without
capabilities, so it cannot signal, trace or read the worker (which is also non-dumpable).
Without that boundary, i.e. when the service is not root and the code would run as the
worker's own uid, every job gets a fresh launcher that exits after it (`fork_server=False`),
the same containment as one launcher per run.

What is NOT isolated, at any level:
- CPU time and memory bandwidth are shared with the host (no cpu cgroup); many runs at once
  slow each other down, and a run only gets `wall_seconds` of wall time.
- The kernel is shared: a kernel exploit escapes every level (no seccomp, no VM).
- Below `namespaces` there is no private filesystem view: world-readable files on the host
  (the repository checkout, a dataset installed in site-packages) can be read, world-writable
  directories (/tmp) written, other processes seen, and the network reached. As a non-root
  service at `process` level the code runs as the service's uid and can read (and, where
  the host's ptrace policy allows, trace) what the service can: that level is not a security
  boundary against hostile code.
- Below `full`: no total memory bound over several processes (RLIMIT_AS is per process),
  and RLIMIT_NPROC is shared by all runs of the same uid.
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

from ._calls import explained
from .config import ISOLATION_ORDER, IsolationLevel, SandboxConfig

log = logging.getLogger(__name__)

Status = Literal["ok", "failed", "timeout", "oom", "crash", "error"]

_HERE = Path(__file__).parent
_LAUNCHER_SOURCE = (_HERE / "_launcher.py").read_text()
_CALLS_SOURCE = (_HERE / "_calls.py").read_text()
# A worker's start-up (interpreter, mounts, imports) and a run's own setup happen before the
# worker's per-run deadline starts; the service waits this much longer before killing the
# worker itself (only a wedged host needs it).
_STARTUP_SLACK_S = 5.0
_PROBE_WALL_S = 30.0
_RESULT_MAX = 8 << 20  # any one blob of a record (the launcher caps a report at 4 MiB)
_PRIVATE_DIRS = ("/var/tmp", "/dev/shm")
# A worker's memory cgroup holds the worker and the tests' process beside the code's: their
# share, over the configured `memory_mb` (measured: ~15 MB worker, ~10 MB tests, shared pages
# counted once).
_WORKER_MEMORY = 64 << 20
_TMPFS_INODES = 4096
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
# Where a worker builds its new root, in its own mount namespace (the first that exists and
# holds no visible path: mounting there hides what was below it).
_ROOT_STAGING = ("/tmp", "/mnt", "/media", "/srv", "/opt")


@dataclass(frozen=True)
class SandboxJob:
    """The code to run, and the tests that judge it in a separate process.

    `code` is the whole program of the sample (a task's prefix included). Each case is a
    snippet (one assert, or a HumanEval block that defines `check` and calls it) run in the
    judge; it passes when it runs without raising. `prefix` is the task's trusted code, run
    in the judge before the cases, so the helpers and imports it defines are the task's own;
    `entry_point`, when set, is always the code's (never the prefix's stub).
    """

    code: str
    cases: tuple[str, ...]
    prefix: str = ""
    entry_point: str = ""


@dataclass(frozen=True)
class SandboxResult:
    status: Status
    """ok: every case passed; failed: some did not (including code that raised while
    loading); timeout: wall or CPU limit; oom: out of memory (MemoryError or the memory
    cgroup); crash: the code's process died (signal, non-zero exit) before the tests ended,
    or the tests' process died without reporting; error: the sandbox itself failed (the
    host's fault, not the sample's)."""
    passed: int
    failed: int
    timed_out: bool
    exit_code: int | None
    """Exit code of the process that ran the code when it ended on its own before the tests
    did (negative: killed by that signal); None when it was still answering at the end."""
    error: str
    """Why the sample did not pass: the first failing case's exception, the limit hit, ..."""
    stdout: str
    stderr: str
    seconds: float
    cpu_seconds: float = 0.0
    case_passed: tuple[bool, ...] = ()
    """One per case when the tests reported (else empty)."""


@dataclass(frozen=True)
class IsolationReport:
    """What the host allowed, detected once by probe runs at start-up."""

    level: IsolationLevel
    namespaces: bool
    user_namespace: bool
    cgroups: bool
    uid: int
    """Host uid the code runs as."""
    judge_uid: int
    """Host uid the tests run as (the same as `uid` only where no second uid exists)."""
    visible_paths: tuple[str, ...]
    """What a run's filesystem holds (namespace levels; empty: the host's whole tree)."""
    hidden_paths: tuple[str, ...]
    notes: tuple[str, ...] = ()
    """Why each stronger level was not available."""
    fork_server: bool = False
    """Runs are forked from long-lived pre-imported workers (one namespace set per worker,
    fresh mount/IPC namespaces per run); False: a fresh launcher process per run."""

    def describe(self) -> str:
        parts = [f"isolation={self.level}", f"uid={self.uid}", f"tests uid={self.judge_uid}"]
        parts.append("net+pid+mount namespaces" if self.namespaces else "no namespaces")
        if self.user_namespace:
            parts.append("user namespace")
        parts.append("cgroups pids+memory" if self.cgroups else "no cgroups")
        if self.namespaces:
            parts.append(f"visible={','.join(self.visible_paths) or '-'}")
            parts.append(f"hidden={len(self.hidden_paths)} dirs")
        parts.append("fork-server workers" if self.fork_server else "a fresh launcher per run")
        return ", ".join(parts)


class IsolationUnavailable(FatalError):
    """The host cannot give the isolation the configuration requires."""


class _Cgroups:
    """Cgroup v1 groups (pids, memory), one pair per worker, under a parent made inside our own cgroup.

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
        runs = {d: os.path.join(parent, d) for d in os.listdir(parent) if d.startswith(("run-", "worker-"))}
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
    judge_uid: int | None = None
    judge_gid: int | None = None
    drop_caps: bool = False
    """The runs start with capabilities that no setuid takes away (a user namespace's root,
    or the host's root at the last-resort level): they give them all up instead."""
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
        mounts = self._plan.mounts
        self.report = IsolationReport(
            level=self._plan.level,
            namespaces=self._plan.namespaces,
            user_namespace=self._plan.user_namespace,
            cgroups=self._plan.cgroups is not None,
            uid=self._plan.uid if self._plan.uid is not None else os.geteuid(),
            judge_uid=self._plan.judge_uid if self._plan.judge_uid is not None else os.geteuid(),
            visible_paths=tuple(mounts["visible"]) if mounts else (),
            hidden_paths=tuple(mounts["hidden"]) if mounts else (),
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
        # -u: the children exit with os._exit (no flushing), so stdio must not be buffered
        python = [self._python, "-I", "-S", "-B", "-u", "-c", _LAUNCHER_SOURCE]
        ns_flags = ["--net", "--pid", "--fork", "--mount-proc", "--kill-child", "--"]
        drop = {"uid": cfg.sandbox_uid, "gid": cfg.sandbox_gid, "judge_uid": cfg.judge_uid,
                "judge_gid": cfg.judge_gid} if root else {}

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
                    user_namespace=not root, drop_caps=not root, cgroups=cgroups,
                    mounts=self._mounts, **drop,
                )

            return make

        def plain(as_root: bool):
            def make(notes: list[str]) -> _Plan:
                return _Plan("process", python, drop_caps=as_root, **({} if as_root else drop))

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
            "calls_source": _CALLS_SOURCE,
            "uid": plan.uid,
            "gid": plan.gid,
            "judge_uid": plan.judge_uid,
            "judge_gid": plan.judge_gid,
            "mounts": plan.mounts,
            "work_root": self._work_root,
            "tail_bytes": cfg.output_tail_bytes,
            "limits": {
                "cpu_seconds": cfg.cpu_seconds,
                "address_space_bytes": cfg.memory_mb << 20,
                "file_size_bytes": cfg.file_size_mb << 20,
                "open_files": cfg.open_files,
                "nproc": cfg.max_processes if plan.uid is not None else None,
                "drop_caps": plan.drop_caps,
            },
        }
        reuse = plan.uid is not None
        setup["preimport"] = reuse  # worth its start-up cost only for a worker that serves many
        groups = None
        if plan.cgroups is not None:
            # The worker and the tests' process live in the groups too (they are born there).
            groups = (plan.cgroups, cfg.max_processes + 2, (cfg.memory_mb << 20) + _WORKER_MEMORY)
        return _Workers(plan.argv, setup, reuse=reuse, cwd=self._work_root, groups=groups)

    @functools.cached_property
    def _mounts(self) -> dict:
        """The filesystem plan of the namespace levels (computed once: it asks the interpreter).

        Visible: the configured system paths that exist (a symlink such as a merged-/usr
        `/lib` stays a symlink) and the interpreter's prefix, without paths already inside
        another. Hidden, inside those: every site-packages or dist-packages directory of the
        interpreter, every directory this service imports from that is not the standard
        library (a virtualenv, the checkout), and `hidden_paths`."""
        probe = (
            "import site, sys, sysconfig\n"
            "p = sysconfig.get_paths()\n"
            "print(sys.base_prefix)\n"
            "print('\\n'.join([p['stdlib'], p['platstdlib']]))\n"
            "print('\\n'.join(set(site.getsitepackages() + [p['purelib'], p['platlib']])))\n"
        )
        out = subprocess.run([self._python, "-I", "-S", "-c", probe], capture_output=True,
                             text=True, check=True, env=_ENV).stdout.splitlines()
        prefix, stdlib, sitedirs = out[0], out[1:3], out[3:]
        real = lambda p: os.path.realpath(p)  # noqa: E731
        links, dirs = [], []
        for p in self._config.visible_paths:
            if os.path.islink(p):
                links.append(p)
            elif os.path.isdir(p):
                dirs.append(real(p))
        dirs.append(real(prefix))
        visible: list[str] = []
        for p in sorted(set(dirs)):
            if not any(_inside(p, v) for v in visible):
                visible.append(p)
        stdlib = [real(p) for p in stdlib]
        service_paths = [real(p) for p in sys.path if p and os.path.isdir(p)]
        service_paths += [str(_HERE.parents[1])]  # the checkout this package runs from
        sitedirs = [real(p) for p in sitedirs]
        hidden = set()
        for p in [*sitedirs, *service_paths, *self._config.hidden_paths]:
            p = real(p)
            in_stdlib = any(_inside(s, p) or _inside(p, s) for s in stdlib)
            if in_stdlib and not any(_inside(p, s) for s in sitedirs):
                continue  # the standard library, its lib-dynload and its parents stay visible
            if any(_inside(p, v) for v in visible) and os.path.isdir(p):
                hidden.add(p)
        staging = next((r for r in _ROOT_STAGING if os.path.isdir(r) and not os.path.islink(r)
                        and not any(_inside(v, r) for v in visible)), None)
        if staging is None:
            raise IsolationUnavailable(f"no directory among {_ROOT_STAGING} to build the sandbox's "
                                       "root on that holds none of its visible paths")
        return {
            "root": staging,
            "visible": sorted(links + visible),
            "hidden": sorted(hidden),
            "tmpfs_bytes": self._config.file_size_mb << 20,
            "tmpfs_inodes": _TMPFS_INODES,
            "private": list(_PRIVATE_DIRS),
        }

    def _probe(self, plan: _Plan) -> str | None:
        """Run a job that checks the plan's promises from the inside; None when all hold.

        The code (the candidate) reports what it sees; the cases (the judge) check it, and
        check their own uid too."""
        code = (
            "import os, socket, math, json, re, collections, itertools, functools, string, typing\n"
            "def seen():\n"
            "    return {\n"
            "        'ids': (os.getuid(), os.getgid()), 'ppid': os.getppid(),\n"
            "        'pids': sorted(p for p in os.listdir('/proc') if p.isdigit()),\n"
            "        'net': [n for _, n in socket.if_nameindex()], 'tmp': os.listdir('/tmp'),\n"
            "        'root': sorted(os.listdir('/')),\n"
            "        'empty': {p: os.listdir(p) for p in HIDDEN if os.path.isdir(p)},\n"
            "        'cgroup': 'hotloop-sbx-' in open('/proc/self/cgroup').read(),\n"
            "        'gcd': math.gcd(12, 18),\n"
            "    }\n"
        )
        mounts = plan.mounts or {}
        code += f"HIDDEN = {list(mounts.get('hidden', ()))!r}\n"
        cases = ["assert seen()['gcd'] == 6"]
        if plan.uid is not None:
            cases.append(f"assert seen()['ids'] == ({plan.uid}, {plan.gid})")
            cases.append(f"import os\nassert (os.getuid(), os.getgid()) == ({plan.judge_uid}, {plan.judge_gid})")
        if plan.namespaces:
            top = {"proc", "dev", "tmp", "var"} | {p.strip("/").split("/")[0] for p in mounts["visible"]}
            # the worker is pid 1; the tests' process and the code's are the only others
            cases.append("s = seen()\nassert s['ppid'] == 1 and len(s['pids']) == 3 and '1' in s['pids'], s")
            cases.append("assert seen()['net'] == ['lo']")
            cases.append("assert seen()['tmp'] == ['work'], seen()['tmp']")
            cases.append(f"assert set(seen()['root']) <= {top!r}, seen()['root']")
            cases.append("assert all(v == [] for v in seen()['empty'].values()), seen()['empty']")
        if plan.cgroups is not None:
            cases.append("assert seen()['cgroup']")
        # A generous clock: the probe asks what the host allows, not how fast it is now (a
        # loaded host must not look like one without isolation).
        result = self._run(plan, SandboxJob(code, tuple(cases)), max(self._config.wall_seconds, _PROBE_WALL_S))
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

    def _run(self, plan: _Plan, job: SandboxJob, wall_seconds: float | None = None) -> SandboxResult:
        cfg = self._config
        wall = cfg.wall_seconds if wall_seconds is None else wall_seconds
        start = time.perf_counter()
        tag = secrets.token_hex(16)  # matches the record to its job; not a secret of anything
        worker: _Worker | None = None
        try:
            # Only the spawn is guarded: an OSError there is the host refusing (no more
            # processes, cgroup limits), reported as status "error".
            try:
                worker = plan.workers.acquire()
            except OSError as e:
                return _error_result(job, f"sandbox could not start the run: {e}", start)
            code = marshal.dumps({"code": job.code, "names": _names_used(job.cases, job.entry_point)})
            tests = marshal.dumps({"cases": [_explained(c) for c in job.cases], "prefix": job.prefix,
                                   "entry_point": job.entry_point})
            ooms_before = worker.oom_kills()
            record, killed = worker.request(tag, code, tests, wall)
            oom_kills = worker.oom_kills() - ooms_before
            healthy = record is not None and "launcher_error" not in record
            plan.workers.release(worker, healthy)
            rc, worker_stderr = worker.proc.returncode, "" if healthy else worker.stderr_tail()
            worker = None
            result = self._classify(job, record, killed, rc, oom_kills, start, wall)
            if record is None and result.status == "error":  # the launcher's own complaint
                result = replace(result, error=f"{result.error}: {worker_stderr.strip()[-500:]}")
            return result
        finally:
            if worker is not None:  # an exception between acquire and release
                plan.workers.release(worker, False)

    def _classify(
        self, job: SandboxJob, record: dict | None, killed: bool, launcher_rc: int | None,
        oom_kills: int, start: float, wall: float,
    ) -> SandboxResult:
        """The judge's report decides what passed; the processes' ends say what else happened.

        Nothing the code's process wrote (its stdout, stderr or exit code) can mark a case as
        passed: only the judge's bits can, and the judge fails every case it could not decide."""
        cfg = self._config
        total = len(job.cases)
        res = SandboxResult(
            status="crash", passed=0, failed=total, timed_out=False, exit_code=None, error="",
            stdout="", stderr="", seconds=time.perf_counter() - start,
        )
        if record is None:
            if killed:
                return replace(res, status="timeout", timed_out=True,
                               error=f"the run did not finish within {wall + _STARTUP_SLACK_S:.0f}s")
            if launcher_rc is not None and launcher_rc < 0:
                return replace(res, error=f"the sandbox launcher was killed by {_signame(-launcher_rc)}")
            return replace(res, status="error",
                           error=f"the sandbox launcher exited with {launcher_rc} and no record")
        if "launcher_error" in record:
            return replace(res, status="error", error=f"sandbox launcher failed: {record['launcher_error']}")
        if record["setup_error"]:
            return replace(res, status="error", error=f"sandbox setup failed: {record['setup_error'][:500]}")
        code = None if record["candidate"] == "alive" else int(record["candidate"])
        cpu, judge_code = record["cpu_seconds"], record["judge_code"]
        res = replace(res, exit_code=code, cpu_seconds=cpu, stdout=record["stdout"], stderr=record["stderr"])
        fields = record["report"].split("\t")
        if fields[0] == "setup":
            return replace(res, status="error", error=f"sandbox setup failed: {' '.join(fields[1:])}")
        bits = None
        if judge_code == 0 and fields[0] == "result" and len(fields) == 4:
            if len(fields[1]) == total and set(fields[1]) <= {"0", "1"}:
                bits, oom, error = fields[1], fields[2] == "1", fields[3]
        timeout = ""
        if record["timed_out"] or killed:
            timeout = f"wall-clock limit of {wall:g}s"
        # SIGXCPU at the soft limit, SIGKILL at the hard one (soft + 1 s) when SIGXCPU was
        # ignored. rusage lags the kernel's own CPU clock a little, hence the margin.
        elif code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= 0.8 * cfg.cpu_seconds):
            timeout = f"CPU limit of {cfg.cpu_seconds}s"
        elif judge_code == -signal.SIGXCPU:
            timeout = f"CPU limit of {cfg.cpu_seconds}s (in the tests)"
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
        # Over a limit, nothing counts (as if the run had stopped there); otherwise the
        # judge's bits.
        if bits is None:
            how = f"was killed by {_signame(-judge_code)}" if judge_code < 0 else f"exited with code {judge_code}"
            tail = record["judge_stderr"].strip()[-300:]
            return replace(res, error=f"the tests' process {how} without reporting" + (f": {tail}" if tail else ""))
        passed = bits.count("1")
        res = replace(res, passed=passed, failed=total - passed, error=error,
                      case_passed=tuple(b == "1" for b in bits))
        if passed == total and not oom:
            return replace(res, status="ok")
        if code not in (None, 0):
            how = f"was killed by {_signame(-code)}" if code < 0 else f"exited with code {code}"
            return replace(res, error=f"the code's process {how} before the tests ended; {res.error}")
        return replace(res, status="oom" if oom else "failed")


@functools.lru_cache(maxsize=4096)
def _explained(case: str) -> str:
    """`assert a == b` with a message that says what came back (a task's cases recur every
    step: rewritten once)."""
    return explained(case)


@functools.lru_cache(maxsize=4096)
def _names_used(cases: tuple[str, ...], entry_point: str) -> list[str]:
    """The names the cases read and may take from the code: the candidate sends these along
    when its code has loaded, instead of one request each. Only names, never values: what a
    test expects stays in the judge. Builtins and modules still resolve in the judge first."""
    import ast
    import builtins

    from hotloop import pyast

    names = {entry_point} if entry_point else set()
    for case in cases:
        try:
            tree = pyast.parse(case)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        names.update(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
    return sorted(n for n in names if not hasattr(builtins, n) and n not in sys.stdlib_module_names)


def _inside(path: str, parent: str) -> bool:
    """`path` is `parent` or lies below it."""
    return path == parent or path.startswith(parent.rstrip("/") + "/")


class _Worker:
    """One launcher process (see `_launcher.py`) and the pipes to it.

    The service writes job frames to its stdin and reads record frames from its stdout; no
    run ever holds either pipe. Its stderr is read only when it fails (it writes nothing there
    otherwise: the runs' output goes to per-run memfds).
    """

    _BLOBS = ("stdout", "stderr", "report", "judge_stderr", "setup_error")

    def __init__(self, argv: list[str], setup: bytes, cwd: str,
                 groups: tuple[_Cgroups, dict[str, str]] | None = None):
        self._groups = groups
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

    def oom_kills(self) -> int:
        """Out-of-memory kills in this worker's memory group so far (0 without cgroups)."""
        return self._groups[0].oom_kills(self._groups[1]) if self._groups else 0

    def request(self, tag: str, code: bytes, tests: bytes, wall_seconds: float
                ) -> tuple[dict | None, bool]:
        """Send one job (its code frame, then its tests frame), wait for its record; (record or
        None, whether the deadline passed). The run's own limit is `wall_seconds`; the service
        waits `_STARTUP_SLACK_S` longer before it gives up on the worker."""
        deadline = time.monotonic() + wall_seconds + _STARTUP_SLACK_S
        try:
            self.proc.stdin.write(b"C" + int(wall_seconds * 1000).to_bytes(8, "little")
                                  + len(code).to_bytes(8, "little") + code + b"T"
                                  + tag.encode() + len(tests).to_bytes(8, "little") + tests)
        except BrokenPipeError:
            return None, False
        head = self._read_until(b"\n", deadline)
        if head is None:
            return None, time.monotonic() >= deadline
        fields = head.decode("utf-8", "replace").rstrip("\n").split("\t")
        if fields[0] != tag or len(fields) < 3:
            return None, False  # not this job's record: the worker is broken; treated as no record
        kind, rest = fields[1], fields[2:]
        n_blobs = len(self._BLOBS) if kind == "record" else 1
        try:
            sizes = [int(x) for x in rest[-n_blobs:]]
        except ValueError:
            return None, False
        if len(sizes) != n_blobs or any(n < 0 or n > _RESULT_MAX for n in sizes):
            return None, False
        blobs = []
        for n in sizes:
            blob = self._read_exact(n, deadline)
            if blob is None:
                return None, time.monotonic() >= deadline
            blobs.append(blob.decode("utf-8", "replace"))
        if kind == "launcher_error":
            return {"launcher_error": blobs[0]}, False
        judge_code, timed_out, candidate, cpu, max_rss = rest[:5]
        return {
            "judge_code": int(judge_code), "timed_out": timed_out == "1", "candidate": candidate,
            "cpu_seconds": float(cpu), "max_rss_kb": int(max_rss), **dict(zip(self._BLOBS, blobs)),
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
        if self._groups is not None:
            self._groups[0].destroy(self._groups[1])

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

    def __init__(self, argv: list[str], setup: dict, reuse: bool, cwd: str,
                 groups: tuple[_Cgroups, int, int] | None = None):
        self._argv, self._setup, self.reuse, self._cwd = argv, setup, reuse, cwd
        self._groups = groups  # (cgroups, pids.max, memory bytes) of each worker's own groups
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def _spawn(self) -> _Worker:
        """A worker in groups of its own (`full`): made here, removed when it finishes."""
        if self._groups is None:
            return _Worker(self._argv, marshal.dumps({**self._setup, "cgroup_procs": []}), self._cwd)
        cgroups, max_pids, memory = self._groups
        groups = cgroups.create(f"worker-{secrets.token_hex(6)}", max_pids, memory)
        procs = [os.path.join(g, "cgroup.procs") for g in groups.values()]
        try:
            return _Worker(self._argv, marshal.dumps({**self._setup, "cgroup_procs": procs}), self._cwd,
                           (cgroups, groups))
        except BaseException:
            cgroups.destroy(groups)
            raise

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
