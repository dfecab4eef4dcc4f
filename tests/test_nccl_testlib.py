"""The test NCCL library (csrc/test_nccl/: NCCL's C API over the ipc transport, several ranks on one GPU),
the parts that run without a GPU.

tests/nccl_testlib_on_cpu.cpp runs its rendezvous (csrc/test_nccl/rendezvous.h) with fork()ed processes:
1-16 ranks arriving in random order each get every rank's bytes and the shared-memory segment is gone
afterwards; a rank that never comes, ranks given different world sizes, two processes given one rank and
an abort each end in an error naming the cause; and the ncclGroupStart/End bookkeeping (nesting, one batch
per communicator, at most 32 sends and receives in one). Then the built library, where there is one
(PYZERO_TEST_NCCL_ROOT, a build with PYZERO_TEST_NCCL=1, or scripts/build_test_nccl.sh's build/test-nccl):
it is libnccl.so.2 exporting every NCCL function pyzero's sources call (read from csrc/) and nothing of
pyzero's own, and its calls that need no GPU answer as NCCL does (error strings compared with the real
library's). With PYZERO_TEST_NCCL=1 set (CI builds it so) a missing library fails instead of skipping.
The GPU tests are tests/test_nccl_multirank_gpu.py.
"""
import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_library_root():
    """The folder (lib/libnccl.so.2, include/nccl.h) of a built test library, or None."""
    env = os.environ.get("PYZERO_TEST_NCCL_ROOT")
    if env:
        return Path(env)
    for cand in sorted(ROOT.glob("build/cmake-py*/test-nccl")) + [ROOT / "build" / "test-nccl"]:
        if (cand / "lib" / "libnccl.so.2").is_file():
            return cand
    return None


test_library_root.__test__ = False  # a helper, not a test


def _library():
    root = test_library_root()
    if root is None or not (root / "lib" / "libnccl.so.2").is_file():
        if os.environ.get("PYZERO_TEST_NCCL", "").strip().lower() in ("1", "on"):
            pytest.fail(f"PYZERO_TEST_NCCL=1 but no built test NCCL library was found (looked at "
                        f"{root or 'build/cmake-py*/test-nccl, build/test-nccl'})")
        pytest.skip("no built test NCCL library (scripts/build_test_nccl.sh, or build with PYZERO_TEST_NCCL=1)")
    return root


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_rendezvous_and_groups_on_cpu(tmp_path):
    exe = tmp_path / "nccl_testlib_on_cpu"
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", f"-I{ROOT / 'csrc'}",
                            str(ROOT / "tests" / "nccl_testlib_on_cpu.cpp"), "-o", str(exe), "-lpthread", "-lrt"],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    assert "warning" not in build.stderr, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    out = run.stdout
    assert run.returncode == 0, out[-4000:]
    m = re.search(r"(\d+) cases, (\d+) failures", out)
    assert m and int(m.group(2)) == 0 and int(m.group(1)) >= 40, out[-2000:]
    for n in (1, 2, 3, 4, 8, 16):
        assert f"rendezvous {n} ranks: {n} of {n} got every handle, segment gone" in out, out
    assert out.count("rendezvous 4 ranks: 4 of 4 got every handle, segment gone") == 6, out
    assert "waiting for rank(s) 2 to join the communicator" in out and "missing rank: codes 10 10, segment gone" in out
    assert "nranks differ: codes 10 11" in out and "rank twice: codes 10 12" in out and "abort: code 13" in out, out
    assert "groups: the test NCCL library runs at most 32 sends and receives per communicator" in out, out


