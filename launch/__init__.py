"""Starting and running hotloop's processes on one machine, for the CLI, the demos and the
benchmarks alike: child processes and signals, the NATS server, the mesh (`hotloop up`), the
online stack, the table of every config section, and what a job needs before it runs.

Sits above the library and the services (it starts services, and reads their config models)
and below `apps/` and `benchmarks/`: it names neither (tests/hotloop/test_layering.py).
"""
