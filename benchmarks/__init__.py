"""Every `hotloop bench <name>`: one module a benchmark, and `common.py`, the run/stop/report
tail they share.

A benchmark measures against a baseline taken in the same run and reports ratios. It may
import the library, the services, `launch/` (the mesh, processes) and `measure/` (the
simulated users, traces), never the applications (`apps/`): a command it runs as a process is
`launch.processes.hotloop_command()`. Nothing but the CLI imports a benchmark
(tests/hotloop/test_layering.py).
"""
