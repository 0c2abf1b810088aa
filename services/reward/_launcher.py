"""The program every sandbox run executes: `python -I -S -c <this source>`.

Owns the inside of one run: reading the job from stdin, the mount setup of the namespace
levels, forking the child that drops privileges and runs the untrusted code, reaping it, and
writing one record for the service. It is passed as source text (not a path) so that it works
when the service's directories are hidden from the sandbox, and it imports only the standard
library because `-S` leaves site-packages off the path.

Does not own: choosing the isolation (`sandbox.py` decides and tells it through the payload),
classifying outcomes (the service reads the record), or anything after the run.

Two processes, with different trust:
- the reaper (this process): trusted, keeps the privileges it started with (root inside the
  namespaces when the host allows), never runs job code. It waits for the child with a
  deadline, collects its exit status and CPU time, and writes the record to the result fd,
  which the child never holds.
- the child: joins the run's cgroups, closes every fd but stdio and its report channel, sets
  rlimits, drops to the sandbox uid, sets no_new_privs, then runs the harness: the job's code,
  then each test case, counting passes. Its report is one line, prefixed with the run's
  nonce, written to a memfd only after all cases ran ("written last"), so no partial report
  is ever visible to the code under test.
"""

import ctypes
import marshal
import os
import resource
import select
import signal
import sys
import time

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
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

CHAN_FD = 3  # the child's report channel is always fd 3, below any RLIMIT_NOFILE
SETUP_FAILED = 125
REPORT_MAX = 1 << 16  # the reaper reads at most this much of the child's channel

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


def setup_mounts(m: dict, uid: int | None, gid: int | None) -> str:
    """Make the filesystem view of the run; returns the working directory to use.

    Runs in the run's own mount namespace (made by unshare), so nothing here is visible to
    the host. Order matters: the interpreter's prefix is bind-mounted aside before the
    directories that contain it are hidden, then put back read-only inside the hiding tmpfs.
    """
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    tmpfs = f"size={m['tmpfs_bytes']},nr_inodes={m['tmpfs_inodes']},mode=1777"
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    staged = []
    for i, path in enumerate(m["expose"]):
        stage = f"/tmp/.expose-{i}"
        os.mkdir(stage)
        _mount(path, stage, None, MS_BIND | MS_REC)
        staged.append((path, stage))
    for hidden in m["hide"]:
        _mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
        for path, stage in staged:
            if path.startswith(hidden.rstrip("/") + "/"):
                os.makedirs(path, mode=0o755, exist_ok=True)
                _mount(stage, path, None, MS_BIND | MS_REC)
                _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _statvfs_flags(path))
        _mount(None, hidden, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for _, stage in staged:
        _check(_libc.umount2(stage.encode(), MNT_DETACH), f"umount {stage}")
        os.rmdir(stage)
    for path in m["private"]:
        if os.path.isdir(path) and not os.path.islink(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    # The root filesystem read-only (in this namespace only): whatever world-writable directory
    # the host has that is not in the private list, the run cannot write to it.
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | _statvfs_flags("/"))
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, gid)
    return workdir


