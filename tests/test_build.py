"""How pyzero._C was built, how it is loaded, and setup.py's build options."""
import ast
import ctypes.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pyzero
from pyzero import _C
from test_nccl_library import torch_nccl

ROOT = Path(__file__).resolve().parents[1]


def _nvcc_present():
    return bool(shutil.which("nvcc")) or Path("/usr/local/cuda/bin/nvcc").exists()


def _cuda_wanted():
    return os.environ.get("PYZERO_CUDA", "").strip().lower() not in ("0", "off")


def test_build_info_keys():
    info = _C.build_info()
    assert pyzero.build_info is _C.build_info
    for key in ("cuda", "nccl_version", "cuda_archs", "compiler"):
        assert key in info, f"build_info() lacks {key!r}: {info}"
    assert isinstance(info["cuda"], bool)
    assert isinstance(info["cuda_archs"], list)
    assert isinstance(info["compiler"], str) and info["compiler"]
    assert "shm" in info["backends"]
    if not info["cuda"]:
        assert info["nccl_version"] is None and info["cuda_archs"] == []


def _expected_archs():
    arch = os.environ.get("PYZERO_CUDA_ARCH")
    if arch:
        return [a for a in re.split(r"[;,\s]+", arch) if a]
    torch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if torch_list:
        return _load_cuda_archs()().split(";")
    return ["80", "90"]


@pytest.mark.skipif(not (_nvcc_present() and _cuda_wanted()), reason="no nvcc, or PYZERO_CUDA=0: a CPU-only build")
def test_cuda_build_when_nvcc_present():
    info = _C.build_info()
    assert info["cuda"] is True, f"nvcc is installed but pyzero._C was built without CUDA: {info}"
    assert isinstance(info["nccl_version"], int) and info["nccl_version"] > 20000, info
    assert info["cuda_archs"], info
    assert all(isinstance(a, str) and a for a in info["cuda_archs"]), info
    assert info["cuda_archs"] == _expected_archs(), info
    assert hasattr(_C, "cuda_reduce2")


# ---------------------------------------------------------------------------
# setup.py's cuda_archs(): extracted with ast (importing setup.py runs setup())


def _load_cuda_archs():
    src = (ROOT / "setup.py").read_text()
    tree = ast.parse(src)
    fns = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "cuda_archs"]
    assert len(fns) == 1, "setup.py defines no top-level cuda_archs()"
    module = ast.Module(body=fns, type_ignores=[])
    ns = {"os": os, "re": re}
    exec(compile(module, str(ROOT / "setup.py"), "exec"), ns)  # noqa: S102 - our own setup.py
    return ns["cuda_archs"]


