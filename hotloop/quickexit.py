"""A quick exit for processes that hold vLLM's and torch's module graph.

At exit the interpreter's final collections walk every object still alive; in a process that
imported vLLM and torch that is millions of objects, and the walk took 1.5-2.6 s on 2 cores
(py-spy: `gc_collect_main`, with no Python frame left) after everything the process had to do
was done. Every engine shutdown paid it twice (the EngineCore and its worker: ~5 s, where
vLLM's process manager gave up and SIGKILLed the EngineCore), every service's stop once more.

`arm()` registers an exit handler that freezes the heap (`gc.freeze`): the final collections
then leave those objects alone, and their memory goes back to the kernel with the process,
as it would anyway. Handlers run last-registered first, so armed early (as `hotloop.service`
and the CLI do, before the heavy imports register theirs) it runs after every other cleanup;
armed late (an engine process, `hotloop.enginewatch`), after those registered since, vLLM's
teardown included. It also points stderr at /dev/null, since what is left to say there is
the extension modules' report of the objects now never freed (Triton's nanobind bindings
list hundreds at every exit); a traceback of an uncaught error is printed before exit
handlers run, and the exit status is the process's own.

Does not own: what a process cleans up before it exits (its own shutdown paths).
"""

from __future__ import annotations

import os
import sys

_armed = False


def arm() -> None:
    """Register the quick exit (once per process)."""
    global _armed
    if _armed:
        return
    import atexit

    atexit.register(_freeze)
    _armed = True


def _freeze() -> None:
    import gc

    gc.freeze()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced
            pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
