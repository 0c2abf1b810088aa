"""Decoding values that come out of the sandbox: plain data or ValueError, nothing else.

Round trips through the real encoder run in the sandbox (test_scorers.py); here the decoder
faces text a hostile run could have forged.
"""

from __future__ import annotations

import math

import pytest

from services.reward.strict import decode, is_plain


def test_decodes_every_plain_type():
    text = ("['l', 9, 'N', 'T', 'F', 'i', '-ff', 'f', '0x1.8p+1', 's', 'a\\tb', 'y', b'\\x00', "
            "'t', 1, 'S', 1, 'i', '1', 'd', 1, 'Z', 1, 'i', '2', 'l', 0]")
    assert decode(text) == [None, True, False, -255, 3.0, "a\tb", b"\x00", ({1},), {frozenset({2}): []}]
    assert math.isnan(decode("['f', 'nan']")) and decode("['f', '-inf']") == -math.inf


@pytest.mark.parametrize("text", [
    "",                              # not a literal
    "__import__('os')",              # not a literal: never evaluated
    "('i', '1')",                    # not a list
    "['i', 1]",                      # payload of the wrong type
    "['i', '0x1']", "['i', ' 1']",   # only hex digits
    "['f', '0x1p99999']", "['f', 'x']",
    "['Q']",                         # unknown tag
    "['l', 2, 'N']",                 # ends early
    "['N', 'N']",                    # trailing tokens
    "['l', -1]", "['l', True]",      # bad counts
    "['S', 1, 'l', 0]",              # unhashable set element
    "['d', 1, 'l', 0, 'N']",         # unhashable key
    "[" + "'l', 1, " * 150 + "'N']",  # deeper than the encoder ever sends
])
def test_malformed_text_is_a_value_error(text):
    with pytest.raises(ValueError):
        decode(text)


def test_is_plain_takes_exact_builtin_types_only():
    class I(int):
        pass

    assert is_plain([1, (2.5, "x"), {"k": {b"y"}}, None, True, frozenset()])
    assert not is_plain(I(1)) and not is_plain([I(1)]) and not is_plain(1j) and not is_plain(...)
    assert not is_plain({1: object()})
