"""Measuring a running mesh from the users' side, for the demos and the benchmarks alike:
simulated users and their hidden preferences, what the update loop took (`loop`), and where
the time went in trace files (`traces`).

Reaches the mesh over HTTP, NATS and files only: names no service, and nothing of `launch/`,
`apps/` or `benchmarks/` (tests/hotloop/test_layering.py).
"""
