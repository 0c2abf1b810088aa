"""A reward scorer for fault tests (`[reward] scorers = ["python:tests.faults.gated_scorer:score"]`),
imported by the reward service's own process.

While the file `$HOTLOOP_TEST_GATE/hold` exists, a call first leaves `scoring-<pid>` in that
directory and then waits (up to a minute) for the file to go: a test learns that this reward
process is in the middle of a call and kills it there, with no race against its speed. The
reward itself is a deterministic function of the text, so groups of random completions differ.
"""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path


def score(item) -> float:
    gate = os.environ.get("HOTLOOP_TEST_GATE")
    if gate and (hold := Path(gate) / "hold").exists():
        (Path(gate) / f"scoring-{os.getpid()}").touch()
        deadline = time.monotonic() + 60
        while hold.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return float(zlib.crc32(item.completion.encode()) % 2)