def child(payload: dict, chan: int, workdir: str) -> None:
    """Set up the child's limits and identity, then run the harness. Never returns."""
    try:
        nonce = payload["nonce"]
        os.setpgid(0, 0)  # its own group, so the reaper can kill its descendants in one call
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        for procs in payload["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write("0")  # cgroup v1: 0 means the writing process
        os.chdir(workdir)
        os.dup2(chan, CHAN_FD)
        os.closerange(CHAN_FD + 1, 1 << 16)  # only stdio and the report channel stay open
        lim = payload["limits"]
        rl = resource.setrlimit
        rl(resource.RLIMIT_CPU, (lim["cpu_seconds"], lim["cpu_seconds"] + 1))
        rl(resource.RLIMIT_AS, (lim["address_space_bytes"], lim["address_space_bytes"]))
        rl(resource.RLIMIT_FSIZE, (lim["file_size_bytes"], lim["file_size_bytes"]))
        rl(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
        rl(resource.RLIMIT_CORE, (0, 0))
        if lim.get("nproc") is not None:
            # Only meaningful for a dedicated uid: the count is per user, and root ignores it.
            rl(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
        uid, gid = payload["uid"], payload["gid"]
        if uid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        # No setuid binary can hand the run its privileges back.
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        code, cases = payload["code"], payload["cases"]
        del payload
    except BaseException as e:  # report setup failures as such: they are the host's fault
        msg = (nonce + "\tsetup\t" + type(e).__name__ + ": " + str(e) + "\n").encode()
        os.write(chan, msg)
        os._exit(SETUP_FAILED)
    harness(nonce, code, cases)


def _describe(e, _type=type, _str=str, _plain=str.__str__, _BaseException=BaseException):
    """`Type: message` as an exact str. `str.__str__` copies a str subclass into a plain str:
    a subclass returned by the code's `__str__` could otherwise override `__radd__` and
    rewrite the report line it is concatenated into."""
    try:
        name = _plain(_type(e).__name__)
    except _BaseException:
        name = "<exception>"
    try:
        text = _plain(_str(e))
    except _BaseException:
        text = "<unprintable>"
    return name + ": " + text


def harness(
    nonce,
    code,
    cases,
    _write=os.write,
    _exit=os._exit,
    _exec=exec,
    _compile=compile,
    _len=len,
    _range=range,
    _isinstance=isinstance,
    _describe=_describe,
    _BaseException=BaseException,
    _MemoryError=MemoryError,
    _fd=CHAN_FD,
):
    """Run the job's code, then each case in the same namespace; report once, then exit.

    Everything it needs after the untrusted code starts is bound here as a default argument
    or compiled beforehand: code that patches builtins or modules (`builtins.len = ...`,
    `os.write = ...`, `import __main__; __main__.CHAN_FD = 1`) cannot change how results are
    counted or written. What it cannot stop: code that reads this frame (`nonce` is a local;
    `sys._getframe(1).f_locals`, gc, ctypes) and writes its own report (see sandbox.py).
    """
    import builtins

    compiled = []
    for i in _range(_len(cases)):
        try:
            compiled.append(_compile(cases[i], f"<test case {i}>", "exec"))
        except _BaseException as e:
            compiled.append(e)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    bits = []
    oom = False
    error = ""
    try:
        _exec(_compile(code, "<solution>", "exec"), namespace)
        loaded = True
    except _BaseException as e:
        loaded = False
        oom = _isinstance(e, _MemoryError)
        error = "while loading the code: " + _describe(e)
    for i in _range(_len(compiled)):
        ok = False
        case = compiled[i]
        if loaded and _isinstance(case, _BaseException):
            error = error or f"test case {i} does not compile: " + _describe(case)
        elif loaded:
            try:
                _exec(case, namespace)
                ok = True
            except _BaseException as e:
                oom = oom or _isinstance(e, _MemoryError)
                error = error or f"test case {i}: " + _describe(e)
        bits.append("1" if ok else "0")
    error = error.replace("\t", " ").replace("\n", " ")[:500]
    line = nonce + "\tresult\t" + "".join(bits) + "\t" + ("1" if oom else "0") + "\t" + error + "\n"
    try:
        _write(_fd, line.encode("utf-8", "backslashreplace"))
    except _BaseException:
        _exit(SETUP_FAILED + 1)
    _exit(0)


def read_report(chan: int, nonce: str) -> str | None:
    """The child's last line that carries the nonce, without the nonce; None if none."""
    size = os.fstat(chan).st_size
    data = os.pread(chan, REPORT_MAX, max(0, size - REPORT_MAX)).decode("utf-8", "replace")
    found = None
    for line in data.splitlines():
        if line.startswith(nonce + "\t"):
            found = line[len(nonce) + 1 :]
    return found


def _children() -> list[int]:
    # /proc/<pid>/task/<tid>/children needs CONFIG_PROC_CHILDREN, which not every kernel has;
    # the parent pid in /proc/<pid>/stat always works (few entries inside a pid namespace).
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
    """Kill every process the child left behind, including ones that left its group.

    The reaper is a child subreaper, so orphans of the job (daemonized, setsid, double fork)
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


def reap(pid: int, deadline: float) -> tuple[int, object, bool]:
    """Wait for the child until `deadline`, kill it when it runs over, then its leftovers."""
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
    timed_out = not ready
    # The child's group either way: after a normal exit it holds only background processes.
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status, usage = os.wait4(pid, 0)
    os.close(pidfd)
    kill_descendants()
    return status, usage, timed_out


def main() -> None:
    # marshal, not json: it is built in (json's import costs several ms per run), and the
    # payload comes from the service, which is trusted. The record going back is plain text,
    # because the service must never unmarshal bytes a run could have touched.
    payload = marshal.loads(sys.stdin.buffer.read())
    # The payload carries the nonce: nothing the child inherits may still read it.
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    nonce = payload["nonce"]
    result_fd = payload["result_fd"]
    try:
        uid, gid = payload["uid"], payload["gid"]
        workdir = payload["workdir"]
        if payload["mounts"] is not None:
            workdir = setup_mounts(payload["mounts"], uid, gid)
        _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
        chan = os.memfd_create("hotloop-report")
        deadline = time.monotonic() + payload["wall_seconds"]
        pid = os.fork()
        if pid == 0:
            os.close(result_fd)  # the child never holds the channel the service trusts
            child(payload, chan, workdir)
        status, usage, timed_out = reap(pid, deadline)
        report = read_report(chan, nonce) or ""
        fields = [
            "record", str(os.waitstatus_to_exitcode(status)), "1" if timed_out else "0",
            f"{usage.ru_utime + usage.ru_stime:.6f}", str(usage.ru_maxrss), report,
        ]
    except Exception as e:  # a launcher bug or a host refusal: reported as an error record
        import traceback

        detail = f"{type(e).__name__}: {e} | " + traceback.format_exc().replace("\n", " | ")
        fields = ["launcher_error", detail.replace("\t", " ")]
    os.write(result_fd, (nonce + "\t" + "\t".join(fields) + "\n").encode("utf-8", "backslashreplace"))


main()
