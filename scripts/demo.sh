#!/usr/bin/env bash
# Fresh machine to the main job on CPU processes: make the venv, build pyzero, train a
# small model with ZeRO on 2 ranks (checked against one process), then print the
# nccl-tests style all_reduce table, pyzero beside torch.distributed (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source scripts/setup_env.sh
python -m pyzero.demo --nproc "${NPROC:-2}"
pyzero-bench collectives --op all_reduce --min 8 --max 16M --factor 4 --nproc "${NPROC:-2}" --iters 10 --warmup 2
