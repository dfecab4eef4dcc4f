#!/usr/bin/env bash
# GPU checks, in one command, on a machine with at least one CUDA GPU:
#   builds pyzero from source with nvcc for the local GPU's architecture, runs the
#   GPU tests (pytest -m gpu: kernels, the nccl backend at world size 1 and, with
#   2+ GPUs, at world size = GPU count, the ipc backend with 2-4 processes on GPU 0)
#   and the GPU benches (kernels; collectives on every GPU: pyzero ring, native NCCL
#   passthrough, torch; the ipc backend at 1 and 2 processes; fault cells on ipc; the nccl backend at 2 and 4
#   processes on GPU 0 through the test NCCL library), and writes what they printed,
#   plus a JSON record, to benchmarks/results/gpu_<gpu name>_<date>.{txt,json}.
# Works offline: it downloads nothing. It uses the current Python environment (PYTHON, default
# python3), which must already have torch with CUDA, setuptools>=77 (torch >= 2.13 brings it),
# pybind11, cmake, ninja, nvidia-nccl-cu13 (or PYZERO_NCCL_ROOT) and pytest, and nvcc (CUDACXX,
# CUDA_HOME, PATH or /usr/local/cuda). The build is in place (pyzero/_C*.so), installs nothing,
# and is run from this checkout with PYTHONPATH=.
# Exit status: 0 when every step of every named part passed; 1 when any failed or ran past its limit (the
# remaining parts still run, and the last lines name the parts that failed); 2 for a bad setting (refused
# before anything runs); 130 when interrupted (Ctrl-C stops the running step, and the MPS daemon).
set -euo pipefail
cd "$(dirname "$0")/.." || exit 1
usage_error() { echo "gpu_check.sh: $*" >&2; exit 2; }
ALL_PARTS="tests kernels collectives train torch-backend memory offload capacity ipc ipc-graph ipc-algos faults nccl-multi
nccl-faults"
PARTS=" $(echo ${GPU_CHECK_PARTS:-tests kernels collectives train offload ipc faults nccl-multi}) "
for p in $PARTS; do
  [[ " $(echo $ALL_PARTS) " == *" $p "* ]] || usage_error "GPU_CHECK_PARTS: unknown part '$p'; expected some of:" \
    $ALL_PARTS
done
[[ "${GPU_CHECK_DEADLINE:-0}" =~ ^[0-9]+$ ]] || usage_error "GPU_CHECK_DEADLINE: expected whole seconds, got" \
  "'$GPU_CHECK_DEADLINE'"
ROUNDS=${GPU_CHECK_ROUNDS:-1}
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || usage_error "GPU_CHECK_ROUNDS: expected a count >= 1, got '$ROUNDS'"
# GPU_CHECK_SCALE multiplies every time limit: a positive number, up to 3 decimals (1.5, 0.25); kept in thousandths
SCALE_MILLI=0
if [[ "${GPU_CHECK_SCALE:-1}" =~ ^([0-9]{1,6})(\.([0-9]{1,3}))?$ ]]; then
  frac=${BASH_REMATCH[3]}000
  SCALE_MILLI=$(( 10#${BASH_REMATCH[1]} * 1000 + 10#${frac:0:3} ))
fi
[ "$SCALE_MILLI" -gt 0 ] || usage_error "GPU_CHECK_SCALE: expected a positive number such as 2 or 1.5, got" \
  "'$GPU_CHECK_SCALE'"
# (the script starts and stops its own MPS daemon, in a folder of its own: none from the environment)
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "gpu_check.sh: no $PY; set PYTHON to your interpreter"; exit 1; }
"$PY" - <<'PY'
import importlib.util, os, sys
missing = [m for m in ("torch", "setuptools", "pybind11", "cmake", "ninja", "pytest")
           if importlib.util.find_spec(m) is None]
try:
    nccl = importlib.util.find_spec("nvidia.nccl")
except ImportError:  # no nvidia namespace package at all
    nccl = None
if not os.environ.get("PYZERO_NCCL_ROOT") and nccl is None:
    missing.append("nvidia-nccl-cu13 (or set PYZERO_NCCL_ROOT)")
if missing:
    sys.exit(f"gpu_check.sh: {sys.executable} lacks {', '.join(missing)}; install them (this script "
             "downloads nothing)")
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check.sh: no CUDA GPU visible to torch {torch.__version__}")
PY
ARCH=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}')")
GPU=$("$PY" -c "import torch, re; print(re.sub(r'[^A-Za-z0-9]+', '_', torch.cuda.get_device_name(0)).strip('_'))")
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
STAMP=$(date -u +%Y%m%d)
# (a second run on the same day takes the next free name: ..._<date>b, c, ... z; a record is never overwritten:
# with all 26 taken the script refuses to run)
RESULTS=${GPU_CHECK_RESULTS:-benchmarks/results}  # (where the record goes)
BASE=$RESULTS/gpu_${GPU}_${STAMP}
OUT=""
for s in "" b c d e f g h i j k l m n o p q r s t u v w x y z; do
  [ -e "$BASE$s.txt" ] || { OUT=$BASE$s; break; }
done
[ -n "$OUT" ] || { echo "gpu_check.sh: ${BASE}.txt and ${BASE}b-z.txt are all taken; move some away (a record is" \
  "never overwritten)"; exit 1; }
