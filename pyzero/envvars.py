"""Reading pyzero's settings from environment variables, with one wording for bad values.

Every ``PYZERO_*`` integer, flag or time a module reads goes through these, so a bad value gets the
same error wherever it is read: the variable, its value and what was expected. An unset or
blank variable means the default.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import warnings

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


# Every PYZERO_* variable pyzero, its build and its scripts read (tests/test_options.py checks that the
# sources name no other): pz.init warns about any other one set, a typo's setting being ignored.
KNOWN = frozenset({
    "PYZERO_FLIGHT", "PYZERO_FLIGHT_WAIT", "PYZERO_TRACE", "PYZERO_HOST", "PYZERO_SYMMETRIC", "PYZERO_HIER_CHECK",
    "PYZERO_PS_KEY", "PYZERO_PS_HOST", "PYZERO_SHM_DEPTH", "PYZERO_SHM_SLICE_KB", "PYZERO_SHM_ONESHOT_KB",
    "PYZERO_SHM_TWOSHOT_KB", "PYZERO_SHM_ADAPTIVE", "PYZERO_SHM_TWOSHOT_STREAM_KB", "PYZERO_SHM_STREAM_KB",
    "PYZERO_NCCL_ROOT", "PYZERO_NCCL_BLOCKING_WAIT", "PYZERO_NCCL_SLICE_KB", "PYZERO_NCCL_ONESHOT_KB",
    "PYZERO_NCCL_HEADERS", "PYZERO_IPC_SYSTEM_SCOPE", "PYZERO_IPC_P2P_KB", "PYZERO_IPC_ONESHOT_KB", "PYZERO_IPC_DEPTH",
    "PYZERO_IPC_AREA_KB", "PYZERO_TORCH_IPC_MAX_KB", "PYZERO_TORCH_CUDA", "PYZERO_TEST_NCCL", "PYZERO_TEST_NCCL_ROOT",
    "PYZERO_TEST_NCCL_TIMEOUT", "PYZERO_TEST_NCCL_KERNEL_TIMEOUT", "PYZERO_TEST_NCCL_BUILD", "PYZERO_CUDA",
    "PYZERO_CUDA_ARCH", "PYZERO_CUDA_ARCHS", "PYZERO_WITH_CUDA", "PYZERO_VENV", "PYZERO_TORCH", "PYZERO_WHEEL_PY",
    "PYZERO_WHEELS", "PYZERO_KEEP", "PYZERO_DEEPSPEED", "PYZERO_CONFORMANCE_LOG",
})


def warn_unknown(environ=None) -> None:
    """A RuntimeWarning for each PYZERO_* variable set that pyzero does not read (a misspelt one's setting
    is ignored), naming the closest known one."""
    env = os.environ if environ is None else environ
    for name in sorted(k for k in env if k.startswith("PYZERO_") and k not in KNOWN):
        close = difflib.get_close_matches(name, KNOWN, n=1)
        warnings.warn(f"{name}: not a pyzero setting, ignored" + (f" (did you mean {close[0]}?)" if close else ""),
                      RuntimeWarning, stacklevel=3)