def _nccl_include():
    """A folder with NCCL's nccl.h: the nvidia-nccl-cu13 package's, or a built test library's; else None."""
    try:
        import nvidia.nccl as n  # noqa: PLC0415

        for base in n.__path__:
            if (Path(base) / "include" / "nccl.h").is_file():
                return Path(base) / "include"
    except ImportError:
        pass
    root = test_library_root()
    return root / "include" if root and (root / "include" / "nccl.h").is_file() else None


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_nccl_type_table_against_ncclh(tmp_path):
    """csrc/nccl_types.h (pyzero's dtypes and ops <-> NCCL's, used by the nccl backend and the test
    library) against NCCL's enum by name, both ways, every NCCL type."""
    inc = _nccl_include()
    if inc is None:
        pytest.skip("no nccl.h here (pip install nvidia-nccl-cu13)")
    nvcc = shutil.which("nvcc")
    cuda = [Path(d) / "include" for d in (os.environ.get("CUDA_HOME"), nvcc and Path(nvcc).parents[1],
                                          "/usr/local/cuda") if d]
    cuda = next((d for d in cuda if (d / "cuda_runtime.h").is_file()), None)
    if cuda is None:  # (nccl.h includes cuda_runtime.h)
        pytest.skip("no CUDA toolkit headers here (cuda_runtime.h)")
    exe = tmp_path / "nccl_types_on_cpu"
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", f"-I{ROOT / 'csrc'}", f"-I{inc}",
                            f"-I{cuda}",
                            str(ROOT / "tests" / "nccl_types_on_cpu.cpp"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    assert "warning" not in build.stderr, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    m = re.search(r"(\d+) cases, (\d+) failures", run.stdout)
    assert run.returncode == 0 and m and int(m.group(2)) == 0 and int(m.group(1)) >= 40, run.stdout[-4000:]


def _nccl_calls_in_sources(header):
    """Every NCCL function pyzero's C++ calls: the table csrc/nccl_api.h fills (X(name) is ncclname),
    each a function nccl.h declares."""
    functions = set(re.findall(r"^\s*(?:ncclResult_t|const char\*)\s+(nccl[A-Z]\w*)\s*\(", header, re.M))
    table = (ROOT / "csrc" / "nccl_api.h").read_text().split("#define PZ_NCCL_FUNCTIONS(X)")[1].split("\n\n")[0]
    names = {"nccl" + n for n in re.findall(r"\bX\((\w+)\)", table)}
    assert names <= functions, f"nccl_api.h names what nccl.h does not declare: {sorted(names - functions)}"
    return names


def test_library_exports_the_nccl_calls_pyzero_makes():
    root = _library()
    lib = root / "lib" / "libnccl.so.2"
    if not shutil.which("nm") or not shutil.which("readelf"):
        pytest.skip("needs nm and readelf (binutils)")
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in syms.splitlines() if line.split()[1:2] in (["T"], ["W"])}
    calls = _nccl_calls_in_sources((root / "include" / "nccl.h").read_text())
    assert {"ncclAllReduce", "ncclSend", "ncclCommInitRankConfig", "ncclCommGetAsyncError"} <= calls, calls
    assert calls <= exported, f"the test library lacks {sorted(calls - exported)}"
    assert "pyzeroTestNccl" in exported
    leaked = sorted(s for s in exported if not (s.startswith("nccl") or s == "pyzeroTestNccl"))
    assert not leaked, f"the test library exports more than NCCL's API: {leaked[:20]}"
    dyn = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"\(SONAME\)\s+Library soname: \[libnccl\.so\.2\]", dyn), dyn
    assert "cudart" not in dyn, dyn  # the CUDA runtime is linked in, as NCCL's is
    header = (root / "include" / "nccl.h").read_text()
    assert "#define NCCL_UNIQUE_ID_BYTES 128" in header


