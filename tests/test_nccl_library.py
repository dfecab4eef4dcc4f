"""Which NCCL library pyzero._C calls (csrc/nccl_api.h, pyzero/_loader.py), checked on CPU with a fake
libnccl.so.2: g++ builds a library with the functions _C looks up (trivial bodies; ncclGetVersion answers
a number no real NCCL has) and, for pyzero's test NCCL, pyzeroTestNccl. Each case imports pyzero in a
fresh process, so that what is already loaded is what the case says."""
import ctypes
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyzero import _C

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(not _C.build_info()["cuda"], reason="pyzero._C was built without CUDA: it calls no NCCL"),
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++"),
]

# The NCCL functions pyzero._C calls, as nccl.h names them.
FUNCTIONS = ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRankConfig", "ncclCommAbort", "ncclCommDestroy",
             "ncclCommFinalize", "ncclCommGetAsyncError", "ncclGetErrorString", "ncclGetLastError",
             "ncclGroupStart", "ncclGroupEnd", "ncclSend", "ncclRecv", "ncclAllReduce", "ncclBroadcast",
             "ncclReduce", "ncclAllGather", "ncclReduceScatter")
FAKE_VERSION = 99901  # 9.99.01: no real NCCL's
FAKE_ID = "fake-nccl-id"  # the fake's ncclGetUniqueId repeats it over the 128 bytes