mkdir -p "$RESULTS"
# This run's scratch folder (the MPS daemon's folders, the list of failed steps), removed at the end; an MPS
# daemon still running there then (the run was killed mid-part) is stopped first.
RUN_TMP=$(mktemp -d /tmp/pyzero-gpu-check.XXXXXX)
cleanup() {
  if [ -e "$RUN_TMP/mps-pipe/control" ] && command -v nvidia-cuda-mps-control >/dev/null; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$RUN_TMP/mps-pipe timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1 || true
  fi
  rm -rf "$RUN_TMP"
}
trap cleanup EXIT
PROFILE_ARGS=()  # (GPU_CHECK_PROFILE=1: the training runs' step profiles beside the record)
[ "${GPU_CHECK_PROFILE:-0}" = 0 ] || PROFILE_ARGS=(--profile "${OUT}_profile")
export PYZERO_CUDA=1 PYZERO_CUDA_ARCH="$ARCH" PYTHONPATH=.
part() { [[ "$PARTS" == *" $1 "* ]]; }
# nccl-multi: the build also makes the test NCCL library (csrc/test_nccl/; the CUDA objects are _C's).
if part nccl-multi || part nccl-faults; then export PYZERO_TEST_NCCL=1; fi
# setup.py drives CMake; a setuptools older than 77 cannot read pyproject.toml's license field, so
# then the same CMake configure + build runs directly (the module lands in pyzero/ either way).
build() {
  if "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)"; then
    "$PY" setup.py build_ext --inplace
  else
    echo "setuptools < 77: building with CMake directly"
    local bd=build/gpu-check lib
    lib=$(pwd)/$bd/lib
    cmake -S . -B "$bd" -G Ninja -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$lib" -DPython_EXECUTABLE="$(command -v "$PY")" \
      -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" -DPYZERO_CUDA=ON \
      -DPYZERO_CUDA_ARCH="$ARCH" -DPYZERO_TEST_NCCL="${PYZERO_TEST_NCCL:-0}" -DPYZERO_NCCL_ROOT="${PYZERO_NCCL_ROOT:-$("$PY" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])')}" \
      -DCMAKE_BUILD_TYPE=Release && cmake --build "$bd" -j "$(nproc)" && cp "$lib"/_C*.so "$lib"/_build_config.py pyzero/
  fi
}
SECONDS=0
# GPU_CHECK_PREBUILT=<dir> (what scripts/gpu_prebuild.sh makes on a machine without a GPU): its lib/_C*.so
# goes into pyzero/ and is used as GPU_CHECK_BUILD=0 uses one, its test-nccl/ is the test NCCL library, and
# its wheels/ (pytest-timeout) are installed into a temporary folder on PYTHONPATH when not importable.
if [ -n "${GPU_CHECK_PREBUILT:-}" ]; then
  cp "$GPU_CHECK_PREBUILT"/lib/_C*.so "$GPU_CHECK_PREBUILT"/lib/_build_config.py pyzero/
  GPU_CHECK_BUILD=0
  [ -n "${PYZERO_TEST_NCCL_ROOT:-}" ] || [ ! -d "$GPU_CHECK_PREBUILT/test-nccl" ] ||
    PYZERO_TEST_NCCL_ROOT=$(cd "$GPU_CHECK_PREBUILT/test-nccl" && pwd)
  if ! "$PY" -c "import pytest_timeout" 2>/dev/null && ls "$GPU_CHECK_PREBUILT"/wheels/*.whl >/dev/null 2>&1; then
    EXTRA=$(mktemp -d) && "$PY" -m pip install -q --no-index --no-deps --target "$EXTRA" \
      "$GPU_CHECK_PREBUILT"/wheels/*.whl && export PYTHONPATH=".:$EXTRA"
  fi
fi
# GPU_CHECK_BUILD=0: use the pyzero/_C already there (e.g. built on another machine for this Python and
# architecture, with PYZERO_TEST_NCCL=1 for nccl-multi) when it imports with CUDA for this GPU; else build.
if [ "${GPU_CHECK_BUILD:-1}" = 0 ] && "$PY" -c "import sys, pyzero; i = pyzero.build_info(); \
sys.exit(0 if i['cuda'] and '$ARCH' in i['cuda_archs'] else 1)" 2>/dev/null; then
  echo "using the pyzero/_C already built (GPU_CHECK_BUILD=0)"
else
  build > "${OUT}_build.log" 2>&1 || { tail -40 "${OUT}_build.log"; exit 1; }
  echo "built in ${SECONDS} s"
fi
# GPU_CHECK_PARTS names the parts, run in the order named (default: tests kernels collectives train offload ipc
# faults nccl-multi); these run only when named: capacity, memory (per-rank peaks with GPU_CHECK_MEMORY_NPROC
# processes on GPU 0, default "1 2 4": 1 is world size 1 with plain torch and ZeRO-1 beside them), ipc-graph
# (the ipc all_reduce at 2 processes, eager and captured in CUDA graphs; the ipc part includes it), ipc-algos
# (all_reduce by algorithm, ring / one-shot / two-shot, at 2, 4 and 8 processes on GPU 0), torch-backend
# (world size 1: torch.distributed's "pyzero" backend against NCCL, an 8 B - 1 MiB all_reduce and GPT-2 small
# under DDP and FSDP2, with pz.DataParallel beside them) and nccl-faults (nccl-multi's fault cells alone).
# capacity (the largest GPT that trains with and without offload; minutes, host-memory bound): GPU_CHECK_CAPACITY_RUNS
# replaces its runs, GPU_CHECK_CAPACITY_NPROC adds ZeRO-3 and FSDP2 with that many ranks sharing GPU 0.
# GPU_CHECK_OFFLOAD_THREADS (e.g. 8): the offload part's pyzero rows again with that many CPU optimizer threads.
# GPU_CHECK_ROUNDS (default 1): the train and torch-backend parts' training runs that many rounds, forward and
# backward in turn, each run in fresh processes (pyzero-bench train --rounds: medians, and each run's ratio to the
# first run paired within rounds; their limits grow with it): for the targets within a few percent.
# GPU_CHECK_PROFILE=1: those training runs also profile one synced step each (pyzero-bench train --profile): how
# long the GPU waited for the host in it, the longest waits, the host's busiest operators; rank 0's Chrome traces
# in <record>_profile/.
# GPU_CHECK_TESTS replaces the pytest selection (default: -m gpu tests); GPU_CHECK_IPC the ipc bench
# runs (default "1:256M 2:64M 4:16M 8:4M": processes:largest size).
# Several processes on GPU 0 (the ipc part: its tests, benches and fault cells) run under MPS where
# nvidia-cuda-mps-control exists, so they run at once instead of taking turns for time slices (an ipc
# all_reduce at 2 processes took 19 us instead of 2.28 ms); the tests part then leaves the ipc tests,
# the "pyzero" torch backend's CUDA tests, torch.compile's on CUDA and the Hugging Face Trainer's on CUDA to the
# ipc part. The daemon is started for the part and stopped after it (GPU_CHECK_MPS=0: never).
# GPU_CHECK_TESTS_AT_ONCE=1 (with MPS): the tests part runs its groups at the same time, the single-process tests
# outside MPS, the several-processes tests (the ipc part's, and with nccl-multi named, that part's) under MPS; the
# later parts then do not run them again. On an H200 the three groups took 235-250 s together, and 240 s per
# group was too little for two of them (AT_ONCE_LIMIT).
# nccl-multi: tests/test_nccl_multirank_gpu.py (the nccl backend's GPU tests, DataParallel, ZeRO 1-3, TP,
# pipeline, the ordering-rule deadlocks, at 2 and 4 processes on GPU 0) and the nccl fault cells, through the
# test NCCL library (PYZERO_TEST_NCCL_ROOT, else one a build made in build/*/test-nccl, else
# scripts/build_test_nccl.sh).
TIMEOUT_ARGS=()
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARGS=(--timeout "${GPU_CHECK_TEST_TIMEOUT:-90}")
MULTI_TIMEOUT_ARGS=()  # (a spawned 4-rank matrix takes longer than one test of the tests part)
[ ${#TIMEOUT_ARGS[@]} -eq 0 ] || MULTI_TIMEOUT_ARGS=(--timeout "${GPU_CHECK_TEST_TIMEOUT:-300}")
PYTEST=("$PY" -m pytest -q -rfE --tb=short -p no:cacheprovider)
# Each part has a time limit (seconds; GPU_CHECK_SCALE multiplies them), so a part that hangs is
# reported while the rest still runs (a pytest part gets SIGINT at its limit: it prints its summary,
# writes its XML and kills the ranks of the test it was in). The limits of the default parts add up to
# about 30 minutes on one GPU (37 when the test NCCL library is built here); a session with less device
# time names the parts it needs (GPU_CHECK_PARTS), most valuable first, and GPU_CHECK_DEADLINE=<seconds>:
# the whole run then ends by then (counted from the build step): each step's limit is cut to the time left,
# and a part that has less than half its limit left is skipped, with a line saying so.
scaled() { echo $(( ($1 * SCALE_MILLI + 999) / 1000 )); }  # scaled SECONDS: times GPU_CHECK_SCALE, rounded up
lim() {
  local s
  s=$(scaled "$1")
  if [ "${GPU_CHECK_DEADLINE:-0}" -gt 0 ]; then
    local left=$(( GPU_CHECK_DEADLINE - SECONDS ))
    [ "$left" -ge "$s" ] || s=$left
    [ "$s" -ge 1 ] || s=1
  fi
  echo "$s"
}
room() {  # room PART SECONDS: false (and says so) when the deadline leaves less than half of SECONDS
  [ "${GPU_CHECK_DEADLINE:-0}" -gt 0 ] || return 0
  local want left=$(( GPU_CHECK_DEADLINE - SECONDS ))
  want=$(scaled "$2")
  [ $(( 2 * left )) -ge "$want" ] && return 0
  echo "## (skipped the $1 part: ${left} s left of GPU_CHECK_DEADLINE=${GPU_CHECK_DEADLINE}, its limit is ${want} s)"
  echo "$1" >> "$RUN_TMP/skipped"
  return 1
}
# Each step runs under `timeout`, started in the background and waited for: timeout moves the step into a
# process group of its own (so that at the limit the step's own processes, ranks included, are stopped too),
# which Ctrl-C at the terminal does not reach; the INT/TERM trap (on_interrupt) passes it on instead. A step
# that fails or runs past its limit is said (a line with FAILED) and recorded, the run goes on with the next
# step, and the script exits 1 at the end, naming the parts that failed.
STEP_PID="" STEP_LIMIT="" GROUP_PIDS=() CUR_PART=""
limited() {  # limited [-s SIGNAL] [-k SECONDS] SECONDS CMD...: CMD's exit status; 124 or 137 past the limit
  local a=("$@") i=0 rc=0
  while [[ "${a[i]}" == -* ]]; do i=$(( i + 2 )); done  # (each option takes a value)
  STEP_LIMIT=${a[i]}
  timeout -k 30 "$@" &
  STEP_PID=$!
  wait "$STEP_PID" || rc=$?
  STEP_PID=""
  return "$rc"
}
failed() {  # STEP || failed WHAT: says that WHAT failed, or ran past its limit, and records it for the summary
  local rc=$? how
  case $rc in
    124) how="past its ${STEP_LIMIT} s limit";;
    137) how="killed: past its ${STEP_LIMIT} s limit, or out of memory";;
    *) how="exit $rc";;
  esac
  echo "$1 FAILED ($how)"
  echo "${CUR_PART:-setup}: $1 ($how)" >> "$RUN_TMP/failed"
}
on_interrupt() {  # (the INT/TERM/HUP trap of the shells that run steps): stops the running step, then exits 130
  trap '' INT TERM HUP
  echo "(interrupted: stopping the running step)"
  echo "${CUR_PART:-setup}: interrupted" >> "$RUN_TMP/failed"
  local p
  [ -z "$STEP_PID" ] || kill -INT "$STEP_PID" 2>/dev/null || true  # (timeout passes it to the step's group)
  for p in "${GROUP_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  if [ -n "$STEP_PID" ]; then  # (at most 30 s: timeout -k 30 kills what is left)
    wait "$STEP_PID" 2>/dev/null || true
    kill -KILL -- "-$STEP_PID" 2>/dev/null || true  # (any of its processes that outlived it)
  fi
  for p in "${GROUP_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  exit 130
}
MPS=0
if [ "${GPU_CHECK_MPS:-1}" != 0 ] && command -v nvidia-cuda-mps-control >/dev/null; then MPS=1; fi
# The daemon's folders are this run's own (RUN_TMP, removed at the end): a daemon a killed run left behind is
# never talked to. CUDA_MPS_PIPE_DIRECTORY is set only while this run's daemon runs: steps outside MPS have none.
MPS_PIPE=$RUN_TMP/mps-pipe MPS_LOG=$RUN_TMP/mps-log
MPS_ON=0 MPS_FAILED=0
mps_start() {
  [ "$MPS" = 1 ] && [ "$MPS_ON" = 0 ] && [ "$MPS_FAILED" = 0 ] || return 0  # (started once: later parts find it)
  mkdir -p "$MPS_PIPE" "$MPS_LOG"
  if CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE CUDA_MPS_LOG_DIRECTORY=$MPS_LOG timeout 10 nvidia-cuda-mps-control -d; then
    export CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE CUDA_MPS_LOG_DIRECTORY=$MPS_LOG
    # (ready once the daemon's control pipe is there; at most 2 s, then on as before)
    for _ in $(seq 20); do [ -e "$MPS_PIPE/control" ] && break; sleep 0.1; done
    MPS_ON=1; echo "(MPS started)"
  else
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    MPS_FAILED=1
    echo "(MPS did not start: the processes on GPU 0 take turns instead; not tried again)"
    tail -5 "$MPS_LOG/control.log" 2>/dev/null || true
  fi
}
mps_stop() {  # (also: no MPS variables for what runs next, whether or not the daemon started)
  if [ "$MPS_ON" = 1 ]; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE CUDA_MPS_LOG_DIRECTORY=$MPS_LOG timeout 10 nvidia-cuda-mps-control ||
      true
    MPS_ON=0
    echo "(MPS stopped)"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
# DeepSpeed for its rows (offload, capacity): the installed one, else build/wheels (scripts/gpu_wheels.sh)
# installed into build/dsenv, which DSPATH then puts on those parts' PYTHONPATH. Its CPUAdam builds on
# first use (about a minute, not timed).
DSPATH=""
deepspeed_here() {
  "$PY" -c "import deepspeed" 2>/dev/null && return 0
  if [ -z "$DSPATH" ] && ls build/wheels/deepspeed-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target build/dsenv build/wheels/*.whl && DSPATH=$(pwd)/build/dsenv
  fi
  [ -n "$DSPATH" ] && PYTHONPATH=".:$DSPATH" "$PY" -c "import deepspeed" 2>/dev/null && return 0
  echo "(no deepspeed: its rows are left out; scripts/gpu_wheels.sh makes its wheels where there is a package index)"
  return 1
}
# The test NCCL library (nccl-multi, nccl-faults): found or built once, by the first part that needs it.
TNCCL=""
test_nccl() {
  [ -z "$TNCCL" ] || { [ -f "$TNCCL/lib/libnccl.so.2" ]; return; }
  TNCCL=${PYZERO_TEST_NCCL_ROOT:-$(ls -d build/*/test-nccl 2>/dev/null | head -1)}
  if [ -z "$TNCCL" ] || [ ! -f "$TNCCL/lib/libnccl.so.2" ]; then
    TNCCL=build/test-nccl
    echo "(building the test NCCL library into $TNCCL)"
    PYTHON="$PY" limited "$(lim 400)" bash scripts/build_test_nccl.sh "$TNCCL" >"${OUT}_test_nccl_build.log" 2>&1 ||
      { failed "TEST NCCL LIBRARY BUILD"; tail -20 "${OUT}_test_nccl_build.log"; }
  fi
  [ -f "$TNCCL/lib/libnccl.so.2" ] || return 1
  TNCCL=$(cd "$TNCCL" && pwd)
}
SEVERAL_TESTS=(tests/test_ipc_gpu.py tests/test_torch_backend_gpu.py tests/test_compile.py tests/test_integrations_gpu.py)
IPC_TESTS_RAN=0 MULTI_TESTS_RAN=0
nccl_multi_tests() {  # nccl_multi_tests LOG: the nccl backend at 2 and 4 processes through the test library
  PYZERO_TEST_NCCL_ROOT=$TNCCL limited -s INT "$(lim 420)" "${PYTEST[@]}" --durations=10 "${MULTI_TIMEOUT_ARGS[@]}" \
    --junitxml "${OUT}_tests_nccl_multi.xml" -m gpu tests/test_nccl_multirank_gpu.py || failed "NCCL-MULTI TESTS"
}
# The groups' limits: alone, the single-process tests took 201 s and the ipc ones 213 s on an H200; run at once
# they slow each other (235 s for all but 2 of the single-process tests, 238 s for 26 of the 32 ipc ones), so
# GPU_CHECK_TESTS_AT_ONCE=1 gives them AT_ONCE_LIMIT seconds each.
AT_ONCE_LIMIT=360
ipc_tests() {  # ipc_tests [LIMIT]
  local l=${1:-240}
  limited -s INT "$(lim "$l")" "${PYTEST[@]}" --durations=5 "${TIMEOUT_ARGS[@]}" --junitxml "${OUT}_tests_ipc.xml" \
    -m gpu "${SEVERAL_TESTS[@]}" || failed "IPC TESTS"
}
single_tests() {  # single_tests [LIMIT]: the tests part's pytest run, but for the IGNOREd files
  local l=${1:-240}
  # shellcheck disable=SC2086
  limited -s INT "$(lim "$l")" "${PYTEST[@]}" --durations=10 "${TIMEOUT_ARGS[@]}" --junitxml "${OUT}_tests.xml" \
    "${IGNORE[@]}" ${GPU_CHECK_TESTS:--m gpu tests} || failed "GPU TESTS"
}
part_tests() {
  room tests "$([ "${GPU_CHECK_TESTS_AT_ONCE:-0}" = 1 ] && echo "$AT_ONCE_LIMIT" || echo 240)" || return 0
  echo "## GPU tests"
  local at_once=0
  if [ "$MPS" = 1 ] && [ -z "${GPU_CHECK_TESTS:-}" ] && [ "${GPU_CHECK_TESTS_AT_ONCE:-0}" = 1 ]; then at_once=1; fi
  IGNORE=()
  if [ "$MPS" = 1 ] && [ -z "${GPU_CHECK_TESTS:-}" ] && { part ipc || [ "$at_once" = 1 ]; }; then
    for f in "${SEVERAL_TESTS[@]}"; do IGNORE+=(--ignore "$f"); done
  fi
  if [ "$at_once" = 0 ]; then
    mps_stop  # (single-process tests: alone on the GPU, outside MPS)
    single_tests
    return 0
  fi
  local multi=0 g
  if part nccl-multi && test_nccl; then multi=1; IGNORE+=(--ignore tests/test_nccl_multirank_gpu.py); fi
  echo "(three groups at once: single-process tests outside MPS; several processes on GPU 0 under MPS: the ipc part's" \
    "tests$([ "$multi" = 1 ] && echo ", the nccl-multi part's"))"
  mps_start
  # (each group in a subshell of its own: a TERM from on_interrupt stops its step)
  GROUP_PIDS=()
  ( GROUP_PIDS=(); trap on_interrupt TERM; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    single_tests "$AT_ONCE_LIMIT" ) > "${OUT}_tests_single.log" 2>&1 &
  GROUP_PIDS+=($!)
  ( GROUP_PIDS=(); trap on_interrupt TERM; ipc_tests "$AT_ONCE_LIMIT" ) > "${OUT}_tests_ipc.log" 2>&1 &
  GROUP_PIDS+=($!)
  if [ "$multi" = 1 ]; then
    ( GROUP_PIDS=(); trap on_interrupt TERM; nccl_multi_tests ) > "${OUT}_tests_nccl_multi.log" 2>&1 &
    GROUP_PIDS+=($!)
  fi
  wait "${GROUP_PIDS[@]}" || true  # (a group's failures are recorded by the group)
  GROUP_PIDS=()
  for g in single ipc nccl_multi; do
    [ -f "${OUT}_tests_$g.log" ] || continue
    echo "### tests: $g"; grep -v "^frame #" "${OUT}_tests_$g.log" || true; rm -f "${OUT}_tests_$g.log"
  done
  IPC_TESTS_RAN=1 MULTI_TESTS_RAN=$multi
}
part_kernels() {
  room kernels 30 || return 0
  echo "## reduce kernel bandwidth vs device-to-device copy"
  mps_stop  # (alone on the GPU)
  limited "$(lim 30)" "$PY" -m pyzero.bench.kernels --json "${OUT}_kernels.json" || failed "KERNEL BENCH"
}
part_collectives() {
  room collectives 75 || return 0
  echo "## collectives on ${NGPU} GPU(s): pyzero ring | pyzero native passthrough (nccl) | torch.distributed nccl"
  mps_stop
  # One GPU: world size 1 moves nothing between ranks, so only all_reduce (the per-call floor of each
  # path); the full matrix on 2+ GPUs. (On an H200 the full matrix at world size 1 took over 75 s.)
  local coll
  if [ "$NGPU" -ge 2 ]; then coll=(--op all --max 256M --factor 4); else coll=(--op all_reduce --max 64M --factor 8); fi
  limited "$(lim 45)" "$PY" -m pyzero.bench collectives --device cuda --nproc "${NGPU}" --backends pyzero,nccl,torch \
    --min 8 "${coll[@]}" --json "${OUT}_collectives.json" || failed "COLLECTIVES BENCH"
  echo "## all_reduce captured in a CUDA graph (20 calls per graph), per call: pyzero's nccl passthrough and torch's NCCL"
  limited "$(lim 30)" "$PY" -m pyzero.bench collectives --device cuda --nproc "${NGPU}" --backends nccl,torch \
    --op all_reduce --min 8 --max 1M --factor 8 --graph 20 --json "${OUT}_collectives_graph.json" \
    || failed "GRAPH BENCH"
}
part_train() {
  room train $(( 140 * ROUNDS )) || return 0
  echo "## training on GPU 0 (GPT-2 small, world size 1): plain torch + fused AdamW vs the wrappers"
  mps_stop
  # (about 15 s per run on an H200: 8 runs need about 120 s)
  CUDA_VISIBLE_DEVICES=0 limited "$(lim $(( 140 * ROUNDS )))" "$PY" -m pyzero.bench train --device cuda --nproc 1 \
    --model gpt2 --batch 8 --seq 512 \
    --runs torch-local,torch-ddp,dp,zero1,zero2,zero3,fsdp2,zero2-offload --bucket-mb 25 --first-bucket-mb 1 --iters 10 \
    --warmup 3 --rounds "$ROUNDS" "${PROFILE_ARGS[@]}" --json "${OUT}_train.json" || failed "TRAIN BENCH"
}
part_torch-backend() {
  room torch-backend $(( 30 + 120 * ROUNDS )) || return 0
  echo "## torch.distributed on the \"pyzero\" backend (CUDA tensors) against NCCL, world size 1"
  mps_stop
  CUDA_VISIBLE_DEVICES=0 limited "$(lim 30)" "$PY" -m pyzero.bench collectives --device cuda --nproc 1 \
    --backends torch,torch-pyzero --op all_reduce --min 8 --max 1M --factor 8 --json "${OUT}_torch_backend.json" \
    || failed "TORCH BACKEND BENCH"
  # (DataParallel beside them: its step against torch DDP's on NCCL, in the same run)
  CUDA_VISIBLE_DEVICES=0 limited "$(lim $(( 120 * ROUNDS )))" "$PY" -m pyzero.bench train --device cuda --nproc 1 \
    --model gpt2 --batch 8 --seq 512 --runs torch-ddp,torch-ddp-pyzero,dp,fsdp2,fsdp2-pyzero --bucket-mb 25 \
    --first-bucket-mb 1 --iters 10 --warmup 3 --rounds "$ROUNDS" "${PROFILE_ARGS[@]}" \
    --json "${OUT}_torch_backend_train.json" \
    || failed "TORCH BACKEND TRAIN"
}
part_memory() {
  local np
  for np in ${GPU_CHECK_MEMORY_NPROC:-1 2 4}; do
    if [ "$np" = 1 ]; then
      room "memory (nproc 1)" 180 || continue
      echo "## memory breakdown on GPU 0, world size 1 (GPT-2 small)"
      mps_stop
      CUDA_VISIBLE_DEVICES=0 limited "$(lim 180)" "$PY" -m pyzero.bench train --device cuda --nproc 1 --model gpt2 \
        --batch 8 --seq 512 --runs torch-local,torch-ddp,torch-ddp-pyzero,dp,zero1,zero2,zero3,fsdp2 --bucket-mb 25 \
        --first-bucket-mb 1 --iters 5 --warmup 2 --memory --json "${OUT}_memory1.json" || failed "MEMORY BENCH (nproc 1)"
      continue
    fi
    room "memory (nproc $np)" 150 || continue
    echo "## per-rank memory with $np processes on GPU 0 (ipc; torch runs on the 'pyzero' backend's CUDA path)$([ "$MPS" = 1 ] && echo ", under MPS")"
    mps_start
    CUDA_VISIBLE_DEVICES=0 limited "$(lim 150)" "$PY" -m pyzero.bench train --device cuda --gpu-backend ipc \
      --nproc "$np" --model gpt2 --batch 8 --seq 512 --runs torch-ddp,dp,zero2,zero3,fsdp2 --bucket-mb 25 \
      --first-bucket-mb 1 --iters 5 --warmup 2 --memory --json "${OUT}_memory${np}.json" \
      || failed "MEMORY BENCH (nproc $np)"
  done
  mps_stop
}
part_offload() {
  room offload 330 || return 0
  echo "## ZeRO-Offload on GPU 0 (GPT-2 small, world size 1): plain torch, pyzero, DeepSpeed (ZeRO-Offload, ZenFlow, SuperOffload)"
  mps_stop
  # --losses: every run's loss at each step (same batch, same start): ZenFlow is not exact, its curve shows by how much
  # zero2-offload: the CPU step slot by slot at step() (the default); -pipe: slots step during backward;
  # -dpu: delayed_update, the CPU step behind the next forward and backward (updates one step late)
  local runs=torch-local,zero2-offload,zero2-offload-pipe,zero2-offload-dpu
  if deepspeed_here; then runs+=",ds-zero2-offload,ds-zenflow,ds-superoffload"; fi
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=".${DSPATH:+:$DSPATH}" limited "$(lim 330)" "$PY" -m pyzero.bench train \
    --device cuda --nproc 1 --model gpt2 --batch 8 --seq 512 --runs "$runs" --bucket-mb 25 \
    --first-bucket-mb 1 --iters 10 --warmup 3 --losses --json "${OUT}_offload.json" \
    || failed "OFFLOAD BENCH"
  [ -n "${GPU_CHECK_OFFLOAD_THREADS:-}" ] || return 0
  room "offload (--offload-threads ${GPU_CHECK_OFFLOAD_THREADS})" 120 || return 0
  echo "### the same pyzero rows with ${GPU_CHECK_OFFLOAD_THREADS} CPU optimizer threads (--offload-threads)"
  CUDA_VISIBLE_DEVICES=0 limited "$(lim 120)" "$PY" -m pyzero.bench train --device cuda --nproc 1 --model gpt2 \
    --batch 8 --seq 512 --runs torch-local,zero2-offload,zero2-offload-pipe,zero2-offload-dpu --bucket-mb 25 \
    --first-bucket-mb 1 --iters 10 --warmup 3 --offload-threads "$GPU_CHECK_OFFLOAD_THREADS" \
    --json "${OUT}_offload_threads${GPU_CHECK_OFFLOAD_THREADS}.json" || failed "OFFLOAD THREADS BENCH"
}
part_capacity() {
  room capacity 420 || return 0
  echo "## capacity on GPU 0: the largest GPT (n_embd 2048, 1 x 1024 tokens) that trains, and its tokens/s"
  mps_stop
  local runs=torch,zero3,fsdp2,zero2-offload,zero3-offload np
  if [ -z "${GPU_CHECK_CAPACITY_RUNS:-}" ] && deepspeed_here; then runs+=",ds-zero2-offload"; fi
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=".${DSPATH:+:$DSPATH}" limited "$(lim 420)" "$PY" -m pyzero.bench capacity --device cuda \
    --runs "${GPU_CHECK_CAPACITY_RUNS:-$runs}" --attempts 2 --steps 3 --timeout 200 \
    --json "${OUT}_capacity.json" || failed "CAPACITY BENCH"
  # GPU_CHECK_CAPACITY_NPROC (e.g. "2"): ZeRO-3 and FSDP2 again with that many ranks sharing GPU 0 (ipc)
  for np in ${GPU_CHECK_CAPACITY_NPROC:-}; do
    room "capacity (nproc $np)" 300 || continue
    echo "### capacity with $np ranks on GPU 0 (ipc$([ "$MPS" = 1 ] && echo ", MPS")): ZeRO-3 and FSDP2 on the \"pyzero\" backend"
    mps_start
    CUDA_VISIBLE_DEVICES=0 limited "$(lim 300)" "$PY" -m pyzero.bench capacity --device cuda --nproc "$np" \
      --gpu-backend ipc --runs zero3,fsdp2 --attempts 2 --steps 3 --timeout 150 --json "${OUT}_capacity${np}.json" \
      || failed "CAPACITY BENCH (nproc $np)"
    mps_stop
  done
}
part_ipc-graph() {
  room ipc-graph 50 || return 0
  echo "### ipc all_reduce at 2 processes: eager, then 20 calls captured in a CUDA graph, per call (16 B - 1 MiB)"
  mps_start
  local g
  for g in 0 20; do
    CUDA_VISIBLE_DEVICES=0 limited "$(lim 25)" "$PY" -m pyzero.bench collectives --device cuda --gpu-backend ipc \
      --nproc 2 --backends pyzero --op all_reduce --min 16 --max 1M --factor 4 --graph "$g" \
      --json "${OUT}_ipc2_graph${g}.json" || failed "IPC GRAPH BENCH (graph $g)"
  done
}
part_ipc() {
  room ipc 120 || return 0
  echo "## ipc backend (pyzero's CUDA-IPC kernels): 1 process, then 2, 4 and 8 sharing GPU 0$([ "$MPS" = 1 ] && echo ", under MPS")"
  mps_start
  if [ "$MPS" = 1 ] && [ -z "${GPU_CHECK_TESTS:-}" ] && [ "$IPC_TESTS_RAN" = 0 ]; then
    echo "### ipc tests, the \"pyzero\" torch backend on CUDA tensors, torch.compile and the HF Trainer on CUDA (2-4 processes on GPU 0)"
    ipc_tests
  fi
  local np_max np max
  for np_max in ${GPU_CHECK_IPC:-1:256M 2:64M 4:16M 8:4M}; do
    np=${np_max%%:*} max=${np_max##*:}
    CUDA_VISIBLE_DEVICES=0 limited "$(lim 30)" "$PY" -m pyzero.bench collectives --device cuda --gpu-backend ipc \
      --nproc "$np" --backends pyzero --op all --min 8 --max "$max" --factor 8 --json "${OUT}_ipc${np}.json" \
      || failed "IPC BENCH (nproc $np)"
  done
  part ipc-graph || part_ipc-graph
  echo "### ipc point-to-point (sendrecv: each process sends to the next and receives from the previous, one batch)"
  for np_max in 2:256M 4:64M; do
    np=${np_max%%:*} max=${np_max##*:}
    CUDA_VISIBLE_DEVICES=0 limited "$(lim 30)" "$PY" -m pyzero.bench collectives --device cuda --gpu-backend ipc \
      --nproc "$np" --backends pyzero --op sendrecv --min 8 --max "$max" --factor 8 \
      --json "${OUT}_ipc${np}_sendrecv.json" || failed "IPC SENDRECV BENCH (nproc $np)"
  done
}
part_ipc-algos() {
  room ipc-algos 225 || return 0
  echo "## ipc all_reduce by algorithm at 2, 4 and 8 processes on GPU 0: ring (over point-to-point), one-shot, two-shot"
  mps_start
  local np a
  for np in 2 4 8; do
    for a in ring oneshot twoshot; do
      CUDA_VISIBLE_DEVICES=0 limited "$(lim 25)" "$PY" -m pyzero.bench collectives --device cuda --gpu-backend ipc \
        --nproc "$np" --backends pyzero --op all_reduce --algo "$a" --min 8 --max 16M --factor 16 \
        --json "${OUT}_ipc${np}_${a}.json" || failed "IPC ALGO BENCH (nproc $np algo $a)"
    done
  done
}
FAULT_CELLS=allreduce-kill,mismatch-dtype,mismatch-kind,never-calls
part_faults() {
  room faults 50 || return 0
  echo "## fault cells on the ipc backend (2 processes on GPU 0, one try each; the full list: --backend ipc)"
  mps_start
  CUDA_VISIBLE_DEVICES=0 limited "$(lim 50)" "$PY" -m pyzero.bench faults --backend ipc --tries 1 \
    --cells "$FAULT_CELLS" --json "${OUT}_faults_ipc.json" || failed "IPC FAULT CELLS"
  mps_stop
  if [ "$NGPU" -ge 2 ]; then
    echo "## fault cells on the nccl backend (a GPU per rank, one try each)"
    limited "$(lim 50)" "$PY" -m pyzero.bench faults --backend nccl --tries 1 \
      --cells "$FAULT_CELLS" --json "${OUT}_faults_nccl.json" || failed "NCCL FAULT CELLS"
  fi
}
part_nccl-multi() {
  if [ "$MULTI_TESTS_RAN" = 0 ] && room nccl-multi 420; then
    if test_nccl; then
      echo "## nccl backend at 2 and 4 processes on GPU 0 through the test NCCL library$([ "$MPS" = 1 ] && echo ", under MPS")"
      mps_start
      nccl_multi_tests
    else
      echo "(no test NCCL library: the nccl-multi tests are left out)"
    fi
  fi
  part nccl-faults || part_nccl-faults
}
part_nccl-faults() {
  room nccl-faults 60 || return 0
  test_nccl || { echo "(no test NCCL library: the nccl fault cells are left out)"; return 0; }
  echo "### fault cells on the nccl backend through the test NCCL library (ranks on GPU 0, one try each)"
  mps_start
  CUDA_VISIBLE_DEVICES=0 PYZERO_NCCL_ROOT=$TNCCL limited "$(lim 60)" "$PY" -m pyzero.bench faults --backend nccl \
    --tries 1 --cells "$FAULT_CELLS" --json "${OUT}_faults_nccl_test.json" \
    || failed "NCCL FAULT CELLS ON THE TEST LIBRARY"
  mps_stop
}
finish() {  # (the parts' EXIT trap): stops the MPS daemon and ends the record with what failed
  local rc=$? fails=$RUN_TMP/failed
  trap '' INT TERM HUP
  mps_stop
  if [ -s "$RUN_TMP/skipped" ]; then
    echo "## skipped (GPU_CHECK_DEADLINE): $(paste -sd, "$RUN_TMP/skipped" | sed 's/,/, /g')"
  fi
  if [ -s "$fails" ]; then
    echo "## FAILED: $(wc -l < "$fails") step(s), in the part(s): $(cut -d: -f1 "$fails" | awk '!seen[$0]++' | paste -sd' ')"
    sed 's/^/##   /' "$fails"
  elif [ "$rc" != 0 ]; then
    echo "## FAILED: the run stopped (exit $rc) in the part: ${CUR_PART:-setup}"
  else
    echo "## passed: no step failed"
  fi
}
set +e  # (the parts' exit status is taken from PIPESTATUS below; they run with set -e themselves)
{
  set -e
  trap finish EXIT  # (this block is a subshell: the daemon is stopped however it ends)
  trap on_interrupt INT TERM HUP
  echo "# pyzero GPU check, $(date -u -Iseconds), parts:$PARTS${GPU_CHECK_DEADLINE:+(deadline ${GPU_CHECK_DEADLINE} s)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c "import pyzero, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda); print(pyzero.build_info())"
  for p in $PARTS; do
    SECONDS_BEFORE=$SECONDS CUR_PART=$p
    "part_$p"
    echo "(part $p: $(( SECONDS - SECONDS_BEFORE )) s, $SECONDS s in all)"
  done
  CUR_PART=""
  [ ! -s "$RUN_TMP/failed" ]  # (exit 1 when a step failed)
} 2>&1 | tee -i "${OUT}.txt"  # (-i: a Ctrl-C leaves tee to write the parts' last lines)
RC=${PIPESTATUS[0]}
set -e
echo "wrote ${OUT}.txt"
# GPU_CHECK_COPY=<dir>: also put the printed log and every file of this run (one .tgz) there, e.g. the
# folder a remote runner sends back.
if [ -n "${GPU_CHECK_COPY:-}" ]; then
  mkdir -p "$GPU_CHECK_COPY"
  cp "${OUT}.txt" "$GPU_CHECK_COPY/"
  tar czf "$GPU_CHECK_COPY/$(basename "$OUT").tgz" "${OUT}"* && echo "copied to $GPU_CHECK_COPY"
fi
exit "$RC"  # (0: every step passed; 1: some failed, named above; 130: interrupted)
