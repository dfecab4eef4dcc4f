#!/usr/bin/env bash
# Builds the test NCCL library (csrc/test_nccl/: NCCL's C API over pyzero's ipc transport, so that
# 2-16 processes sharing one GPU form a communicator) and lays it out as an NCCL install:
#   OUT/lib/libnccl.so.2, OUT/include/nccl.h     (OUT: the argument, default build/test-nccl)
# PYZERO_NCCL_ROOT=OUT then makes pyzero load it instead of NCCL (a test harness: never by default).
# Needs nvcc, cmake, ninja, pybind11 and the real nccl.h (the nvidia-nccl-cu13 package of $PYTHON, or
# PYZERO_NCCL_HEADERS=<folder with include/nccl.h>). Architectures: PYZERO_CUDA_ARCH (e.g. "90"),
# else the local GPU's, else 80;90. Builds only the library (its CMake target), in build/test-nccl-cmake.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:-$ROOT/build/test-nccl}" && cd "${1:-$ROOT/build/test-nccl}" && pwd)
PY=${PYTHON:-python3}
BD=${PYZERO_TEST_NCCL_BUILD:-$ROOT/build/test-nccl-cmake}
ARCH=${PYZERO_CUDA_ARCH:-}
if [ -z "$ARCH" ] && command -v nvidia-smi >/dev/null; then
  ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
fi
ARCH=${ARCH:-80;90}
HEADERS=${PYZERO_NCCL_HEADERS:-$("$PY" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)}
[ -f "$HEADERS/include/nccl.h" ] || { echo "build_test_nccl.sh: no nccl.h: pip install nvidia-nccl-cu13 for $PY, or set" \
  "PYZERO_NCCL_HEADERS to a folder with include/nccl.h"; exit 1; }
mkdir -p "$BD"
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
cmake -S "$ROOT" -B "$BD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPYZERO_CUDA=ON -DPYZERO_TEST_NCCL=ON \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DPYZERO_CUDA_ARCH="$ARCH" -DPYZERO_NCCL_ROOT="$HEADERS" \
  -DPython_EXECUTABLE="$(command -v "$PY")" -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$BD/lib" >"$BD/configure.log" 2>&1 || { cat "$BD/configure.log"; exit 1; }
cmake --build "$BD" --target pz_test_nccl -j "$(nproc)"
mkdir -p "$OUT/lib" "$OUT/include"
cp -L "$BD/test-nccl/lib/libnccl.so.2" "$OUT/lib/libnccl.so.2.tmp" && mv -f "$OUT/lib/libnccl.so.2.tmp" "$OUT/lib/libnccl.so.2"
cp "$BD/test-nccl/include/nccl.h" "$OUT/include/nccl.h"
echo "test NCCL library (archs $ARCH): $OUT/lib/libnccl.so.2; use it with PYZERO_NCCL_ROOT=$OUT"
