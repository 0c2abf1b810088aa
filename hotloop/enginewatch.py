"""vLLM engine processes die with the process that started them, even when it is SIGKILLed.

Owns: a vLLM general plugin (entry point group `vllm.general_plugins`, see pyproject.toml).
vLLM calls `vllm.plugins.load_general_plugins()` once in every process it runs in, including
the EngineCore process and each worker process. There, when the process that builds engines
armed it (`arm()`, which sets HOTLOOP_ENGINE_PDEATHSIG=1, inherited by the engine processes),
`register()` asks the kernel to SIGKILL this process when its parent dies
(`prctl(PR_SET_PDEATHSIG, SIGKILL)`), and exits at once if the parent is already gone. Without
it, `kill -9` of a rollout service or a benchmark leaves EngineCore and VLLM::Worker processes
running with the model in memory and OpenMP threads bound to the cores. In every engine
process, armed or not, it also arms `hotloop.quickexit`: an engine's shutdown took ~5 s, most
of it two interpreters sweeping vLLM's heap at exit.

Scope: only processes started through `multiprocessing` (vLLM's engine core and workers) act;
the parent is `multiprocessing.parent_process()`, so the env var leaking into unrelated
processes (a launcher's services, subprocesses) changes nothing for them. Linux only (prctl);
elsewhere it does nothing.

Caveat: PDEATHSIG fires when the parent *thread* that created the child exits, not the parent
process. vLLM creates its EngineCore process in the thread that builds the `AsyncLLM` / `LLM`
(the main thread in `python -m services.rollout`, the benchmarks and the tests) and its workers
in the EngineCore's main thread. Building an engine in a short-lived thread (e.g. inside
`asyncio.to_thread`) would kill the engine when that thread ends: do not.
"""

from __future__ import annotations

import os

from hotloop import quickexit

ENV = "HOTLOOP_ENGINE_PDEATHSIG"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def arm() -> None:
    """Call before building a vLLM engine: its processes will die with this one."""
    os.environ[ENV] = "1"


def register() -> None:
    """The vLLM general plugin: runs in every vLLM process. In an engine process: a quick exit
    (`hotloop.quickexit`), and, when armed, death with the parent."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return  # not an engine process: the process that builds engines, or unrelated
    quickexit.arm()  # its exit skips the last sweep of the heap (hotloop/quickexit.py)
    if os.environ.get(ENV) != "1" or not os.uname().sysname == "Linux":
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died before prctl: then this process was already reparented (to
    # init or a subreaper) and the signal will never come.
    if os.getppid() != parent.pid:
        os._exit(1)
