"""`hotloop.threads`: CPU lists, and pinning every thread of a process (in a child process, so
the test runner keeps its cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hotloop.threads import bound_cores, parse_cpus

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_lists_parse_like_taskset():
    assert parse_cpus("1") == {1}
    assert parse_cpus("0,2-4") == {0, 2, 3, 4}
    assert parse_cpus(" 3 , 1 ") == {1, 3}
    assert bound_cores("auto") is None and bound_cores("nobind") is None
    assert bound_cores("0-1|4") == {0, 1, 4}  # vLLM's per-rank lists
    for bad in ("", "a", "3-1", "-1", "1-x", ","):
        with pytest.raises(ValueError, match="bad CPU list"):
            parse_cpus(bad)


CHILD = """
import json, os, threading
before = threading.Thread(target=lambda: ev.wait()); ev = threading.Event(); before.start()
from hotloop.threads import pin_threads
cpu = max(os.sched_getaffinity(0))
got = pin_threads(f"{cpu},9999")  # a CPU this process may not use is left out
after = {}
t = threading.Thread(target=lambda: after.update(a=sorted(os.sched_getaffinity(0)))); t.start(); t.join()
tasks = {int(x): sorted(os.sched_getaffinity(int(x))) for x in os.listdir("/proc/self/task")}
ev.set()
try:
    pin_threads("9999")
    refused = ""
except ValueError as e:
    refused = str(e)
print(json.dumps({"cpu": cpu, "got": sorted(got), "after": after["a"], "tasks": list(tasks.values()),
                  "refused": refused}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity is Linux's")
def test_pinning_covers_threads_started_before_and_after_and_refuses_foreign_cpus():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=REPO,
                         timeout=60, check=True).stdout
    res = json.loads(out)
    assert res["got"] == [res["cpu"]] and res["after"] == [res["cpu"]]
    assert len(res["tasks"]) >= 2 and all(t == [res["cpu"]] for t in res["tasks"])
    assert "names none of the CPUs" in res["refused"]


PINNED = """
import json, os, subprocess, sys
from hotloop.threads import pinned
own = sorted(os.sched_getaffinity(0))
with pinned(str(own[0])):
    inside = sorted(os.sched_getaffinity(0))
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, check=True).stdout.strip()
print(json.dumps({"own": own, "inside": inside, "child": child, "after": sorted(os.sched_getaffinity(0))}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity is Linux's")
def test_a_process_started_while_pinned_keeps_the_cores_and_the_caller_gets_its_own_back():
    """How the rollout starts vLLM's engine core beside its worker's cores."""
    out = subprocess.run([sys.executable, "-c", PINNED], capture_output=True, text=True, cwd=REPO,
                         timeout=60, check=True).stdout
    res = json.loads(out)
    assert res["inside"] == res["own"][:1] and res["child"] == str(res["own"][:1])
    assert res["after"] == res["own"]
