#!/usr/bin/env bash
# One device call (call 2 of gpu_NVIDIA_H200_20261127.txt): the prebuilt cp312 sm_90 _C and test NCCL library
# (built offline, carried in build/gpu312), the GPU tests in three concurrent groups (A: the GPU tests but the
# three multi-process files, without MPS; B1: the ipc and torch-backend multi-process tests under MPS; B2: the
# nccl backend at 2 and 4 ranks through the test NCCL library under MPS), each stopped by SIGINT at GROUP_S
# seconds, then while time is left GPT-2 small torch-local vs zero2-offload and the DDP / DataParallel memory rows.
set -u
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"
W=/tmp/pzres; mkdir -p "$W"
T0=$SECONDS
DEADLINE=${DEADLINE:-500}
log() { echo "### [$((SECONDS-T0)) s] $*"; }
left() { echo $(( DEADLINE - (SECONDS - T0) )); }
{
log env
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
nproc; git log --oneline -1 2>/dev/null
cp build/gpu312/lib/_C*.so build/gpu312/lib/_build_config.py pyzero/
EXTRA=""
if ! python3 -c "import pytest_timeout" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/pzextra build/gpuextra/*.whl && EXTRA=/tmp/pzextra
fi
export PYTHONPATH=$PWD${EXTRA:+:$EXTRA}
python3 -c "import pyzero, torch; print(pyzero.build_info())" || { log IMPORT FAILED; exit 1; }
TN=$PWD/build/gpu312/test-nccl
PT=(python3 -m pytest -q -rfE --tb=short --durations=8 -p no:cacheprovider)
log tests: three groups at once
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog
timeout 10 nvidia-cuda-mps-control -d && sleep 1 && echo "(MPS started)"
( timeout -s INT -k 20 ${GROUP_S:-250} "${PT[@]}" --timeout 200 --junitxml "$W/tests_b1.xml" -m gpu tests/test_ipc_gpu.py tests/test_torch_backend_gpu.py \
    > "$W/b1.log" 2>&1; echo "B1 rc=$?" >> "$W/b1.log" ) &
( PYZERO_TEST_NCCL_ROOT=$TN timeout -s INT -k 20 ${GROUP_S:-250} "${PT[@]}" --timeout 300 --junitxml "$W/tests_b2.xml" -m gpu tests/test_nccl_multirank_gpu.py \
    > "$W/b2.log" 2>&1; echo "B2 rc=$?" >> "$W/b2.log" ) &
( unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  timeout -s INT -k 20 ${GROUP_S:-250} "${PT[@]}" --timeout 150 --junitxml "$W/tests_a.xml" -m gpu tests --ignore tests/test_ipc_gpu.py \
    --ignore tests/test_torch_backend_gpu.py --ignore tests/test_nccl_multirank_gpu.py > "$W/a.log" 2>&1
  echo "A rc=$?" >> "$W/a.log" ) &
wait
for g in a b1 b2; do log "group $g"; tail -60 "$W/$g.log"; done
echo quit | timeout 10 nvidia-cuda-mps-control; echo "(MPS stopped)"
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
if [ "$(left)" -gt 50 ]; then
  log offload GPT-2 small: torch-local vs zero2-offload, the cores as the CPU optimizer threads
  CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 5 )) python3 -m pyzero.bench train --device cuda --nproc 1 --model gpt2 \
    --batch 8 --seq 512 --runs torch-local,zero2-offload --bucket-mb 25 --first-bucket-mb 1 --iters 8 --warmup 3 \
    --json "$W/offload_threads.json" || echo "OFFLOAD rc=$?"
fi
if [ "$(left)" -gt 40 ]; then
  log memory GPT-2 small world size 1: DDP and DataParallel
  CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 3 )) python3 -m pyzero.bench train --device cuda --nproc 1 --model gpt2 \
    --batch 8 --seq 512 --runs torch-ddp,dp --bucket-mb 25 --first-bucket-mb 1 \
    --iters 4 --warmup 2 --memory --json "$W/memory1_dp.json" || echo "MEMORY rc=$?"
fi
log done
} 2>&1 | tee "$R/log.txt"
cp "$W"/*.xml "$R"/ 2>/dev/null
tar czf "$R/results.tgz" -C "$W" . 2>/dev/null
