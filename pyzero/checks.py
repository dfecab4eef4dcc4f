"""Argument predicates shared by pyzero's checks; each caller words its own error, naming the argument.

bool is an int subclass in Python, and a flag passed where a count or a number of seconds belongs is a
mistake: these refuse it, as they refuse NaN and the infinities where a finite value is needed."""
from __future__ import annotations

import hashlib
import math


def is_int(v) -> bool:
    """A Python int, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A Python int or float, not a bool (NaN and the infinities included)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_positive_finite(v) -> bool:
    """A real number in (0, inf): a timeout in seconds, a size in MiB."""
    return is_real(v) and 0 < v < math.inf


def check_bool(value, arg: str) -> bool:
    """`value` if it is True or False, else a TypeError naming `arg` (bool("False") is True: a string or a
    number read as a flag would change what it switches without a word)."""
    if not isinstance(value, bool):
        raise TypeError(f"{arg}: expected True or False, got {value!r}")
    return value


def digest(data: bytes, nbytes: int) -> int:
    """A non-negative int of `nbytes` bytes from a cryptographic hash of `data`: what ranks compare to
    agree on something larger (values that differ cannot be made to agree, as under a linear hash)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=nbytes).digest(), "little")