def fake_nccl(folder: Path, test: bool = True, omit: tuple = ()) -> Path:
    """folder/lib/libnccl.so.2 (SONAME libnccl.so.2) exporting FUNCTIONS but `omit`, and pyzeroTestNccl if
    `test`; returns folder (a PYZERO_NCCL_ROOT)."""
    lines = ['extern "C" {']
    for name in FUNCTIONS:
        if name in omit:
            continue
        if name == "ncclGetVersion":
            lines.append(f"int ncclGetVersion(int* v) {{ *v = {FAKE_VERSION}; return 0; }}")
        elif name == "ncclGetUniqueId":
            lines.append(f"int ncclGetUniqueId(char* id) {{ for (int i = 0; i < 128; ++i) "
                         f"id[i] = {json.dumps(FAKE_ID)}[i % {len(FAKE_ID)}]; return 0; }}")
        else:
            lines.append(f"int {name}() {{ return 0; }}")
    if test:
        lines.append("int pyzeroTestNccl() { return 1; }")
    lines.append("}")
    (folder / "lib").mkdir(parents=True)
    src = folder / "fake_nccl.cpp"
    src.write_text("\n".join(lines) + "\n")
    build = subprocess.run(["g++", "-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o",
                            str(folder / "lib" / "libnccl.so.2"), str(src)],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    return folder


def real_nccl() -> Path:
    """The nvidia-nccl-cu13 package's libnccl.so.2 (what a CUDA torch loads)."""
    try:
        import nvidia.nccl
    except ImportError:
        pytest.skip("needs the nvidia-nccl-cu13 package")
    return Path(list(nvidia.nccl.__path__)[0]) / "lib" / "libnccl.so.2"


@functools.cache
def torch_nccl() -> list[str]:
    """The NCCL a plain `import torch` maps: none for a CPU torch (CI's), the package's for a CUDA one."""
    code = ("import json, torch; "
            "print(json.dumps(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libnccl' in l})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def version_of(library) -> int:
    """ncclGetVersion of `library`, through ctypes in this process (RTLD_LOCAL: it binds nothing else)."""
    v = ctypes.c_int()
    assert ctypes.CDLL(str(library), mode=os.RTLD_LOCAL).ncclGetVersion(ctypes.byref(v)) == 0
    return v.value


REPORT = """
import ctypes, json, os, pyzero
from pyzero import _C
from pyzero.backends.nccl import nccl_device
rep = {"nccl": pyzero.nccl_library(), "version": pyzero.build_info()["nccl_version"],
       "unique_id": _C.nccl_unique_id().decode("latin-1"),
       "maps": sorted({l.split()[-1] for l in open("/proc/self/maps") if "libnccl" in l})}
try:
    rep["rank_2_of_2_gpus"] = nccl_device(2, device_count=2)
except RuntimeError as e:
    rep["rank_2_of_2_gpus"] = str(e)
v = ctypes.c_int()  # what a later soname lookup (a CUDA torch's libnccl.so.2 dependency) gets
ctypes.CDLL("libnccl.so.2", mode=os.RTLD_NOLOAD).ncclGetVersion(ctypes.byref(v))
rep["soname_version"] = v.value
try:
    _C.nccl_open(REOPEN)
except ImportError as e:
    rep["reopen"] = str(e)
print(json.dumps(rep))
"""


def run(code: str, nccl_root=None):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYZERO_NCCL_ROOT")}
    env["PYTHONPATH"] = str(ROOT)
    if nccl_root is not None:
        env["PYZERO_NCCL_ROOT"] = str(nccl_root)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def report(r) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def preload(library) -> str:
    """Code loading `library` into the global scope, as a CUDA torch's import loads its NCCL."""
    return f"import ctypes; ctypes.CDLL({str(library)!r}, mode=ctypes.RTLD_GLOBAL)\n"


@pytest.mark.parametrize("before", ["torch", "nccl and torch"])
def test_pyzero_nccl_root_wins_over_an_nccl_already_loaded(tmp_path, before):
    root = fake_nccl(tmp_path / "fake")
    fake = root / "lib" / "libnccl.so.2"
    real = real_nccl()
    code = (preload(real) if before == "nccl and torch" else "") + "import torch\n" + REPORT
    rep = report(run(code.replace("REOPEN", repr(str(real))), nccl_root=root))
    assert rep["nccl"] == {"path": str(fake), "version": FAKE_VERSION, "test": True}, rep
    assert rep["version"] == FAKE_VERSION, rep  # build_info() asks the same library
    assert rep["unique_id"] == (FAKE_ID * 11)[:128], rep  # and so does every other NCCL call
    assert rep["rank_2_of_2_gpus"] == 0, rep  # nccl_device: ranks share GPUs on the test NCCL
    # the library _C calls cannot be switched once opened
    assert rep["reopen"] == f"NCCL is already loaded from {fake}; cannot switch to {real} in the same process", rep
    if before == "nccl and torch":
        assert rep["maps"] == sorted([str(fake), str(real)]), rep
        assert rep["soname_version"] == version_of(real) != FAKE_VERSION, rep  # the global NCCL stays torch's
    else:  # (a CUDA torch has mapped its own NCCL before pyzero: it stays, for torch's calls)
        assert rep["maps"] == sorted([str(fake), *torch_nccl()]), rep


def test_without_pyzero_nccl_root_the_nccl_already_loaded_is_used(tmp_path):
    """A libnccl.so.2 already in the process (the fake, standing for torch's) is preferred to the
    nvidia-nccl-cu13 package; without pyzeroTestNccl it is a real NCCL: one GPU per rank."""
    if torch_nccl():  # (it would bind the fake's symbols first and fail to import)
        pytest.skip("this torch loads an NCCL itself; test_torch_nccl_is_used_without_pyzero_nccl_root instead")
    fake = fake_nccl(tmp_path / "fake", test=False) / "lib" / "libnccl.so.2"
    rep = report(run((preload(fake) + REPORT).replace("REOPEN", repr(str(fake)))))
    assert rep["nccl"] == {"path": str(fake), "version": FAKE_VERSION, "test": False}, rep
    assert rep["maps"] == [str(fake)] and rep["unique_id"] == (FAKE_ID * 11)[:128], rep
    assert "this process sees 2 GPU(s): the nccl backend puts each rank on cuda:LOCAL_RANK, one GPU per rank" \
        in rep["rank_2_of_2_gpus"], rep
    assert "reopen" not in rep, rep  # nccl_open of the library already open: the same library, no error


def test_torch_nccl_is_used_without_pyzero_nccl_root():
    """A CUDA torch's NCCL, mapped by its import, is the one pyzero calls (one NCCL in the process)."""
    if not torch_nccl():
        pytest.skip("this torch loads no NCCL (a CPU build): the fake stands for one above")
    (loaded,) = torch_nccl()
    rep = report(run(REPORT.replace("REOPEN", repr(loaded))))
    assert rep["nccl"] == {"path": loaded, "version": version_of(loaded), "test": False}, rep
    assert rep["maps"] == [loaded] and "reopen" not in rep, rep


def test_a_library_lacking_a_function_is_refused_by_name(tmp_path):
    root = fake_nccl(tmp_path / "fake", omit=("ncclCommFinalize", "ncclGroupEnd"))
    fake = root / "lib" / "libnccl.so.2"
    r = run("import pyzero", nccl_root=root)
    assert r.returncode != 0
    assert (f"ImportError: the NCCL library {fake} lacks ncclCommFinalize, ncclGroupEnd, which "
            "pyzero calls: point PYZERO_NCCL_ROOT at a folder whose lib/libnccl.so.2 is a complete NCCL") \
        in r.stderr, r.stderr[-3000:]


def test_the_fake_has_what_the_table_needs(tmp_path):
    """The fake itself, checked without pyzero: every function, the version, the test mark."""
    lib = ctypes.CDLL(str(fake_nccl(tmp_path / "fake") / "lib" / "libnccl.so.2"), mode=os.RTLD_LOCAL)
    assert all(hasattr(lib, name) for name in FUNCTIONS) and lib.pyzeroTestNccl() == 1
    v = ctypes.c_int()
    assert lib.ncclGetVersion(ctypes.byref(v)) == 0 and v.value == FAKE_VERSION


def test_the_real_nccl_is_called_through_the_table():
    """This process's NCCL (the nvidia-nccl-cu13 package here): ncclGetUniqueId needs no GPU."""
    from pyzero import nccl_library
    lib = nccl_library()
    assert lib["path"] and lib["version"] == version_of(lib["path"]) and lib["test"] is False, lib
    uid = _C.nccl_unique_id()
    assert len(uid) == 128 and uid != bytes(128) and uid != _C.nccl_unique_id()  # NCCL_UNIQUE_ID_BYTES, random
