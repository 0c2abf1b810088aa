"""The program every sandbox worker executes: `python -I -S -c <this source>`.

Owns the inside of a worker: reading its setup and then jobs from stdin, the worker's
filesystem view (namespace levels: a new root holding only the visible paths, read-only, made
once per worker), and for each job two processes, the *candidate* (the sample's code) and the
*judge* (the task's tests; `_calls.py` owns what the two say to each other), reaping both and
everything they left, and writing one record per job to stdout. It is passed as source text
(not a path) so that it works when the service's directories are out of the sandbox's view,
and it imports only the standard library because `-S` leaves site-packages off the path.
`_calls.py` arrives as text in the setup and is loaded as a module here.

Does not own: choosing the isolation or whether a worker serves one job or many (`sandbox.py`
decides: it closes stdin after the first job when the code would run as the worker's own uid),
classifying outcomes (the service reads the record), or anything after the run.

Three kinds of process, with different trust:
- the worker (this process): trusted, keeps the privileges it started with (root inside the
  namespaces when the host allows), never runs job code and never unmarshals a job: it reads
  each frame's bytes into a buffer, forks, and zeroes the buffer, so no earlier job's code or
  tests are in the memory a later child inherits.
- the candidate: forked after the job's code frame is read and BEFORE its tests frame is, so
  no test of its own job was ever in its memory. Makes its own mount
  and IPC namespaces with fresh private tmpfs (namespace levels), keeps only stdio (this
  run's memfds) and its two pipes to the judge, sets rlimits, drops to the sandbox uid (or,
  in a user namespace, every capability), sets no_new_privs, then loads the code and answers
  calls. It holds no expected value, no report channel and no code that counts a pass.
- the judge: forked after the tests frame is read. Keeps its report
  channel (a memfd) and its two pipes, sets rlimits, drops to the judge uid, becomes
  non-dumpable (so the candidate cannot trace it or read its memory even as the same uid),
  sets no_new_privs and runs the tests. Its report is the run's only verdict.

Cgroups (`full`): the worker joins its own pids and memory groups once, at start, and every
child is born in them. A cgroup v1 migration takes a global lock and an RCU grace period
(measured: it more than doubled a run's CPU when both processes of every run joined per-run
groups), so no run migrates. Between runs the groups hold only the worker, which is never
the OOM killer's choice (oom_score_adj -1000); the candidate is its first (1000).

Wire format (both directions length-framed, so no byte of a run's output is ever parsed as
structure): setup = 8-byte length + marshal; a job is two frames, b"C" + its wall-clock limit
in ms (8 bytes) + 8-byte length + marshal (the code) and b"T" + tag (32 ascii) + 8-byte length
+ marshal (the tests); record =
one text header line `tag \\t kind \\t fields...` and then the blobs whose byte counts are
the header's last fields.
"""

import ctypes
import fcntl
import marshal
import os
import resource
import select
import signal
import time
import types

# mount(2) flags (linux/mount.h)
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
# noroot, no_setuid_fixup and keep_caps off, each locked: uid 0 never means capabilities again
SECBIT_NOROOT_ALL = 0x2F
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

SETUP_FAILED = 125
REPORT_MAX = 4 << 20  # the worker reads at most this much of the judge's report
TAG_LEN = 32
DEV_NODES = ("null", "zero", "full", "random", "urandom")
HIGH_FD = 100  # where a child parks its fds before putting them in their final places
CANDIDATE_GRACE_S = 0.2  # for the candidate to end after the judge closed its requests

# Imported once per worker, before any job: every child of the worker starts with them in
# sys.modules, so the code's `import math` is a dictionary lookup instead of a file read.
# Each child gets a copy-on-write copy; nothing a run does to them reaches the worker or a
# later run. `random` reseeds itself in every forked child (os.register_at_fork). Every
# module also makes each of a run's two forks dearer (page tables, copy-on-write): hashlib
# (OpenSSL, 3.9 MB), dataclasses (inspect, 1.7 MB) and socket are left for the rare run
# that imports them.
PREIMPORT = (
    "math", "re", "collections", "itertools", "functools", "string", "typing", "heapq",
    "bisect", "operator", "random", "fractions", "decimal", "statistics", "copy", "json",
    "datetime",
)

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _statvfs_flags(path: str) -> int:
    # A bind remount must repeat the mount's locked flags (nosuid, nodev, noexec) or the kernel
    # refuses it inside a user namespace.
    f = os.statvfs(path).f_flag
    out = 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC)):
        if f & st:
            out |= ms
    return out


