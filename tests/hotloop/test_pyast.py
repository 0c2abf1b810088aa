"""`hotloop.pyast.parse`: one parse at a time in a process, and the only `ast.parse` the
product code calls (CPython 3.11's parse is not safe in two threads at once: the reward
service's sandbox pool and event loop both parse)."""

from __future__ import annotations

import ast
import re
import threading
from pathlib import Path

import pytest

from hotloop import pyast

ROOT = Path(__file__).resolve().parents[2]
# Product code that runs in the services' processes; the sandbox's own process (`_calls.py`,
# `_launcher.py`) has one thread.
ROOMS = ("hotloop", "services", "launch", "measure", "apps", "benchmarks")
ALLOWED = {"hotloop/pyast.py", "services/reward/_calls.py", "services/reward/_launcher.py"}
CALL = re.compile(r"\bast\.parse\(")


def test_parse_returns_the_tree_and_raises_what_ast_parse_raises():
    tree = pyast.parse("assert f(1) == 2\n")
    assert isinstance(tree, ast.Module) and isinstance(tree.body[0], ast.Assert)
    with pytest.raises(SyntaxError):
        pyast.parse("def (:\n")
    with pytest.raises((SyntaxError, ValueError)):
        pyast.parse("x = 1\0")


def test_parses_in_several_threads_give_every_thread_its_own_tree():
    sources = [f"assert f({i}) == [{i}, ({i}, {{'a': [{i}]}})]\n" * 20 for i in range(8)]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(50):
                got[i] = ast.dump(pyast.parse(sources[i]))
        except BaseException as e:  # a SystemError here is the CPython race
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(got[i] == ast.dump(ast.parse(sources[i])) for i in range(8))


def test_no_product_module_calls_ast_parse_itself():
    found = [f"{p.relative_to(ROOT)}:{n}" for room in ROOMS for p in sorted((ROOT / room).rglob("*.py"))
             if str(p.relative_to(ROOT)) not in ALLOWED and "/proto/" not in str(p)
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if CALL.search(line.split("#", 1)[0])]
    assert not found, f"call hotloop.pyast.parse instead (thread-safe): {found}"


def test_the_scan_finds_a_call():
    assert CALL.search("    tree = ast.parse(case)") and not CALL.search("pyast.parse(case)")
