"""Every `hotloop bench <name>`: one module a benchmark, and `common.py`, the run/stop/report
tail they share.

A benchmark measures against a baseline taken in the same run and reports ratios. It may
import the library, the services and the applications (the launcher, the simulator); nothing
but the CLI imports a benchmark (tests/hotloop/test_layering.py).
"""
