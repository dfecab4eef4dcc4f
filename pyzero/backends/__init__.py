"""pyzero's backends, one module each, behind the interface of :mod:`pyzero.backend`.

Modules are imported when a backend is first used, so the shm path never
loads the GPU code.
"""
from __future__ import annotations

import importlib

from .. import _C

# name -> (module, class)
_REGISTRY = {
    "shm": ("pyzero.backends.shm", "ShmBackend"),
    "nccl": ("pyzero.backends.nccl", "NcclBackend"),
    "ipc": ("pyzero.backends.ipc", "IpcBackend"),
    "hier": ("pyzero.backends.hier", "HierBackend"),
}
NAMES = ("shm", "nccl", "ipc", "hier")  # every backend pyzero knows; build_info()["backends"] says which are built


def available() -> tuple[str, ...]:
    """The backends this build of pyzero has ("hier" is shm inside hosts and torch's gloo between them)."""
    built = tuple(_C.build_info()["backends"])
    return built + ("hier",) if "shm" in built else built


def backend_class(name: str):
    """The Backend subclass called `name`; raises naming what exists and what is built."""
    if name not in NAMES:
        raise ValueError(f"backend: expected one of {NAMES} or None, got {name!r}")
    if name not in available() or name not in _REGISTRY:
        raise RuntimeError(f"backend={name!r} is not available in this build of pyzero "
                           f"(available: {list(available())})")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)
