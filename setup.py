"""Build pyzero._C with CMake + ninja (see CMakeLists.txt for the options)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def cuda_archs():
    """PYZERO_CUDA_ARCH ("80;90") or TORCH_CUDA_ARCH_LIST ("8.0 9.0+PTX") -> "80;90"."""
    arch = os.environ.get("PYZERO_CUDA_ARCH")
    if arch:
        return arch.replace(",", ";").replace(" ", ";")
    torch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if torch_list:
        archs = []
        for a in re.split(r"[;\s,]+", torch_list.strip()):
            if not a:
                continue
            m = re.fullmatch(r"(\d+)\.(\d+)([a-z]?)(\+PTX)?", a)
            if not m:
                raise SystemExit(f"TORCH_CUDA_ARCH_LIST: cannot read {a!r}; expected e.g. '8.0;9.0'")
            archs.append(f"{m.group(1)}{m.group(2)}{m.group(3)}")
        return ";".join(archs)
    return "80;90"


def nccl_root():
    """PYZERO_NCCL_ROOT, else the nvidia-nccl-cu13 package's folder, else "" (CMake searches on).
    The build needs only include/nccl.h: _C opens lib/libnccl.so.2 at import (pyzero/_loader.py)."""
    root = os.environ.get("PYZERO_NCCL_ROOT")
    if root:
        if not (Path(root) / "include" / "nccl.h").exists():
            raise SystemExit(f"PYZERO_NCCL_ROOT={root} has no include/nccl.h: point it at an NCCL install "
                             "(include/nccl.h; import pyzero opens its lib/libnccl.so.2 while the variable is "
                             "set), or unset it to use the nvidia-nccl-cu13 package (pip install nvidia-nccl-cu13)")
        return root
    try:
        import nvidia.nccl as nccl  # noqa: PLC0415
    except ImportError:
        return ""
    return str(Path(list(nccl.__path__)[0]))


def find_nvcc(environ=os.environ, default="/usr/local/cuda/bin/nvcc"):
    """(nvcc path or None, where it was looked for): CUDACXX, CUDA_HOME, PATH, then `default`."""
    cudacxx = environ.get("CUDACXX")
    if cudacxx:
        if shutil.which(cudacxx):
            return shutil.which(cudacxx), []
        raise SystemExit(f"CUDACXX={cudacxx} is not an executable nvcc: point it at nvcc, unset it, "
                         "or build without CUDA (PYZERO_CUDA=0)")
    looked = []
    home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if home:
        looked.append(f"CUDA_HOME={home}")
        if os.access(Path(home) / "bin" / "nvcc", os.X_OK):
            return str(Path(home) / "bin" / "nvcc"), looked
    looked.append("PATH")
    on_path = shutil.which("nvcc", path=environ.get("PATH", ""))
    if on_path:
        return on_path, looked
    looked.append(default)
    if os.access(default, os.X_OK):
        return default, looked
    return None, looked


def cuda_mode():
    """PYZERO_CUDA -> "ON" (nvcc found; CUDACXX set to it) or "OFF"; SystemExit when asked for without nvcc."""
    flag = os.environ.get("PYZERO_CUDA", "").strip().lower()
    mode = {"": "AUTO", "auto": "AUTO", "1": "ON", "on": "ON", "0": "OFF", "off": "OFF"}.get(flag)
    if mode is None:
        raise SystemExit(f"PYZERO_CUDA={flag!r}: expected 0 (no CUDA), 1 (CUDA, needs nvcc) or unset (auto)")
    if mode == "OFF":
        return "OFF"
    nvcc, looked = find_nvcc()
    if nvcc is None:
        if mode == "ON":
            raise SystemExit(f"PYZERO_CUDA=1 but no nvcc was found (looked in {', '.join(looked)}): install "
                             "the CUDA toolkit (or pip install nvidia-cuda-nvcc) and set CUDACXX or CUDA_HOME "
                             "or put nvcc on PATH, or build without CUDA (PYZERO_CUDA=0)")
        return "OFF"
    os.environ["CUDACXX"] = nvcc
    return "ON"


def test_nccl_mode(cuda):
    """PYZERO_TEST_NCCL=1 -> "ON": also build the test NCCL library (a CUDA build only)."""
    flag = os.environ.get("PYZERO_TEST_NCCL", "").strip().lower()
    on = {"": False, "0": False, "off": False, "1": True, "on": True}.get(flag)
    if on is None:
        raise SystemExit(f"PYZERO_TEST_NCCL={flag!r}: expected 1 (also build the test NCCL library) or 0")
    if on and cuda != "ON":
        raise SystemExit("PYZERO_TEST_NCCL=1 needs the CUDA build (nvcc, PYZERO_CUDA unset or 1): the test NCCL "
                         "library runs the ipc backend's kernels; unset PYZERO_TEST_NCCL or build with CUDA")
    return "ON" if on else "OFF"


def build_tool(name, attr):
    """`name` (cmake, ninja) on PATH, else from the bin folder of its pip package (`attr`)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        bindir = getattr(__import__(name), attr)
    except (ImportError, AttributeError):
        raise SystemExit(f"pyzero's build needs {name}: pip install {name} (or put it on PATH)") from None
    return str(Path(bindir) / name)


class CMakeBuild(build_ext):
    def copy_extensions_to_source(self):
        """In-place builds replace the module atomically: running processes keep the old mapping."""
        for ext in self.extensions:
            rel = self.get_ext_filename(ext.name)
            built, dest = Path(self.build_lib) / rel, ROOT / rel
            tmp = dest.with_suffix(".tmp")
            shutil.copyfile(built, tmp)
            os.chmod(tmp, 0o755)
            os.replace(tmp, dest)
            config = built.parent / "_build_config.py"  # written by CMake beside _C
            shutil.copyfile(config, dest.parent / config.name)

    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = ROOT / "build" / f"cmake-py{sys.version_info.major}{sys.version_info.minor}"
        build_dir.mkdir(parents=True, exist_ok=True)
        # CMake writes _C into a folder of its own, copied to out_dir below: out_dir is a new
        # temporary folder for every editable install, and building into it would relink _C.
        lib_dir = build_dir / "lib"
        cuda = cuda_mode()
        import pybind11  # noqa: PLC0415

        cmake = build_tool("cmake", "CMAKE_BIN_DIR")
        cfg = [
            cmake, "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={build_tool('ninja', 'BIN_DIR')}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={lib_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPYZERO_CUDA={cuda}",
            f"-DPYZERO_CUDA_ARCH={cuda_archs()}",
            f"-DPYZERO_NCCL_ROOT={nccl_root() if cuda == 'ON' else ''}",
            f"-DPYZERO_TEST_NCCL={test_nccl_mode(cuda)}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        for step in (cfg, [cmake, "--build", str(build_dir), "-j", jobs]):
            if subprocess.run(step).returncode != 0:
                raise SystemExit(f"pyzero: `cmake {step[1]}` failed; its message is above")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in (Path(self.get_ext_filename(ext.name)).name, "_build_config.py"):
            shutil.copyfile(lib_dir / name, out_dir / name)


setup(ext_modules=[Extension("pyzero._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
