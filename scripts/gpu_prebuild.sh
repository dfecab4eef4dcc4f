#!/usr/bin/env bash
# Builds, on a machine without a GPU, what scripts/gpu_check.sh needs on a GPU machine to skip its build
# (GPU_CHECK_PREBUILT=<OUT>): pyzero's _C for the GPU machine's Python and architecture and the test
# NCCL library (csrc/test_nccl/: the nccl backend at 2-8 ranks on one GPU), plus the wheel of
# pytest-timeout, which such a machine may lack. Everything lands in OUT (default build/gpu312):
#   OUT/lib/_C*.so, OUT/lib/_build_config.py   the extension module (gpu_check.sh copies it into pyzero/)
#   OUT/test-nccl/                              the test NCCL library (PYZERO_NCCL_ROOT layout)
#   OUT/wheels/                                 pytest-timeout (the GPU tests' per-test time limit)
# and, with DEEPSPEED=1, build/wheels/ (scripts/gpu_wheels.sh: DeepSpeed for the ZeRO-Offload rows).
# Needs nvcc (/usr/local/cuda), pip with a package index, and an interpreter of the GPU machine's Python
# version (GPU_PYTHON, default /root/.pyenv/versions/3.12.1/bin/python); PYZERO_CUDA_ARCH (default 90:
# H100/H200) picks the architecture. The build took 52 s on 2 cores (the venv's first set-up adds its pip
# installs). Then, on the GPU machine:
#   GPU_CHECK_PREBUILT=build/gpu312 GPU_CHECK_PARTS="..." bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_PYTHON=${GPU_PYTHON:-/root/.pyenv/versions/3.12.1/bin/python}
OUT=${OUT:-build/gpu312}
ARCH=${PYZERO_CUDA_ARCH:-90}
[ -x "$GPU_PYTHON" ] || { echo "gpu_prebuild.sh: no interpreter at $GPU_PYTHON; set GPU_PYTHON"; exit 1; }
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
VENV=$OUT/venv
if [ ! -x "$VENV/bin/python" ]; then
  "$GPU_PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q pybind11 cmake ninja nvidia-nccl-cu13
fi
PY=$VENV/bin/python
NCCL_ROOT=${PYZERO_NCCL_ROOT:-$("$PY" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])')}
LIB=$OUT/lib
"$VENV/bin/cmake" -S . -B "$OUT" -G Ninja -DCMAKE_MAKE_PROGRAM="$VENV/bin/ninja" \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$LIB" -DPython_EXECUTABLE="$PY" \
  -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DPYZERO_CUDA=ON -DPYZERO_CUDA_ARCH="$ARCH" -DPYZERO_TEST_NCCL=ON -DPYZERO_NCCL_ROOT="$NCCL_ROOT" \
  -DCMAKE_BUILD_TYPE=Release > "$OUT/configure.log"
"$VENV/bin/cmake" --build "$OUT" -j "$(nproc)"  # (the test NCCL library: $OUT/test-nccl)
[ -e "$OUT/test-nccl/lib/libnccl.so.2" ] || { echo "gpu_prebuild.sh: the build made no test NCCL library"; exit 1; }
mkdir -p "$OUT/wheels"
"$VENV/bin/pip" download -q --no-deps -d "$OUT/wheels" pytest-timeout
if [ "${DEEPSPEED:-0}" = 1 ]; then  # DeepSpeed's wheels for its rows (offload, capacity): build/wheels
  PYTHON="$PY" PYZERO_WHEEL_PY="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" bash scripts/gpu_wheels.sh
fi
du -sh "$LIB" "$OUT/test-nccl" "$OUT/wheels"
echo "gpu_prebuild.sh: carry $OUT/lib, $OUT/test-nccl and $OUT/wheels$([ "${DEEPSPEED:-0}" = 1 ] && echo " and build/wheels")" \
  "to the GPU machine"