def _load_setup_functions(*names):
    """setup.py's top-level functions `names`, in one namespace (setup() itself is not run)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    fns = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(f.name for f in fns) == sorted(names), f"setup.py lacks one of {names}"
    ns = {"os": os, "re": re, "shutil": shutil, "Path": Path}
    exec(compile(ast.Module(body=fns, type_ignores=[]), str(ROOT / "setup.py"), "exec"), ns)  # noqa: S102
    return ns


@pytest.mark.parametrize("value,want", [
    ("8.0;9.0+PTX", "80;90"),
    ("7.5 8.6", "75;86"),
    ("8.0", "80"),
    ("  8.0 ; 8.6;9.0 ", "80;86;90"),
    ("7.0,7.5", "70;75"),
    ("9.0a", "90a"),
    ("10.0 12.0+PTX", "100;120"),
])
def test_cuda_archs_from_torch_arch_list(monkeypatch, value, want):
    cuda_archs = _load_cuda_archs()
    monkeypatch.delenv("PYZERO_CUDA_ARCH", raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
    assert cuda_archs() == want


def test_cuda_archs_pyzero_arch_wins_and_default(monkeypatch):
    cuda_archs = _load_cuda_archs()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5")
    monkeypatch.setenv("PYZERO_CUDA_ARCH", "80,90")
    assert cuda_archs() == "80;90"
    monkeypatch.setenv("PYZERO_CUDA_ARCH", "86")
    assert cuda_archs() == "86"
    monkeypatch.delenv("PYZERO_CUDA_ARCH")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert cuda_archs() == "80;90"


@pytest.mark.parametrize("value", ["sm_80", "8", "eighty"])
def test_cuda_archs_rejects_unreadable_torch_arch_list(monkeypatch, value):
    cuda_archs = _load_cuda_archs()
    monkeypatch.delenv("PYZERO_CUDA_ARCH", raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
    with pytest.raises(SystemExit, match="TORCH_CUDA_ARCH_LIST"):
        cuda_archs()


# ---------------------------------------------------------------------------
# setup.py: which nvcc, and the build-time errors when CUDA is asked for without it


def _fake_nvcc(folder):
    nvcc = Path(folder) / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    return str(nvcc)


def test_find_nvcc_order(tmp_path):
    find_nvcc = _load_setup_functions("find_nvcc")["find_nvcc"]
    absent = str(tmp_path / "none" / "nvcc")
    home, on_path, default = (_fake_nvcc(tmp_path / d) for d in ("home", "path", "default"))
    path = str(Path(on_path).parent)
    assert find_nvcc({"CUDACXX": on_path, "CUDA_HOME": str(tmp_path / "home")}, default)[0] == on_path
    assert find_nvcc({"CUDA_HOME": str(tmp_path / "home"), "PATH": path}, default)[0] == home
    assert find_nvcc({"PATH": path}, default)[0] == on_path
    assert find_nvcc({"PATH": ""}, default)[0] == default
    nvcc, looked = find_nvcc({"PATH": "", "CUDA_HOME": str(tmp_path / "none")}, absent)
    assert nvcc is None and looked == [f"CUDA_HOME={tmp_path / 'none'}", "PATH", absent]
    with pytest.raises(SystemExit, match="CUDACXX=/nonexistent/nvcc is not an executable nvcc"):
        find_nvcc({"CUDACXX": "/nonexistent/nvcc"}, default)


@pytest.mark.parametrize("flag,nvcc,want", [
    ("", "/x/nvcc", "ON"), ("", None, "OFF"), ("auto", None, "OFF"),
    ("1", "/x/nvcc", "ON"), ("on", "/x/nvcc", "ON"), ("0", "/x/nvcc", "OFF"), ("off", None, "OFF"),
])
def test_cuda_mode(monkeypatch, flag, nvcc, want):
    ns = _load_setup_functions("cuda_mode", "find_nvcc")
    ns["find_nvcc"] = lambda: (nvcc, ["PATH"])
    monkeypatch.setenv("PYZERO_CUDA", flag)
    monkeypatch.delenv("CUDACXX", raising=False)
    assert ns["cuda_mode"]() == want
    if want == "ON":
        assert os.environ["CUDACXX"] == nvcc


def test_cuda_mode_errors(monkeypatch):
    ns = _load_setup_functions("cuda_mode", "find_nvcc")
    ns["find_nvcc"] = lambda: (None, ["PATH", "/usr/local/cuda/bin/nvcc"])
    monkeypatch.setenv("PYZERO_CUDA", "1")
    with pytest.raises(SystemExit, match=r"PYZERO_CUDA=1 but no nvcc was found \(looked in PATH, "
                                         r"/usr/local/cuda/bin/nvcc\).*CUDACXX.*PYZERO_CUDA=0"):
        ns["cuda_mode"]()
    monkeypatch.setenv("PYZERO_CUDA", "yes")
    with pytest.raises(SystemExit, match="PYZERO_CUDA='yes': expected 0"):
        ns["cuda_mode"]()


def _run_setup(tmp_path, **env):
    """`python setup.py build_ext` into tmp_path with env added; (returncode, output)."""
    full = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "PYZERO_NCCL_ROOT")}
    full.update(env)
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                        "--build-temp", str(tmp_path / "tmp")],
                       cwd=ROOT, env=full, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout + r.stderr


def test_build_asking_for_cuda_with_a_wrong_nvcc_fails_with_the_fix(tmp_path):
    rc, out = _run_setup(tmp_path, PYZERO_CUDA="1", CUDACXX="/nonexistent/nvcc")
    assert rc != 0
    assert "CUDACXX=/nonexistent/nvcc is not an executable nvcc" in out, out[-2000:]
    assert "PYZERO_CUDA=0" in out
    assert not (tmp_path / "lib").exists()  # failed before building anything


@pytest.mark.skipif(not _nvcc_present(), reason="needs nvcc (the NCCL check follows the nvcc one)")
def test_build_asking_for_cuda_without_nccl_fails_with_the_fix(tmp_path):
    rc, out = _run_setup(tmp_path, PYZERO_CUDA="1", PYZERO_NCCL_ROOT=str(tmp_path))
    assert rc != 0
    assert f"PYZERO_NCCL_ROOT={tmp_path} has no include/nccl.h: point it at an NCCL install" in out, out[-2000:]
    assert "pip install nvidia-nccl-cu13" in out


def test_the_build_needs_only_the_nccl_header(monkeypatch, tmp_path):
    """_C links no NCCL (it opens the library at import): a PYZERO_NCCL_ROOT with include/nccl.h will do."""
    nccl_root = _load_setup_functions("nccl_root")["nccl_root"]
    monkeypatch.setenv("PYZERO_NCCL_ROOT", str(tmp_path))
    with pytest.raises(SystemExit, match=f"PYZERO_NCCL_ROOT={tmp_path} has no include/nccl.h: "):
        nccl_root()
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "nccl.h").write_text("")
    assert nccl_root() == str(tmp_path)


# ---------------------------------------------------------------------------
# Loading: no build-time paths in _C, no link to NCCL; the NCCL library chosen at import time, whatever is
# imported first (tests/test_nccl_library.py: a PYZERO_NCCL_ROOT library wins over one already loaded)


def _extension():
    return Path(_C.__file__)


def _readelf_dynamic():
    if not shutil.which("readelf"):
        pytest.skip("needs readelf (binutils)")
    return subprocess.run(["readelf", "-d", str(_extension())], capture_output=True, text=True,
                          check=True).stdout


def test_extension_has_no_rpath_and_does_not_link_nccl():
    dyn = _readelf_dynamic()
    assert "RPATH" not in dyn and "RUNPATH" not in dyn, dyn
    assert "libnccl" not in dyn, dyn  # _C opens the library pyzero._loader chose (csrc/nccl_api.h)
    symbols = subprocess.run(["readelf", "--dyn-syms", "-W", str(_extension())], capture_output=True, text=True,
                             check=True).stdout
    undefined = [line.split()[-1] for line in symbols.splitlines() if " UND " in line]
    assert undefined and not [name for name in undefined if name.startswith(("nccl", "pnccl"))], undefined
    assert hasattr(_C, "nccl_open") == _C.build_info()["cuda"]


def test_build_config_matches_extension():
    config_file = _extension().parent / "_build_config.py"
    if not config_file.exists():
        pytest.skip(f"{config_file} absent: this _C was not built by setup.py/CMakeLists.txt here")
    from pyzero import _build_config
    assert _build_config.CUDA is _C.build_info()["cuda"]
    assert _build_config.NCCL is _C.build_info()["cuda"]


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYZERO_NCCL_ROOT")}
    env.update(extra)
    return env


_REPORT = (
    "import pyzero, sys, json; "
    "print(json.dumps({'cuda': pyzero.build_info()['cuda'], 'version': pyzero.build_info()['nccl_version'], "
    "'nccl': pyzero.nccl_library(), "
    "'maps': sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libnccl' in l})}))"
)


def _python(code, env, cwd=ROOT, pythonpath=ROOT):
    env = dict(env, PYTHONPATH=str(pythonpath))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def _report(r):
    import json
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first", ["pyzero", "torch"])
def test_import_in_a_fresh_process_either_order(first):
    code = ("import torch; " if first == "torch" else "") + _REPORT
    rep = _report(_python(code, _clean_env()))
    assert rep["cuda"] == _C.build_info()["cuda"]
    if not rep["cuda"]:
        assert rep["nccl"] is None and rep["maps"] == []
        return
    assert len(rep["maps"]) == 1, rep  # one NCCL in the process
    real = _package_nccl()
    assert rep["maps"] == [str(real)] and rep["nccl"] == {"path": str(real), "version": _version_of(real),
                                                           "test": False}, rep
    assert rep["version"] == rep["nccl"]["version"], rep


def _package_nccl():
    import nvidia.nccl
    return Path(list(nvidia.nccl.__path__)[0]) / "lib" / "libnccl.so.2"


def _version_of(library):
    """ncclGetVersion of `library`, called through ctypes in a process of its own."""
    code = ("import ctypes, sys; v = ctypes.c_int(); "
            f"assert ctypes.CDLL({str(library)!r}).ncclGetVersion(ctypes.byref(v)) == 0; print(v.value)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return int(r.stdout)


def test_an_nccl_already_in_the_process_is_used():
    """As when a CUDA torch was imported first: no second copy is loaded."""
    _require_cuda_build()
    real = _package_nccl()
    code = f"import ctypes; ctypes.CDLL({str(real)!r}, mode=ctypes.RTLD_GLOBAL); " + _REPORT
    rep = _report(_python(code, _clean_env()))
    assert rep["maps"] == [str(real)] and rep["nccl"]["path"] == str(real) and not rep["nccl"]["test"], rep


def _require_cuda_build():
    if not _C.build_info()["cuda"]:
        pytest.skip("pyzero._C was built without CUDA: it needs no NCCL")


def test_pyzero_nccl_root_is_searched_first(tmp_path):
    _require_cuda_build()
    if torch_nccl():  # (the link below names the very file torch has open: the loader hands back torch's)
        pytest.skip("this torch loads the package's NCCL itself; test_nccl_library covers PYZERO_NCCL_ROOT then")
    real = _package_nccl()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libnccl.so.2").symlink_to(real)
    rep = _report(_python(_REPORT, _clean_env(PYZERO_NCCL_ROOT=str(tmp_path))))
    assert rep["nccl"]["path"] == str(tmp_path / "lib" / "libnccl.so.2"), rep
    assert rep["version"] == rep["nccl"]["version"] == _version_of(real) and rep["maps"] == [str(real)], rep


def _copy_package(dest, config):
    """pyzero/ (with its built _C) copied under dest, with _build_config.py = config (None: none)."""
    shutil.copytree(ROOT / "pyzero", dest / "pyzero", ignore=shutil.ignore_patterns("__pycache__", "_build_config.py"))
    if config is not None:
        (dest / "pyzero" / "_build_config.py").write_text(config)
    return dest


def test_import_without_build_config_loads_nccl_when_needed(tmp_path):
    _require_cuda_build()
    rep = _report(_python(_REPORT, _clean_env(), cwd=tmp_path, pythonpath=_copy_package(tmp_path, None)))
    assert rep["cuda"] and rep["nccl"]["path"] == str(_package_nccl()) and len(rep["maps"]) == 1, rep


_HIDE_NCCL_PACKAGE = "import sys; sys.modules['nvidia.nccl'] = None; "


def test_import_without_nccl_names_every_place_searched(tmp_path):
    _require_cuda_build()
    if ctypes.util.find_library("nccl"):
        pytest.skip("the system loader finds an NCCL here")
    pkg = _copy_package(tmp_path, "CUDA = True\nNCCL = True\n")
    r = _python(_HIDE_NCCL_PACKAGE + "import pyzero", _clean_env(), cwd=tmp_path, pythonpath=pkg)
    assert r.returncode != 0
    err = r.stderr
    assert "ImportError: pyzero was built with CUDA and needs NCCL (libnccl.so.2)" in err, err[-3000:]
    for place in ("PYZERO_NCCL_ROOT (not set)",
                  "the nvidia-nccl-cu13 package (not installed)",
                  "the system loader (LD_LIBRARY_PATH, ld.so.cache): libnccl.so.2: cannot open"):
        assert place in err, err[-3000:]
    assert "pip install nvidia-nccl-cu13" in err


def test_find_library_error_lists_places(monkeypatch):
    from pyzero import _loader
    monkeypatch.delenv("PYZERO_NCCL_ROOT", raising=False)
    with pytest.raises(ImportError) as e:
        _loader.find_library("libpyzero_absent.so.7")
    msg = str(e.value)
    assert "needs NCCL (libpyzero_absent.so.7), which was not found" in msg
    assert "PYZERO_NCCL_ROOT (not set)" in msg
    assert "the system loader (LD_LIBRARY_PATH, ld.so.cache): libpyzero_absent.so.7" in msg
    assert "the nvidia-nccl-cu13 package" in msg


def test_a_pyzero_nccl_root_without_the_library_is_an_error(monkeypatch, tmp_path):
    """The explicit choice is never silently replaced by another NCCL."""
    from pyzero import _loader
    monkeypatch.setenv("PYZERO_NCCL_ROOT", str(tmp_path))
    with pytest.raises(ImportError) as e:
        _loader.find_library()
    assert str(e.value).startswith(f"PYZERO_NCCL_ROOT={tmp_path}, but there is no {tmp_path / 'lib' / 'libnccl.so.2'}: "
                                   "point PYZERO_NCCL_ROOT at a folder with lib/libnccl.so.2, or unset it"), e.value
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libnccl.so.2").write_text("not a library")
    with pytest.raises(ImportError, match=f"PYZERO_NCCL_ROOT={tmp_path}: {tmp_path / 'lib' / 'libnccl.so.2'} does "
                                          "not load: .*(invalid ELF header|file too short)"):
        _loader.find_library()


# ---------------------------------------------------------------------------
# The GPU code in _C is for exactly the requested architectures


def _cuobjdump():
    """cuobjdump on PATH, in the CUDA toolkit, or from the nvidia-cuda-cuobjdump package; else None."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    import importlib.util
    places = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin"]
    spec = importlib.util.find_spec("nvidia")
    if spec is not None:
        places += [Path(d) / sub / "bin" for d in spec.submodule_search_locations for sub in ("cu13", "cu12")]
    for place in places:
        if os.access(place / "cuobjdump", os.X_OK):
            return str(place / "cuobjdump")
    return None


def test_cubins_are_the_requested_archs():
    _require_cuda_build()
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("needs cuobjdump (CUDA toolkit, or pip install nvidia-cuda-cuobjdump)")
    listing = subprocess.run([tool, "--list-elf", str(_extension())], capture_output=True, text=True,
                             check=True).stdout
    cubins = re.findall(r"\.sm_(\w+)\.cubin", listing)
    sources = sorted(p.name for p in (ROOT / "csrc").glob("*.cu"))  # one cubin per arch from each
    assert sorted(set(cubins)) == _expected_archs() == _C.build_info()["cuda_archs"], listing
    assert len(cubins) == len(_expected_archs()) * len(sources), (sources, listing)
