"""Imports pyzero._C and, for a CUDA build, chooses the NCCL library it calls.

A CUDA build of ``_C`` does not link ``libnccl.so.2``: it calls NCCL through a
table of functions looked up in one library that ``_C.nccl_open(path)`` opens
with ``RTLD_LOCAL`` (csrc/nccl_api.h). This module chooses that library when
pyzero is imported, never at build time (a build may run in a temporary
environment, pip's build isolation, that is gone by then), and opens it right
after importing ``_C``, so a missing NCCL is reported by ``import pyzero``.
Chosen, in order:

1. ``$PYZERO_NCCL_ROOT/lib/libnccl.so.2`` when the variable is set: the
   explicit choice wins, even over a ``libnccl.so.2`` already in the process,
   and is an error when that file is absent. It may be pyzero's test NCCL
   (several ranks per GPU), which works beside torch's own NCCL.
2. a ``libnccl.so.2`` already in the process (torch's, say): no second copy
3. the ``nvidia-nccl-cu13`` package (``nvidia/nccl/lib`` wherever Python finds it)
4. the system loader (``LD_LIBRARY_PATH``, ``ld.so.cache``)

``nccl_library()`` says which library was opened.
"""
import ctypes
import importlib
import importlib.util
import os
from pathlib import Path

NCCL_SONAME = "libnccl.so.2"
NCCL_PACKAGE = "nvidia-nccl-cu13"
ROOT_VARIABLE = "PYZERO_NCCL_ROOT"

_probes = []  # ctypes handles of the libraries tried, kept so that none is unloaded


def nccl_candidates(soname=NCCL_SONAME):
    """[(where, path or None)] in search order; None: that place is not there."""
    out = []
    root = os.environ.get(ROOT_VARIABLE)
    out.append((f"{ROOT_VARIABLE}={root}" if root else f"{ROOT_VARIABLE} (not set)",
                Path(root) / "lib" / soname if root else None))
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    if dirs:
        for d in dirs:
            out.append((f"the {NCCL_PACKAGE} package ({d})", Path(d) / "lib" / soname))
    else:
        out.append((f"the {NCCL_PACKAGE} package (not installed)", None))
    out.append(("the system loader (LD_LIBRARY_PATH, ld.so.cache)", soname))
    return out


def find_library(soname=NCCL_SONAME):
    """What _C.nccl_open should open: a path, or `soname` for one already loaded or found by the system
    loader (see the module docstring). ImportError naming every place searched."""
    root = os.environ.get(ROOT_VARIABLE)
    if root:
        path = Path(root) / "lib" / soname
        if not path.is_file():
            raise ImportError(
                f"{ROOT_VARIABLE}={root}, but there is no {path}: point {ROOT_VARIABLE} at a folder with "
                f"lib/{soname}, or unset it to use the NCCL already loaded (torch's), the {NCCL_PACKAGE} package "
                "or the system loader's")
        return _probe(str(path), f"{ROOT_VARIABLE}={root}")
    try:  # already in the process, e.g. torch's: use that one, never a second copy
        _probes.append(ctypes.CDLL(soname, mode=os.RTLD_NOLOAD))
        return soname
    except OSError:
        pass
    tried = []
    for where, path in nccl_candidates(soname)[1:]:
        if path is None:
            tried.append(where)
            continue
        if isinstance(path, Path) and not path.is_file():
            tried.append(f"{where}: no {path}")
            continue
        try:
            return _probe(str(path), where)
        except OSError as e:
            tried.append(f"{where}: {e}")
    raise ImportError(
        f"pyzero was built with CUDA and needs NCCL ({soname}), which was not found. Searched:\n  "
        + "\n  ".join([f"{ROOT_VARIABLE} (not set)"] + tried)
        + f"\nInstall it with `pip install {NCCL_PACKAGE}`, or set {ROOT_VARIABLE} to a folder with "
        f"lib/{soname}, or rebuild pyzero without CUDA (PYZERO_CUDA=0)."
    )


def _probe(path, where):
    """`path` once it loads (RTLD_LOCAL: only _C's table calls into it); OSError (ImportError for the explicit
    PYZERO_NCCL_ROOT choice) with the loader's reason otherwise."""
    try:
        _probes.append(ctypes.CDLL(path, mode=os.RTLD_LOCAL))
    except OSError as e:
        if where.startswith(ROOT_VARIABLE):
            raise ImportError(f"{where}: {path} does not load: {e}") from None
        raise
    return path


def import_extension():
    """Imports pyzero._C; for a CUDA build, opens the NCCL library find_library() chose."""
    ext = importlib.import_module(f"{__package__}._C")
    if hasattr(ext, "nccl_open"):
        if os.environ.get(ROOT_VARIABLE):
            # torch first: a CUDA torch then binds its own libnccl.so.2 before this one is loaded. A library
            # with that SONAME already in the process (even loaded RTLD_LOCAL) would satisfy torch's
            # dependency on libnccl.so.2 instead.
            import torch  # noqa: F401, PLC0415
        ext.nccl_open(find_library())
    return ext


def nccl_library():
    """{'path', 'version', 'test'} of the NCCL library pyzero calls; None for a build without CUDA."""
    ext = importlib.import_module(f"{__package__}._C")
    return ext.nccl_library() if hasattr(ext, "nccl_library") else None


def test_nccl_loaded() -> bool:
    """Whether the NCCL library pyzero calls is pyzero's test NCCL (it exports ``pyzeroTestNccl``;
    several ranks may share a GPU on it)."""
    return bool((nccl_library() or {}).get("test"))