def _bind_readonly(src: str, target: str) -> None:
    _mount(src, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _statvfs_flags(target))


def setup_root(m: dict) -> None:
    """Make the worker's filesystem view, once: a new root that holds only what runs may see.

    Runs in the worker's own mount namespace (made by unshare), so nothing here is visible to
    the host. The new root is a small tmpfs at `m["root"]`, holding read-only bind mounts of
    the visible paths (symlinks such as a merged-/usr `/lib` are copied as links), empty
    read-only tmpfs over the hidden paths inside them, /proc, a /dev of a few harmless nodes,
    and empty directories for the per-run tmpfs (`private_mounts`). Then pivot_root: the
    host's root is detached, so nothing outside this view exists for the worker or its runs.
    Only where the kernel's pivot_root number is unknown does it fall back to chroot.
    """
    root = m["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    for path in m["visible"]:
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            _bind_readonly(path, target)
    for path in m["hidden"]:
        if os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=755")
    os.makedirs(root + "/proc")
    _mount("/proc", root + "/proc", None, MS_BIND | MS_REC)
    os.makedirs(root + "/dev")
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for node in DEV_NODES:
        open(f"{root}/dev/{node}", "w").close()
        _mount(f"/dev/{node}", f"{root}/dev/{node}", None, MS_BIND)
    for path in ("/tmp", *m["private"]):
        os.makedirs(root + path, mode=0o755, exist_ok=True)
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is not None:
        # pivot_root(".", "."): the old root ends up stacked under the new one; detaching it
        # leaves the new root alone in this namespace.
        _check(_libc.syscall(number, b".", b"."), "pivot_root")
        _check(_libc.umount2(b".", MNT_DETACH), "umount the host's root")
    else:
        os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=755")


def private_mounts(m: dict, uid, gid) -> str:
    """In the candidate, before it drops privileges: its own mount and IPC namespaces with
    fresh, empty tmpfs on every writable directory; returns the working directory.

    Made per run, not per worker, so nothing a run writes (files in /tmp, /dev/shm, SysV or
    POSIX IPC objects) is there for the next run of the same worker: the namespaces, and the
    tmpfs with them, go away when the run's last process exits.
    """
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare(mount, ipc)")
    tmpfs = f"size={m['tmpfs_bytes']},nr_inodes={m['tmpfs_inodes']},mode=1777"
    for path in ("/tmp", *m["private"]):
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, gid)
    return workdir


def _join_cgroups(procs_files: list) -> None:
    """Join the worker's groups, made by the service (its children are born in them)."""
    for path in procs_files:
        with open(path, "w") as f:
            f.write("0")  # cgroup v1: 0 means the writing process


