"""The program every sandbox worker executes: `python -I -S -c <this source>`.

Owns the inside of a worker: reading its setup and then jobs from stdin, the mount setup of the
namespace levels (once per worker), forking one child per job that makes its own private
mounts, drops privileges and runs the untrusted code, reaping it and everything it left, and
writing one record per job to stdout. It is passed as source text (not a path) so that it
works when the service's directories are hidden from the sandbox, and it imports only the
standard library because `-S` leaves site-packages off the path.

Does not own: choosing the isolation or whether a worker serves one job or many (`sandbox.py`
decides: it closes stdin after the first job when the code would run as the worker's own uid),
classifying outcomes (the service reads the record), or anything after the run.

Two kinds of process, with different trust:
- the worker (this process): trusted, keeps the privileges it started with (root inside the
  namespaces when the host allows), never runs job code and never unmarshals a job: it reads
  each job's bytes into a buffer, forks, and zeroes the buffer, so no earlier job's code or
  tests are in the memory a later child inherits. After each child it waits with a deadline,
  collects its exit status and CPU time, kills every process the job left, and writes the
  record to stdout, which no child holds.
- the child: joins the run's cgroups, makes its own mount and IPC namespaces with fresh private
  tmpfs (namespace levels), closes every fd but stdio (memfds of this run) and its report
  channel, sets rlimits, drops to the sandbox uid, sets no_new_privs, then runs the harness:
  the job's code, then each test case. Its report is one line, prefixed with the run's nonce,
  written to a memfd only after all cases ran ("written last"), so no partial report is ever
  visible to the code under test.

Wire format (both directions length-framed, so no byte of a run's output is ever parsed as
structure): setup = 8-byte length + marshal; job = b"J" + nonce (32 ascii) + 8-byte length +
marshal; record = one text header line `nonce \t kind \t fields...` and then the blobs whose
byte counts are the header's last fields.
"""

import ctypes
import marshal
import os
import resource
import select
import signal
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
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

CHAN_FD = 3  # the child's report channel is always fd 3, below any RLIMIT_NOFILE
SETUP_FAILED = 125
REPORT_MAX = 4 << 20  # the worker reads at most this much of the child's channel
VALUE_MAX = 256 << 10  # one strictly encoded value
VALUES_MAX = 2 << 20  # all of a run's values together (the report must stay under REPORT_MAX)
VALUE_DEPTH = 100  # nesting of one value (the trusted decoder recurses this deep)
NONCE_LEN = 32

# Imported once per worker, before any job: every child of the worker starts with them in
# sys.modules, so the code's `import math` is a dictionary lookup instead of a file read.
# Each child gets a copy-on-write copy; nothing a run does to them reaches the worker or a
# later run. `random` reseeds itself in every forked child (os.register_at_fork).
PREIMPORT = (
    "math", "re", "collections", "itertools", "functools", "string", "typing", "heapq",
    "bisect", "operator", "random", "fractions", "decimal", "statistics", "copy", "hashlib",
    "json", "dataclasses", "socket", "datetime",
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


def setup_mounts(m: dict) -> None:
    """Make the worker's filesystem view, once: hidden directories, a read-only root.

    Runs in the worker's own mount namespace (made by unshare), so nothing here is visible to
    the host. Order matters: the interpreter's prefix is bind-mounted aside before the
    directories that contain it are hidden, then put back read-only inside the hiding tmpfs.
    The writable directories are not made here but per run (`private_mounts`).
    """
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=700")  # staging only
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
    # The root filesystem read-only (in this namespace only): whatever world-writable directory
    # the host has that is not in the private list, no run can write to it.
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | _statvfs_flags("/"))


def private_mounts(m: dict, uid, gid) -> str:
    """In the child, before it drops privileges: its own mount and IPC namespaces with fresh,
    empty tmpfs on every writable directory; returns the working directory.

    Made per run, not per worker, so nothing a run writes (files in /tmp, /dev/shm, SysV or
    POSIX IPC objects) is there for the next run of the same worker: the namespaces, and the
    tmpfs with them, go away when the run's last process exits.
    """
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare(mount, ipc)")
    tmpfs = f"size={m['tmpfs_bytes']},nr_inodes={m['tmpfs_inodes']},mode=1777"
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    for path in m["private"]:
        if os.path.isdir(path) and not os.path.islink(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    workdir = "/tmp/work"
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, gid)
    return workdir