_PROBE = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
real = ctypes.CDLL(sys.argv[2]) if sys.argv[2] else None
class Id(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
out = {"marker": lib.pyzeroTestNccl()}
v = ctypes.c_int()
out["version_rc"] = lib.ncclGetVersion(ctypes.byref(v))
out["version"] = v.value
a, b = Id(), Id()
out["id_rc"] = [lib.ncclGetUniqueId(ctypes.byref(a)), lib.ncclGetUniqueId(ctypes.byref(b))]
out["ids"] = [bytes(a.internal).split(b"\0")[0].decode(), bytes(b.internal).split(b"\0")[0].decode()]
for l in (lib, real):
    if l is not None:
        l.ncclGetErrorString.restype = ctypes.c_char_p
lib.ncclGetLastError.restype = ctypes.c_char_p
out["strings"] = [lib.ncclGetErrorString(r).decode() for r in range(9)]
out["real_strings"] = [real.ncclGetErrorString(r).decode() for r in range(9)] if real else None
out["group_end"] = [lib.ncclGroupEnd(), lib.ncclGetLastError(None).decode()]
comm = ctypes.c_void_p()
out["bad_id"] = [lib.ncclCommInitRank(ctypes.byref(comm), 2, Id(), 0), lib.ncclGetLastError(None).decode()]
out["too_many"] = [lib.ncclCommInitRank(ctypes.byref(comm), 17, a, 0), lib.ncclGetLastError(None).decode()]
out["bad_rank"] = [lib.ncclCommInitRank(ctypes.byref(comm), 2, a, 2), lib.ncclGetLastError(None).decode()]
out["null_comm"] = [lib.ncclSend(None, 4, 7, 1, None, None), lib.ncclGetLastError(None).decode()]
st = ctypes.c_int()
out["async_null"] = lib.ncclCommGetAsyncError(None, ctypes.byref(st))
out["group_start"] = [lib.ncclGroupStart(), lib.ncclGroupStart(), lib.ncclGroupEnd(), lib.ncclGroupEnd()]
print(json.dumps(out))
"""


def test_library_calls_that_need_no_gpu():
    """Loaded on its own (ctypes, a fresh interpreter): the marker, the version of the nccl.h it was built
    with, unique ids naming fresh segments, NCCL's error strings, and clear errors for bad arguments."""
    root = _library()
    header = (root / "include" / "nccl.h").read_text()
    code = int(re.search(r"#define NCCL_VERSION_CODE (\d+)", header).group(1))
    real = ""
    try:
        import nvidia.nccl as pkg  # noqa: PLC0415
        cand = Path(list(pkg.__path__)[0]) / "lib" / "libnccl.so.2"
        real = str(cand) if cand.is_file() else ""
    except ImportError:
        pass
    run = subprocess.run([sys.executable, "-c", _PROBE, str(root / "lib" / "libnccl.so.2"), real],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["marker"] == 1 and out["version_rc"] == 0 and out["version"] == code, out
    assert out["id_rc"] == [0, 0] and out["ids"][0] != out["ids"][1], out
    assert all(i.startswith("PZTNCCL1/pz-tnccl-") for i in out["ids"]), out
    assert out["strings"][0] == "no error" and "invalid usage" in out["strings"][5], out
    if out["real_strings"]:
        assert out["strings"] == out["real_strings"]
    assert out["group_end"][0] == 5 and "ncclGroupEnd without ncclGroupStart" in out["group_end"][1], out
    assert out["bad_id"][0] == 4 and "magic differs" in out["bad_id"][1], out
    assert out["too_many"][0] == 4 and "nranks must be 1..16" in out["too_many"][1], out
    assert out["bad_rank"][0] == 4 and "rank 2 is not in [0, 2)" in out["bad_rank"][1], out
    assert out["null_comm"][0] == 4 and "ncclSend: comm is NULL" in out["null_comm"][1], out
    assert out["async_null"] == 4 and out["group_start"] == [0, 0, 0, 0], out


def _test_nccl_mode():
    tree = ast.parse((ROOT / "setup.py").read_text())
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "test_nccl_mode"]
    assert len(fns) == 1, "setup.py defines no top-level test_nccl_mode()"
    ns = {"os": os}
    exec(compile(ast.Module(body=fns, type_ignores=[]), "setup.py", "exec"), ns)  # noqa: S102 - our own setup.py
    return ns["test_nccl_mode"]


@pytest.mark.parametrize("flag,cuda,want", [("", "ON", "OFF"), ("0", "ON", "OFF"), ("1", "ON", "ON"),
                                            ("on", "ON", "ON"), ("", "OFF", "OFF")])
def test_setup_builds_the_test_library_only_when_asked(monkeypatch, flag, cuda, want):
    monkeypatch.setenv("PYZERO_TEST_NCCL", flag)
    assert _test_nccl_mode()(cuda) == want


def test_setup_refuses_the_test_library_without_cuda(monkeypatch):
    mode = _test_nccl_mode()
    monkeypatch.setenv("PYZERO_TEST_NCCL", "1")
    with pytest.raises(SystemExit, match="PYZERO_TEST_NCCL=1 needs the CUDA build"):
        mode("OFF")
    monkeypatch.setenv("PYZERO_TEST_NCCL", "yes please")
    with pytest.raises(SystemExit, match="expected 1"):
        mode("ON")
