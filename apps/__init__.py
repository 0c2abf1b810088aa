"""The applications: the `hotloop` command line, and the commands' bodies that are not a
benchmark: `hotloop up`'s front, the demos, `hotloop simulate users`, training and evaluation
jobs, trace budgets, the tenant audit.

They stand on `launch/` (processes, the mesh, config sections), `measure/` (simulated users,
traces), the services and the library; nothing below them imports them, and the benchmarks
(`benchmarks/`) do not either: only the CLI names the benchmarks (tests/hotloop/test_layering.py).
"""
