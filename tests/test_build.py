"""How pyzero._C was built, and setup.py's CUDA arch parsing."""
import ast
import os
import re
import shutil
from pathlib import Path

import pytest

import pyzero
from pyzero import _C

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
