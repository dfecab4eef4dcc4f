#!/usr/bin/env bash
# Fresh machine to test results: make the venv, build pyzero (with CUDA when nvcc is
# there), run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source scripts/setup_env.sh
python -m pytest -q -p no:cacheprovider "$@"
