"""`parse`: `ast.parse` that several threads of one process may call at once.

CPython 3.11 converts a parse tree to `ast` objects with a recursion counter kept in the
interpreter's state, which every thread shares: two threads converting at once can fail with
`SystemError: AST constructor recursion depth mismatch` (seen in the reward service, whose
sandbox pool parses test cases on its threads while its event loop parses completions). One
lock makes every parse in the process take its turn; a parse of a completion or a test case
takes microseconds to milliseconds. Code run in another process (the sandbox's own) needs none.
"""

from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str, filename: str = "<unknown>", mode: str = "exec") -> ast.AST:
    """`ast.parse(source, filename, mode)`, one thread at a time. Raises what it raises
    (SyntaxError, ValueError for a NUL byte, RecursionError, MemoryError)."""
    with _LOCK:
        return ast.parse(source, filename, mode)
