#!/usr/bin/env bash
# Wheels for a GPU machine that reaches no package index: DeepSpeed (for the DeepSpeed rows of
# `pyzero-bench train`, see pyzero/bench/ds_runs.py) and what it needs beyond torch, numpy and
# ninja, for CPython ${PYZERO_WHEEL_PY:-3.12} on manylinux x86_64. Run it on a machine with an index;
# it writes build/wheels/ (about 6 MB). scripts/gpu_check.sh installs them from there, without an
# index, into build/dsenv when deepspeed is not importable, and DeepSpeed builds its CPUAdam with the
# machine's ninja and compiler on first use.
#   bash scripts/gpu_wheels.sh            # then copy build/wheels/ beside the checkout on the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PYV=${PYZERO_WHEEL_PY:-3.12}
DS=${PYZERO_DEEPSPEED:-deepspeed==0.19.8}
OUT=build/wheels
rm -rf "$OUT" && mkdir -p "$OUT"
# deepspeed is published as a source archive: built here without its ops (DS_BUILD_OPS=0, pure Python).
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$OUT" "$DS"
"$PY" -m pip download -q --only-binary=:all: --no-deps --implementation cp --python-version "$PYV" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$OUT" py-cpuinfo hjson pydantic pydantic-core annotated-types typing-inspection msgpack einops psutil tqdm
ls "$OUT"