def _oom_score(pid: int, adj: int) -> None:
    """Best effort: some hosts refuse to lower it even to root; raising it always works, and
    the candidate's 1000 already makes it the OOM killer's first choice."""
    try:
        fd = os.open(f"/proc/{pid}/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, str(adj).encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def _die_with_the_worker(pidns: bool) -> None:
    """Outside a pid namespace of its own, a child must not outlive a killed worker; inside
    one, the kernel kills every process of the namespace when the worker (its pid 1) dies."""
    if not pidns:
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")


def _place_fds(fds: dict) -> None:
    """Put each source fd at its target number (0, 1, 2, 3, ...) and close every other fd.

    The sources are first parked above every target, so no dup2 overwrites a source that a
    later one still needs."""
    parked = {target: fcntl.fcntl(src, fcntl.F_DUPFD, HIGH_FD) for target, src in fds.items()}
    for target, fd in parked.items():
        os.dup2(fd, target)  # the copy at `target` is inheritable and not close-on-exec
    os.closerange(max(fds) + 1, 1 << 16)


def _drop_privileges(limits: dict, uid, gid, dumpable: bool) -> None:
    rl = resource.setrlimit
    rl(resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1))
    rl(resource.RLIMIT_AS, (limits["address_space_bytes"], limits["address_space_bytes"]))
    rl(resource.RLIMIT_FSIZE, (limits["file_size_bytes"], limits["file_size_bytes"]))
    rl(resource.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"]))
    rl(resource.RLIMIT_CORE, (0, 0))
    if limits.get("nproc") is not None:
        # Only meaningful for a dedicated uid: the count is per user, and root ignores it.
        rl(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
    if uid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)  # from real root: every capability goes with it
    elif limits["drop_caps"]:
        # Root of a user namespace (or, as a last resort, of the host) (no other uid is mapped): give up every capability for good,
        # so the process cannot trace the judge, mount, or regain them through exec.
        for cap in range(64):
            if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break  # past the kernel's last capability
        _check(_libc.prctl(PR_SET_SECUREBITS, SECBIT_NOROOT_ALL, 0, 0, 0), "prctl(SECUREBITS)")
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty
        _check(_libc.capset(header, data), "capset")
    if not dumpable:
        # Not dumpable: /proc/<pid>/mem, environ and ptrace need CAP_SYS_PTRACE, whatever the
        # uid. Set after setuid, which would reset it.
        _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")


def candidate_child(setup, calls, body, fds, workdir, pidns) -> None:
    """The candidate: its limits and identity, then the code and its calls. Never returns.

    `fds`: stdout, stderr, the request pipe's read end, the reply pipe's write end, and the
    ready pipe, on which it tells the worker that its setup is done (or why it failed) and
    which it closes before any code of the run executes."""
    ready = fds["ready"]
    try:
        os.setpgid(0, 0)  # its own group, so the worker can kill its descendants in one call
        _die_with_the_worker(pidns)
        job = marshal.loads(body)
        uid, gid = setup["uid"], setup["gid"]
        if setup["mounts"] is not None:
            workdir = private_mounts(setup["mounts"], uid, gid)
        os.chdir(workdir)
        null = os.open("/dev/null", os.O_RDONLY)
        _place_fds({0: null, 1: fds["out"], 2: fds["err"], 3: fds["requests"], 4: fds["replies"],
                    5: ready})
        ready = 5
        _drop_privileges(setup["limits"], uid, gid, dumpable=True)
        code, names = job["code"], job["names"]
        del job, setup, body
        os.write(ready, b"ok")
        os.close(ready)
    except BaseException as e:
        try:
            os.write(ready, f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:2000])
        finally:
            os._exit(SETUP_FAILED)
    calls.candidate_main(code, names, 3, 4)
    os._exit(0)


def judge_child(setup, calls, body, fds, pidns) -> None:
    """The judge: its limits and identity, then the tests. Never returns."""
    report = fds["report"]
    try:
        os.setpgid(0, 0)
        _die_with_the_worker(pidns)
        tests = marshal.loads(body)
        os.chdir("/")
        null = os.open("/dev/null", os.O_RDWR)
        _place_fds({0: null, 1: fds["err"], 2: fds["err"], 3: report, 4: fds["replies"],
                    5: fds["requests"]})
        report = 3
        _drop_privileges(setup["limits"], setup["judge_uid"], setup["judge_gid"], dumpable=False)
        del setup, body
    except BaseException as e:
        os.write(report, f"setup\t{type(e).__name__}: {e}\n".encode("utf-8", "replace"))
        os._exit(SETUP_FAILED)
    calls.judge_main(tests, 4, 5, 3)
    os._exit(0)


def read_report(fd: int) -> bytes:
    """The judge's report line (without its newline); b"" if it wrote none."""
    data = os.pread(fd, REPORT_MAX, 0)
    return data.split(b"\n", 1)[0]


def _tail(fd: int, limit: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, limit, max(0, size - limit)) if limit else b""


def _children() -> list[int]:
    # /proc/<pid>/task/<tid>/children needs CONFIG_PROC_CHILDREN, which not every kernel has;
    # the parent pid in /proc/<pid>/stat always works.
    me = os.getpid()
    kids: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we looked
        # comm (field 2) may contain spaces and parentheses: split after its last ")".
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[1]) == me:
            kids.append(int(name))
    return kids


