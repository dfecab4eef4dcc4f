"""Reading pyzero's settings from environment variables, with one wording for bad values.

Every ``PYZERO_*`` integer, flag or time a module reads goes through these, so a bad value gets the
same error wherever it is read: the variable, its value and what was expected. An unset or
blank variable means the default.
"""
from __future__ import annotations

import math
import os
import re

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _raw(name: str, environ) -> str | None:
    raw = (os.environ if environ is None else environ).get(name)
    return None if raw is None or not raw.strip() else raw


def env_int(name: str, default: int, *, kib: bool = False, environ=None) -> int:
    """Non-negative integer `name` (in KiB, returned in bytes, when `kib`), else `default`.

    ValueError naming the variable and its value for anything else (a sign, a fraction, a unit).
    """
    raw = _raw(name, environ)
    if raw is None:
        return default
    expected = "expected a non-negative integer" + (" (KiB)" if kib else "")
    if not re.fullmatch(r"\s*[0-9]+\s*", raw):  # (int() also takes "1_000" and "+5")
        raise ValueError(f"{name}={raw!r}: {expected}")
    v = int(raw)
    return v << 10 if kib else v


def env_seconds(name: str, default: float, *, environ=None) -> float:
    """Non-negative, finite number of seconds `name`, else `default`; ValueError naming it otherwise."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not 0 <= v < math.inf:
        raise ValueError(f"{name}={raw!r}: expected a non-negative number of seconds")
    return v


def env_bool(name: str, default: bool, *, environ=None) -> bool:
    """Flag `name`: 1/true/yes/on or 0/false/no/off (any case), else `default` when unset."""
    raw = _raw(name, environ)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of {list(_TRUE + _FALSE)}")
