"""The applications: the `hotloop` command line, `hotloop up` (the local mesh launcher), the
demos, the user simulator, training and evaluation jobs, and trace budgets.

They import the library (`hotloop`) and the services; nothing in `hotloop/` or `services/`
imports them (tests/hotloop/test_layering.py). The benchmarks (`benchmarks/`) use the launcher
and the simulator; only the CLI names the benchmarks.
"""
