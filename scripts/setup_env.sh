#!/usr/bin/env bash
# Creates (or reuses) a virtual environment and builds pyzero into it (editable, without build
# isolation: everything the build needs is installed in the venv first, so a rerun needs no network).
# Used by scripts/demo.sh and scripts/test.sh; source it or run it. Sourced, it does the same work in a
# child bash, then activates the venv in your shell: your shell options (set -e ...) and directory are left
# as they were, and a failure returns non-zero instead of exiting your shell.
#   PYZERO_VENV  venv folder (default .venv, in the checkout)
#   PYZERO_TORCH torch requirement to install (default: keep the venv's torch if it has one,
#                else torch==2.13.0; any torch >= 2.4 works)
#   PYZERO_CUDA  0/1 to force the CUDA part off/on (default: on when nvcc is found)
#   PYTHON       interpreter that makes the venv (default python3)
if [ "${BASH_SOURCE[0]}" != "$0" ]; then  # (sourced)
  bash "${BASH_SOURCE[0]}" || return
  case ${PYZERO_VENV:-.venv} in
    /*) . "${PYZERO_VENV}/bin/activate" ;;
    *) . "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/${PYZERO_VENV:-.venv}/bin/activate" ;;
  esac
  return
fi
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${PYZERO_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
TORCH=()
if [ -n "${PYZERO_TORCH:-}" ]; then
  TORCH=("$PYZERO_TORCH")
elif ! python -c "import torch" 2>/dev/null; then
  TORCH=("torch==2.13.0")
fi
# Already satisfied requirements are not fetched again.
python -m pip install -q "${TORCH[@]}" "setuptools>=77" "pybind11>=2.12" "cmake>=3.24" ninja numpy pytest \
  matplotlib "nvidia-nccl-cu13; platform_system == 'Linux'" transformers==5.24.0 accelerate==1.15.0 \
  lightning==2.6.6 mkdocs==1.6.1
if [ "${PYZERO_CUDA:-}" != 0 ] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   ! command -v cuobjdump >/dev/null && [ ! -x /usr/local/cuda/bin/cuobjdump ] &&
   ! python -m pip show -q nvidia-cuda-cuobjdump >/dev/null 2>&1; then
  # cuobjdump lets the tests check the built GPU architectures; without it that test is skipped.
  python -m pip install -q nvidia-cuda-cuobjdump 2>/dev/null || echo "cuobjdump not installed: the cubin test will skip"
fi
python -m pip install -q --no-build-isolation -e .
python -c "import pyzero; print('pyzero', pyzero.__version__, pyzero.build_info())"
