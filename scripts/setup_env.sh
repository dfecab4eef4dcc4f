#!/usr/bin/env bash
# Creates (or reuses) a virtual environment and builds pyzero into it (editable).
# Used by scripts/demo.sh and scripts/test.sh; source it or run it.
#   PYZERO_VENV  venv folder (default .venv)
#   PYZERO_TORCH torch requirement (default torch==2.13.0; any torch >= 2.4 works)
#   PYZERO_CUDA  0/1 to force the CUDA part off/on (default: on when nvcc is found)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${PYZERO_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q "${PYZERO_TORCH:-torch==2.13.0}" "setuptools>=68" wheel "pybind11>=2.12" \
  "cmake>=3.24" ninja numpy pytest matplotlib "nvidia-nccl-cu13; platform_system == 'Linux'"
python -m pip install -q --no-build-isolation -e .
python -c "import pyzero; print('pyzero', pyzero.__version__, pyzero.build_info())"