def child(setup: dict, job: dict, chan: int, out: int, err: int, workdir: str) -> None:
    """Set up the child's limits and identity, then run the harness. Never returns."""
    nonce = job["nonce"]
    try:
        os.setpgid(0, 0)  # its own group, so the worker can kill its descendants in one call
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        for procs in job["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write("0")  # cgroup v1: 0 means the writing process
        uid, gid = setup["uid"], setup["gid"]
        if setup["mounts"] is not None:
            workdir = private_mounts(setup["mounts"], uid, gid)
        os.chdir(workdir)
        # stdin: nothing (the worker's stdin carries the service's jobs); stdout and stderr:
        # this run's memfds; fd 3: the report channel. Nothing else of the worker stays open.
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.dup2(chan, CHAN_FD)
        os.closerange(CHAN_FD + 1, 1 << 16)
        lim = setup["limits"]
        rl = resource.setrlimit
        rl(resource.RLIMIT_CPU, (lim["cpu_seconds"], lim["cpu_seconds"] + 1))
        rl(resource.RLIMIT_AS, (lim["address_space_bytes"], lim["address_space_bytes"]))
        rl(resource.RLIMIT_FSIZE, (lim["file_size_bytes"], lim["file_size_bytes"]))
        rl(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
        rl(resource.RLIMIT_CORE, (0, 0))
        if lim.get("nproc") is not None:
            # Only meaningful for a dedicated uid: the count is per user, and root ignores it.
            rl(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
        if uid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        # No setuid binary can hand the run its privileges back.
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        code, cases, kinds = job["code"], job["cases"], job["kinds"]
        del job, setup
    except BaseException as e:  # report setup failures as such: they are the host's fault
        msg = (nonce + "\tsetup\t" + type(e).__name__ + ": " + str(e) + "\n").encode()
        os.write(chan, msg)
        os._exit(SETUP_FAILED)
    harness(nonce, code, cases, kinds)


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


def encode_value(
    value,
    limit,
    _type=type,
    _none=type(None),
    _bool=bool,
    _int=int,
    _float=float,
    _str=str,
    _bytes=bytes,
    _list=list,
    _tuple=tuple,
    _dict=dict,
    _set=set,
    _frozenset=frozenset,
    _srepr=str.__repr__,
    _brepr=bytes.__repr__,
    _ifmt=int.__format__,
    _fhex=float.hex,
    _len=len,
    _append=list.append,
    _pop=list.pop,
    _items=dict.items,
    _join=str.join,
    _plain=str.__str__,
    _range=range,
    _depth=VALUE_DEPTH,
):
    """A plain-data value as a flat, `ast.literal_eval`-able token list; (text, "") or
    ("", why it is not plain data).

    Exact types only (`type(v) is int`, never isinstance): a subclass of int, str or list,
    or any other class, is refused, so no `__eq__`, `__hash__` or `__repr__` of the code's
    making ever reaches the trusted comparison. Nothing here calls a method of the value:
    every operation is a builtin bound at definition time on an exact builtin type, so no
    code of the run executes while its value is encoded. Prefix notation with counts (a list
    is `'l', n` then its n items) keeps the text one bracket deep at any nesting.
    """
    out = []
    size = 0
    stack = [(value, 0)]
    while stack:
        v, depth = _pop(stack)
        if depth > _depth:
            return "", f"nested deeper than {_depth} levels"
        t = _type(v)
        if t is _none:
            tok = "'N'"
        elif t is _bool:
            tok = "'T'" if v is True else "'F'"
        elif t is _int:
            tok = "'i', " + _srepr(_ifmt(v, "x"))  # hex: no int/str digit limit
        elif t is _float:
            tok = "'f', " + _srepr(_fhex(v))  # exact, including nan, inf and -0.0
        elif t is _str:
            tok = "'s', " + _srepr(v)
        elif t is _bytes:
            tok = "'y', " + _brepr(v)
        elif t is _list or t is _tuple:
            items = _list(v) if t is _tuple else v[:]  # a snapshot: nothing can change it now
            tok = ("'l', " if t is _list else "'t', ") + _ifmt(_len(items), "d")
            for i in _range(_len(items) - 1, -1, -1):
                _append(stack, (items[i], depth + 1))
        elif t is _dict:
            pairs = _list(_items(v))
            tok = "'d', " + _ifmt(_len(pairs), "d")
            for i in _range(_len(pairs) - 1, -1, -1):
                _append(stack, (pairs[i][1], depth + 1))
                _append(stack, (pairs[i][0], depth + 1))
        elif t is _set or t is _frozenset:
            items = _list(v)
            tok = ("'S', " if t is _set else "'Z', ") + _ifmt(_len(items), "d")
            for i in _range(_len(items) - 1, -1, -1):
                _append(stack, (items[i], depth + 1))
        else:
            try:
                name = _plain(t.__module__) + "." + _plain(t.__qualname__)
            except BaseException:
                name = "<unnamed type>"
            return "", f"a {name} is not plain data (only None, bool, int, float, str, bytes, " \
                       "list, tuple, dict, set of those, exact types, no subclasses)"
        size += _len(tok) + 2
        if size > limit:
            return "", f"the encoded value is larger than {limit} bytes"
        _append(out, tok)
    return "[" + _join(", ", out) + "]", ""


def harness(
    nonce,
    code,
    cases,
    kinds,
    _write=os.write,
    _exit=os._exit,
    _exec=exec,
    _eval=eval,
    _compile=compile,
    _len=len,
    _range=range,
    _min=min,
    _isinstance=isinstance,
    _describe=_describe,
    _encode=encode_value,
    _BaseException=BaseException,
    _MemoryError=MemoryError,
    _fd=CHAN_FD,
    _value_max=VALUE_MAX,
    _values_max=VALUES_MAX,
):
    """Run the job's code, then each case in the same namespace; report once, then exit.

    A case of kind "x" passes when it runs without raising. A case of kind "e" is an
    expression: its value is encoded strictly (`encode_value`) and sent out, and the service
    compares it with the expected value in its own process; here it "passes" when it has a
    value that could be encoded.

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
            compiled.append(_compile(cases[i], f"<test case {i}>", "eval" if kinds[i] == "e" else "exec"))
        except _BaseException as e:
            compiled.append(e)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    bits = []
    values = []
    budget = _values_max
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
        value = ""
        case = compiled[i]
        if loaded and _isinstance(case, _BaseException):
            error = error or f"test case {i} does not compile: " + _describe(case)
        elif loaded and kinds[i] == "e":
            try:
                text, why = _encode(_eval(case, namespace), _min(_value_max, budget))
                if why:
                    value = "!" + why
                else:
                    value = "=" + text
                    budget -= _len(text)
                    ok = True
            except _BaseException as e:
                oom = oom or _isinstance(e, _MemoryError)
                error = error or f"test case {i}: " + _describe(e)
        elif loaded:
            try:
                _exec(case, namespace)
                ok = True
            except _BaseException as e:
                oom = oom or _isinstance(e, _MemoryError)
                error = error or f"test case {i}: " + _describe(e)
        bits.append("1" if ok else "0")
        values.append(value.replace("\t", " ").replace("\n", " "))
    error = error.replace("\t", " ").replace("\n", " ").replace("\r", " ")[:500]
    # Values (reprs: no raw tab or newline in them) before the error, which ends the line.
    fields = [nonce, "result", "".join(bits), "1" if oom else "0"] + values + [error]
    line = "\t".join(fields) + "\n"
    try:
        _write(_fd, line.encode("utf-8", "backslashreplace"))
    except _BaseException:
        _exit(SETUP_FAILED + 1)
    _exit(0)


def read_report(chan: int, nonce: str) -> bytes:
    """The child's last line that carries the nonce, without the nonce; b"" if none.

    Split on "\\n" only: other line breaks (\\x0c, \\u2028) may legitimately occur inside
    the error text."""
    size = os.fstat(chan).st_size
    data = os.pread(chan, REPORT_MAX, max(0, size - REPORT_MAX))
    found = b""
    prefix = nonce.encode() + b"\t"
    for line in data.split(b"\n"):
        if line.startswith(prefix):
            found = line[len(prefix):]
    return found


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
    """Kill every process the child left behind, including ones that left its group.

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


def reap(pid: int, deadline: float) -> tuple[int, object, bool]:
    """Wait for the child until `deadline`, kill it when it runs over; its status and usage."""
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
    return status, usage, timed_out


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


def _send(kind: str, nonce: str, fields: list, blobs: list) -> None:
    head = "\t".join([nonce, kind, *fields, *(str(len(b)) for b in blobs)]) + "\n"
    data = head.encode() + b"".join(blobs)
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def run_job(setup: dict, nonce: str, body: bytearray, pidns: bool) -> None:
    """Fork the child for one job, reap it and whatever it left, send the record."""
    workdir = ""
    chan = out = err = -1
    try:
        chan = os.memfd_create("hotloop-report")
        out = os.memfd_create("hotloop-stdout")
        err = os.memfd_create("hotloop-stderr")
        if setup["mounts"] is None:
            # No mount namespace: a fresh directory on the host, only the run's uid may enter.
            workdir = os.path.join(setup["work_root"], f"hotloop-sbx-run-{nonce[:16]}")
            os.mkdir(workdir, 0o700)
            if setup["uid"] is not None:
                os.chown(workdir, setup["uid"], setup["gid"])
        deadline = time.monotonic() + setup["wall_seconds"]
        pid = os.fork()
        if pid == 0:
            try:
                job = marshal.loads(body)
                job["nonce"] = nonce
            except BaseException as e:
                os.write(chan, (nonce + "\tsetup\tbad job: " + repr(e) + "\n").encode())
                os._exit(SETUP_FAILED)
            child(setup, job, chan, out, err, workdir)
            os._exit(SETUP_FAILED)  # not reached: child() ends in _exit
        body[:] = bytes(len(body))  # the job stays out of what later children inherit
        status, usage, timed_out = reap(pid, deadline)
        if pidns:
            kill_namespace()
        else:
            kill_descendants()
        report = read_report(chan, nonce)
        tail = setup["tail_bytes"]
        fields = [str(os.waitstatus_to_exitcode(status)), "1" if timed_out else "0",
                  f"{usage.ru_utime + usage.ru_stime:.6f}", str(usage.ru_maxrss)]
        _send("record", nonce, fields, [_tail(out, tail), _tail(err, tail), report])
    finally:
        for fd in (chan, out, err):
            if fd >= 0:
                os.close(fd)
        if workdir:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    # marshal, not json: it is built in, and the setup and jobs come from the service, which
    # is trusted. The records going back are text and raw blobs with byte counts, because the
    # service must never unmarshal bytes a run could have touched.
    head = _read_exact(0, 8)
    setup = marshal.loads(_read_exact(0, int.from_bytes(head, "little")))
    nonce = "-" * NONCE_LEN
    try:
        if setup["mounts"] is not None:
            setup_mounts(setup["mounts"])
        _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
        # Not dumpable: /proc/<this>/mem and ptrace need CAP_SYS_PTRACE, whatever the uid.
        _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")
        pidns = setup["mounts"] is not None and os.getpid() == 1
        for name in PREIMPORT if setup["preimport"] else ():
            __import__(name)
        while True:
            head = _read_exact(0, 1 + NONCE_LEN + 8)
            if head is None:
                return  # the service closed the pipe: no more jobs
            if head[:1] != b"J":
                raise ValueError(f"bad job frame {bytes(head[:1])!r}")
            nonce = head[1 : 1 + NONCE_LEN].decode("ascii")
            body = _read_exact(0, int.from_bytes(head[1 + NONCE_LEN :], "little"))
            run_job(setup, nonce, body, pidns)
            del body
    except Exception as e:  # a launcher bug or a host refusal: reported as an error record
        import traceback

        detail = f"{type(e).__name__}: {e} | " + traceback.format_exc().replace("\n", " | ")
        _send("launcher_error", nonce, [], [detail.encode("utf-8", "backslashreplace")])


main()
