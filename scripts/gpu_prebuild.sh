#!/usr/bin/env bash
# Builds, on a machine without a GPU, what scripts/gpu_check.sh needs on a GPU machine to skip its build
# (GPU_CHECK_PREBUILT=<DIR>): pyzero's _C for the GPU machine's Python and architecture and the test
# NCCL library (csrc/test_nccl/: the nccl backend at 2-8 ranks on one GPU), plus the wheel of
# pytest-timeout, which such a machine may lack. Everything lands in DIR (GPU_PREBUILD_OUT, default
# build/gpu312; a variable of its own: an OUT in the environment, such as a runner's output folder, is
# not read):
#   DIR/lib/_C*.so, DIR/lib/_build_config.py   the extension module (gpu_check.sh copies it into pyzero/)
#   DIR/test-nccl/                              the test NCCL library (PYZERO_NCCL_ROOT layout)
#   DIR/wheels/                                 pytest-timeout (the GPU tests' per-test time limit)
# and, with DEEPSPEED=1, build/wheels/ (scripts/gpu_wheels.sh: DeepSpeed for the ZeRO-Offload rows).
# Needs nvcc (/usr/local/cuda), pip with a package index, and an interpreter of the GPU machine's Python
# version (GPU_PYTHON, default /root/.pyenv/versions/3.12.1/bin/python); PYZERO_CUDA_ARCH (default 90:
# H100/H200) picks the architecture. The build took 52 s on 2 cores (the venv's first set-up adds its pip
# installs). It runs here, never on the GPU machine; there, with DIR copied beside the checkout:
#   GPU_CHECK_PREBUILT=build/gpu312 GPU_CHECK_PARTS="..." bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.." || exit 1
GPU_PYTHON=${GPU_PYTHON:-/root/.pyenv/versions/3.12.1/bin/python}
DEST=${GPU_PREBUILD_OUT:-build/gpu312}
ARCH=${PYZERO_CUDA_ARCH:-90}
[ -x "$GPU_PYTHON" ] || { echo "gpu_prebuild.sh: no interpreter at $GPU_PYTHON; set GPU_PYTHON"; exit 1; }
mkdir -p "$DEST" && DEST=$(cd "$DEST" && pwd)
VENV=$DEST/venv
if [ ! -x "$VENV/bin/python" ]; then
  "$GPU_PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q pybind11 cmake ninja nvidia-nccl-cu13
fi
PY=$VENV/bin/python
NCCL_ROOT=${PYZERO_NCCL_ROOT:-$("$PY" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])')}
LIB=$DEST/lib
"$VENV/bin/cmake" -S . -B "$DEST" -G Ninja -DCMAKE_MAKE_PROGRAM="$VENV/bin/ninja" \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$LIB" -DPython_EXECUTABLE="$PY" \
  -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DPYZERO_CUDA=ON -DPYZERO_CUDA_ARCH="$ARCH" -DPYZERO_TEST_NCCL=ON -DPYZERO_NCCL_ROOT="$NCCL_ROOT" \
  -DCMAKE_BUILD_TYPE=Release > "$DEST/configure.log"
"$VENV/bin/cmake" --build "$DEST" -j "$(nproc)"  # (the test NCCL library: $DEST/test-nccl)
[ -e "$DEST/test-nccl/lib/libnccl.so.2" ] || { echo "gpu_prebuild.sh: the build made no test NCCL library"; exit 1; }
mkdir -p "$DEST/wheels"
"$VENV/bin/pip" download -q --no-deps -d "$DEST/wheels" pytest-timeout
if [ "${DEEPSPEED:-0}" = 1 ]; then  # DeepSpeed's wheels for its rows (offload, capacity): build/wheels
  PYTHON="$PY" PYZERO_WHEEL_PY="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" bash scripts/gpu_wheels.sh
fi
du -sh "$LIB" "$DEST/test-nccl" "$DEST/wheels"
echo "gpu_prebuild.sh: carry $DEST/lib, $DEST/test-nccl and $DEST/wheels$([ "${DEEPSPEED:-0}" = 1 ] && echo " and build/wheels")" \
  "to the GPU machine"
