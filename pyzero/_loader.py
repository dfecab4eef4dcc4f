"""Imports pyzero._C after loading the shared libraries it links against.

A CUDA build of ``_C`` needs ``libnccl.so.2``. Where that library lies is found
when pyzero is imported, never recorded at build time: a build may run in a
temporary environment (pip's build isolation) that is gone by then, and an
editable install lives beside the sources, not in site-packages. As torch does
for its CUDA libraries, the library is loaded with ``RTLD_GLOBAL`` before ``_C``
so that the dynamic loader resolves ``_C``'s dependency to it, whatever was
imported first. Searched, in order:

1. ``$PYZERO_NCCL_ROOT/lib``
2. the ``nvidia-nccl-cu13`` package (``nvidia/nccl/lib`` wherever Python finds it)
3. the system loader (``LD_LIBRARY_PATH``, ``ld.so.cache``)

A ``libnccl.so.2`` already in the process (torch's, say) is used as it is.
The build writes ``_build_config.py`` beside ``_C`` saying whether ``_C`` needs
NCCL; without that file (``_C`` built by hand) NCCL is loaded only when
importing ``_C`` fails for want of it.
"""
import ctypes
import importlib
import importlib.util
import os
from pathlib import Path

NCCL_SONAME = "libnccl.so.2"
NCCL_PACKAGE = "nvidia-nccl-cu13"

_nccl = None  # the loaded library, kept so that it is never unloaded


def nccl_candidates(soname=NCCL_SONAME):
    """[(where, path or None)] in search order; None: that place is not there."""
    out = []
    root = os.environ.get("PYZERO_NCCL_ROOT")
    out.append((f"PYZERO_NCCL_ROOT={root}" if root else "PYZERO_NCCL_ROOT (not set)",
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


def load_nccl():
    """Loads libnccl.so.2 once (see the module docstring); ImportError naming every place searched."""
    global _nccl
    if _nccl is None:
        _nccl = open_library(NCCL_SONAME)
    return _nccl


def open_library(soname):
    """The library `soname` as already loaded, else the first of nccl_candidates(soname) that loads."""
    try:  # already in the process, e.g. torch's: use that one, never a second copy
        return ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    except OSError:
        pass
    tried = []
    for where, path in nccl_candidates(soname):
        if path is None:
            tried.append(where)
            continue
        if isinstance(path, Path) and not path.is_file():
            tried.append(f"{where}: no {path}")
            continue
        try:
            return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            tried.append(f"{where}: {e}")
    raise ImportError(
        f"pyzero was built with CUDA and needs NCCL ({soname}), which was not found. Searched:\n  "
        + "\n  ".join(tried)
        + f"\nInstall it with `pip install {NCCL_PACKAGE}`, or set PYZERO_NCCL_ROOT to a folder with "
        f"lib/{soname}, or rebuild pyzero without CUDA (PYZERO_CUDA=0)."
    )


def _needs_nccl():
    """True/False from the build's _build_config.py; None when there is none."""
    try:
        config = importlib.import_module(f"{__package__}._build_config")
    except ImportError:
        return None
    return bool(getattr(config, "NCCL", False))


def import_extension():
    """Loads what _C needs, then imports and returns pyzero._C."""
    if _needs_nccl():
        load_nccl()
    try:
        return importlib.import_module(f"{__package__}._C")
    except ImportError as e:
        if NCCL_SONAME not in str(e):
            raise
    load_nccl()
    return importlib.import_module(f"{__package__}._C")
