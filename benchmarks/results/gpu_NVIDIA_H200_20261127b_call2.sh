#!/usr/bin/env bash
# The second device call of gpu_NVIDIA_H200_20261127b.txt: the reduce kernels against a device copy after the
# fp16 max/min change, alone on the GPU, and the kernel tests; the "pyzero" torch backend's CUDA tests (their
# expectations mended) on ipc and through the test NCCL library, under MPS; then while time is left GPT-2 small
# at world size 1 with torch DDP and FSDP2 on NCCL and on "pyzero", and at 2 processes on GPU 0 (MPS) torch DDP
# and FSDP2 on "pyzero" against pz.DataParallel and ZeRO-3, with the per-rank memory breakdown.
set -u
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"
W=/tmp/pzres; mkdir -p "$W"
T0=$SECONDS
DEADLINE=${DEADLINE:-280}
log() { echo "### [$((SECONDS-T0)) s] $*"; }
left() { echo $(( DEADLINE - (SECONDS - T0) )); }
{
log env
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
cp build/gpu312/lib/_C*.so build/gpu312/lib/_build_config.py pyzero/
EXTRA=""
if ! python3 -c "import pytest_timeout" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/pzextra build/gpuextra/*.whl && EXTRA=/tmp/pzextra
fi
export PYTHONPATH=$PWD${EXTRA:+:$EXTRA}
python3 -c "import pyzero, torch; print(pyzero.build_info())" || { log IMPORT FAILED; exit 1; }
PT=(python3 -m pytest -q -rfE --tb=short --durations=5 -p no:cacheprovider --timeout 120)
log reduce kernels vs copy, alone on the GPU
timeout 60 python3 -m pyzero.bench.kernels --json "$W/kernels.json" || echo "KERNELS rc=$?"
log kernel tests
timeout -s INT 60 "${PT[@]}" --junitxml "$W/tests_kernels.xml" -m gpu tests/test_kernels_gpu.py 2>&1 | tail -15
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog
timeout 10 nvidia-cuda-mps-control -d && sleep 1 && echo "(MPS started)"
log "torch backend on CUDA tensors: ipc, then the test NCCL library"
timeout -s INT 100 "${PT[@]}" --junitxml "$W/tests_torch_backend.xml" -m gpu tests/test_torch_backend_gpu.py 2>&1 | tail -15
PYZERO_TEST_NCCL_ROOT=$PWD/build/gpu312/test-nccl timeout -s INT 40 "${PT[@]}" --junitxml "$W/tests_torch_backend_nccl.xml" \
  -m gpu "tests/test_nccl_multirank_gpu.py::test_torch_backend_on_nccl_through_the_test_library" 2>&1 | tail -8
bench() {  # bench NAME SECONDS ARGS...: runs when time is left
  local name=$1 s=$2; shift 2
  if [ "$(left)" -lt $(( s / 2 )) ]; then echo "(skipped $name: $(left) s left)"; return; fi
  log "$name"
  CUDA_VISIBLE_DEVICES=0 timeout "$(( s < $(left) ? s : $(left) ))" "$@" || echo "$name rc=$?"
}
bench "GPT-2 small, 2 processes on GPU 0 (ipc, MPS): torch DDP and FSDP2 on pyzero, DataParallel, ZeRO-3" 110 \
  python3 -m pyzero.bench train --device cuda --gpu-backend ipc --nproc 2 --model gpt2 --batch 8 --seq 512 \
  --runs torch-ddp-pyzero,dp,fsdp2-pyzero,zero3 --bucket-mb 25 --first-bucket-mb 1 --iters 6 --warmup 2 --memory \
  --json "$W/train2_ipc.json"
echo quit | timeout 10 nvidia-cuda-mps-control; echo "(MPS stopped)"
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
bench "GPT-2 small, world size 1: torch DDP and FSDP2 on NCCL and on pyzero" 90 python3 -m pyzero.bench train \
  --device cuda --nproc 1 --model gpt2 --batch 8 --seq 512 --runs torch-ddp,torch-ddp-pyzero,fsdp2,fsdp2-pyzero \
  --bucket-mb 25 --first-bucket-mb 1 --iters 8 --warmup 3 --json "$W/train1_backends.json"
log done
} 2>&1 | tee "$R/log.txt"
cp "$W"/*.xml "$R"/ 2>/dev/null
tar czf "$R/results.tgz" -C "$W" . 2>/dev/null