def kill_descendants() -> None:
    """Kill every process the run left behind, including ones that left its groups.

    The worker is a child subreaper, so orphans of the job (daemonized, setsid, double fork)
    are re-parented to it rather than to the host's init: killing its children until none
    are left reaches all of them. Bounded rounds: a fork bomb is also bounded by pids.max or
    RLIMIT_NPROC.
    """
    for _ in range(1000):
        kids = _children()
        if not kids:
            return
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def kill_namespace() -> None:
    """As pid 1 of the worker's pid namespace: kill every other process in it, reap them all.

    kill(-1) from pid 1 reaches every process of the namespace (and of namespaces nested in
    it) but pid 1 itself, and the kernel makes it atomic against fork. Every process of a pid
    namespace descends from its pid 1, and orphans are re-parented towards it, so when waitpid
    says there is no child left, this worker is the only process in its namespace: the next
    run starts with no process of an earlier one alive.
    """
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing left to signal
        try:
            while True:
                os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reap(pid: int, deadline: float) -> tuple[int, bool]:
    """Wait for the judge until `deadline`, kill it when it runs over; (status, timed out)."""
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
    os.close(pidfd)
    _killpg(pid)  # its group either way: after a normal exit it holds only stragglers
    _, status = os.waitpid(pid, 0)
    return status, not ready


def end_candidate(pid: int, deadline: float) -> tuple[str, object]:
    """The candidate's end: "alive" when it was still running at `deadline` (then it is
    killed, with its group), else its exit code as text; and its resource usage.

    Called once the judge is done, which closed the request pipe: a candidate that is not
    dying already ends at that end of input, so the wait is short unless it ignores it."""
    pidfd = os.pidfd_open(pid)
    ended, _, _ = select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
    os.close(pidfd)
    _killpg(pid)
    _, status, usage = os.wait4(pid, 0)
    return (str(os.waitstatus_to_exitcode(status)) if ended else "alive"), usage


def read_ready(fd: int, deadline: float) -> str | None:
    """"" once the candidate's setup is done; why it failed if it said or ended; None when
    the run's deadline came first (a timeout, not a failure of the sandbox)."""
    data = b""
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    if data == b"ok":
        return ""
    return data.decode("utf-8", "replace") or "the code's process ended during its setup"


def _read_exact(fd: int, n: int, buf=None):
    """n bytes from fd into a fresh bytearray (or `buf`); None at a clean end of input."""
    buf = bytearray(n) if buf is None else buf
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.readv(fd, [view[got:n]])
        if k == 0:
            if got == 0:
                return None
            raise EOFError(f"input ended {n - got} bytes short")
        got += k
    view.release()
    return buf


def _frame(kind: bytes, prefix: int):
    """The next frame of `kind` from stdin: (its `prefix` bytes after the kind, body); None at
    a clean end of input."""
    size = 1 + prefix + 8
    head = _read_exact(0, size)
    if head is None:
        return None
    if head[:1] != kind:
        raise ValueError(f"expected a {kind!r} frame, got {bytes(head[:1])!r}")
    return bytes(head[1 : 1 + prefix]), _read_exact(0, int.from_bytes(head[size - 8 :], "little"))


