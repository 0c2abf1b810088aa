"""Fixtures of the reward tests: a sandbox at the strongest isolation this host allows."""

from __future__ import annotations

import pytest

from services.reward.config import SandboxConfig
from services.reward.sandbox import IsolationUnavailable, Sandbox

# Small limits keep the hostile cases fast; they are what the containment tests push against.
LIMITS = dict(wall_seconds=3.0, cpu_seconds=2, memory_mb=256, file_size_mb=4, max_processes=16)


@pytest.fixture(scope="session")
def full_sandbox():
    """A `full` sandbox; tests that need it skip (loudly, with the host's reason) elsewhere.

    `test_detection_on_a_capable_host` fails instead of skipping when this host should
    have given `full`, so a broken detection cannot hide behind these skips.
    """
    try:
        sb = Sandbox(SandboxConfig(isolation="full", **LIMITS))
    except IsolationUnavailable as e:
        pytest.skip(f"this host cannot give full isolation: {e}")
    yield sb
    sb.close()


@pytest.fixture(scope="session")
def short_sandbox():
    """Like `full_sandbox` with a 1 s wall clock and CPU limit, for the tests that time out."""
    try:
        sb = Sandbox(SandboxConfig(isolation="full", **{**LIMITS, "wall_seconds": 1.0, "cpu_seconds": 1}))
    except IsolationUnavailable as e:
        pytest.skip(f"this host cannot give full isolation: {e}")
    yield sb
    sb.close()
