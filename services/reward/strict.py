"""Values that leave the sandbox, decoded in the trusted process: plain data only.

Owns: `decode(text)`, the inverse of `_launcher.encode_value` (a flat `ast.literal_eval`-able
token list in prefix notation); `is_plain(value)`, the same type rule applied to a test's
expected value; `Returned`, what a value case produced. Does not own: which test cases are
compared this way (`scorers.py`) or running anything (`sandbox.py`).

Why: `assert f(x) == y` run inside the sandbox asks the code's own object whether it equals
`y`, so an object whose `__eq__` always returns True passes every case. Decoded here, a value
is built from exact builtin types by this module, so `==` on it is Python's own comparison of
plain data (1 == 1.0 == True, nan != nan, -0.0 == 0.0, [1] != (1,)), never code of the run.
The text comes from an untrusted process: anything malformed is a `ValueError`, never
anything else, and nothing in it is executed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

MAX_DEPTH = 101  # one more than the encoder's own bound, which counts from 0
_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes)


@dataclass(frozen=True)
class Returned:
    """What a value case produced: a plain value, or why there is none."""

    value: object = None
    refused: str = ""
    """Empty when `value` is the case's value; else why it could not be sent out strictly
    (not plain data, too large, too deep) or read back (malformed)."""
    raised: bool = False
    """The expression raised (or never ran: the code did not load); the run's error says how."""


def is_plain(value, depth: int = 0) -> bool:
    """True when `value` is plain data of exact builtin types (what `decode` can return)."""
    if depth > MAX_DEPTH:
        return False
    t = type(value)
    if t in _PLAIN_LEAVES:
        return True
    if t in (list, tuple, set, frozenset):
        return all(is_plain(v, depth + 1) for v in value)
    if t is dict:
        return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in value.items())
    return False


def decode(text: str):
    """The value `_launcher.encode_value` encoded as `text`; ValueError when malformed."""
    try:
        tokens = ast.literal_eval(text)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(f"not a token list: {type(e).__name__}") from None
    if type(tokens) is not list:
        raise ValueError("not a token list")
    pos = 0

    def take():
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError("token list ends early")
        pos += 1
        return tokens[pos - 1]

    def count() -> int:
        n = take()
        if type(n) is not int or n < 0 or n > len(tokens):
            raise ValueError(f"bad item count {n!r}")
        return n

    def text_of(t):
        v = take()
        if type(v) is not t:
            raise ValueError(f"expected a {t.__name__} payload, got {type(v).__name__}")
        return v

    def value(depth: int):
        if depth > MAX_DEPTH:
            raise ValueError("nested too deeply")
        tag = take()
        if tag == "N":
            return None
        if tag == "T":
            return True
        if tag == "F":
            return False
        if tag == "i":
            digits = text_of(str)
            if not digits.lstrip("-") or not all(c in "0123456789abcdef" for c in digits.lstrip("-")):
                raise ValueError(f"bad int {digits[:40]!r}")
            return int(digits, 16)
        if tag == "f":
            try:
                return float.fromhex(text_of(str))
            except OverflowError:
                raise ValueError("float out of range") from None
        if tag == "s":
            return text_of(str)
        if tag == "y":
            return text_of(bytes)
        if tag in ("l", "t"):
            items = [value(depth + 1) for _ in range(count())]
            return items if tag == "l" else tuple(items)
        if tag in ("S", "Z"):
            items = [value(depth + 1) for _ in range(count())]
            try:
                return set(items) if tag == "S" else frozenset(items)
            except TypeError:
                raise ValueError("unhashable set element") from None
        if tag == "d":
            out = {}
            for _ in range(count()):
                k = value(depth + 1)
                try:
                    out[k] = value(depth + 1)
                except TypeError:
                    raise ValueError("unhashable dict key") from None
            return out
        raise ValueError(f"unknown tag {str(tag)[:20]!r}")

    result = value(0)
    if pos != len(tokens):
        raise ValueError("trailing tokens")
    return result