def _send(kind: str, tag: str, fields: list, blobs: list) -> None:
    head = "\t".join([tag, kind, *fields, *(str(len(b)) for b in blobs)]) + "\n"
    data = head.encode() + b"".join(blobs)
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def run_job(setup: dict, calls, code_body: bytearray, wall_seconds: float, pidns: bool) -> None:
    """One job: fork the candidate, read the tests, fork the judge, reap both, send the record."""
    opened: list[int] = []
    workdir = ""

    def fd(n: int) -> int:
        opened.append(n)
        return n

    try:
        out = fd(os.memfd_create("hotloop-stdout"))
        err = fd(os.memfd_create("hotloop-stderr"))
        requests_r, requests_w = (fd(x) for x in os.pipe())
        replies_r, replies_w = (fd(x) for x in os.pipe())
        ready_r, ready_w = (fd(x) for x in os.pipe())
        if setup["mounts"] is None:
            # No mount namespace: a fresh directory on the host, only the run's uid may enter.
            workdir = os.path.join(setup["work_root"], f"hotloop-sbx-run-{os.urandom(8).hex()}")
            os.mkdir(workdir, 0o700)
            if setup["uid"] is not None:
                os.chown(workdir, setup["uid"], setup["gid"])
        deadline = time.monotonic() + wall_seconds
        candidate = os.fork()
        if candidate == 0:
            candidate_child(setup, calls, code_body, {
                "out": out, "err": err, "requests": requests_r, "replies": replies_w, "ready": ready_w,
            }, workdir, pidns)
        _oom_score(candidate, 1000)  # the OOM killer's first choice
        code_body[:] = bytes(len(code_body))  # the code stays out of what later children inherit
        for n in (requests_r, replies_w, ready_w):
            os.close(n)
            opened.remove(n)
        # Read only now: the candidate was forked before its tests were in this process.
        frame = _frame(b"T", TAG_LEN)
        if frame is None:
            raise EOFError("the service sent a job's code without its tests")
        tag, tests_body = frame[0].decode("ascii"), frame[1]
        report = fd(os.memfd_create("hotloop-report"))
        judge_err = fd(os.memfd_create("hotloop-judge-stderr"))
        judge = os.fork()
        if judge == 0:
            judge_child(setup, calls, tests_body, {
                "report": report, "err": judge_err, "replies": replies_r, "requests": requests_w,
            }, pidns)
        tests_body[:] = bytes(len(tests_body))
        for n in (replies_r, requests_w):
            os.close(n)
            opened.remove(n)
        setup_error = read_ready(ready_r, deadline)
        if setup_error:
            _killpg(judge)
        setup_error = setup_error or ""  # None: out of time during the setup, reaped as such
        status, timed_out = reap(judge, deadline)
        state, usage = end_candidate(candidate, min(deadline, time.monotonic() + CANDIDATE_GRACE_S))
        if pidns:
            kill_namespace()
        else:
            kill_descendants()
        tail = setup["tail_bytes"]
        fields = [str(os.waitstatus_to_exitcode(status)), "1" if timed_out else "0", state,
                  f"{usage.ru_utime + usage.ru_stime:.6f}", str(usage.ru_maxrss)]
        _send("record", tag, fields, [
            _tail(out, tail), _tail(err, tail), read_report(report), _tail(judge_err, 2000),
            setup_error.encode("utf-8", "replace"),
        ])
    finally:
        for n in opened:
            os.close(n)
        if workdir:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    # marshal, not json: it is built in, and the setup and jobs come from the service, which
    # is trusted. The records going back are text and raw blobs with byte counts, because the
    # service must never unmarshal bytes a run could have touched.
    head = _read_exact(0, 8)
    setup = marshal.loads(_read_exact(0, int.from_bytes(head, "little")))
    calls = types.ModuleType("hotloop_calls")
    exec(compile(setup.pop("calls_source"), "<hotloop calls>", "exec"), calls.__dict__)
    tag = "-" * TAG_LEN
    try:
        # Before the root changes (the cgroup filesystem is not in the new one).
        _join_cgroups(setup["cgroup_procs"])
        _oom_score(os.getpid(), -1000)  # never the worker (it runs every later job), where allowed
        if setup["mounts"] is not None:
            setup_root(setup["mounts"])
        _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
        # Not dumpable: /proc/<this>/mem and ptrace need CAP_SYS_PTRACE, whatever the uid.
        _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")
        # Inherited by every child and never lifted: no setuid binary (the visible /usr holds
        # some) can hand a run privileges back. The worker itself executes nothing.
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        pidns = setup["mounts"] is not None and os.getpid() == 1
        for name in PREIMPORT if setup["preimport"] else ():
            __import__(name)
        # Everything the worker holds now is shared, copy-on-write, with every child: frozen,
        # no child's garbage collection walks (and so copies) those objects' pages.
        import gc

        gc.freeze()
        while True:
            frame = _frame(b"C", 8)
            if frame is None:
                return  # the service closed the pipe: no more jobs
            wall_ms, body = frame
            run_job(setup, calls, body, int.from_bytes(wall_ms, "little") / 1000, pidns)
            del body, frame
    except Exception as e:  # a launcher bug or a host refusal: reported as an error record
        import traceback

        detail = f"{type(e).__name__}: {e} | " + traceback.format_exc().replace("\n", " | ")
        _send("launcher_error", tag, [], [detail.encode("utf-8", "backslashreplace")])


main()
