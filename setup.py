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
    """The nvidia-nccl-cu13 wheel's folder, when installed."""
    if os.environ.get("PYZERO_NCCL_ROOT"):
        return os.environ["PYZERO_NCCL_ROOT"]
    try:
        import nvidia.nccl as nccl  # noqa: PLC0415
    except ImportError:
        return ""
    return str(Path(list(nccl.__path__)[0]))


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

    def build_extension(self, ext):
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = ROOT / "build" / f"cmake-py{sys.version_info.major}{sys.version_info.minor}"
        build_dir.mkdir(parents=True, exist_ok=True)
        flag = os.environ.get("PYZERO_CUDA", "").strip().lower()
        cuda = {"": "AUTO", "auto": "AUTO", "1": "ON", "on": "ON", "0": "OFF", "off": "OFF"}.get(flag)
        if cuda is None:
            raise SystemExit(f"PYZERO_CUDA={flag!r}: expected 0 or 1")
        if cuda != "OFF" and not os.environ.get("CUDACXX"):
            for nvcc in ("/usr/local/cuda/bin/nvcc",):
                if Path(nvcc).exists():
                    os.environ["CUDACXX"] = nvcc
        import pybind11  # noqa: PLC0415

        cfg = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPYZERO_CUDA={cuda}",
            f"-DPYZERO_CUDA_ARCH={cuda_archs()}",
            f"-DPYZERO_NCCL_ROOT={nccl_root()}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        subprocess.run(cfg, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True)


setup(ext_modules=[Extension("pyzero._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
