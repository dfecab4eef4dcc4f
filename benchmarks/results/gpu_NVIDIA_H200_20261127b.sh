#!/usr/bin/env bash
# One device call (gpu_NVIDIA_H200_20261127b.txt): the prebuilt cp312 sm_90 _C and test NCCL library (built
# offline, carried in build/gpu312). First the reduce kernels against a device copy, alone on the GPU; then
# the GPU tests in three groups at once: A (single-process GPU tests and test_layers_gpu, no MPS), B1 (the
# ipc backend's tests, the "pyzero" torch backend on CUDA and torch.compile on the GPU: 2-4 processes on
# GPU 0 under MPS), B2 (the nccl backend at 2 and 4 ranks through the test NCCL library, under MPS); each
# group stopped by SIGINT at GROUP_S seconds. Then, one after another while time is left, the benches: the ipc
# all_reduce at 2 processes eager and captured up to 1 MiB; the nccl passthrough and torch's NCCL at world size
# 1 eager and captured; ipc point-to-point at 2 processes; the ipc all_reduce by algorithm at 2, 4 and 8
# processes; GPT-2 small DDP against DataParallel with the memory breakdown.
set -u
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"
W=/tmp/pzres; mkdir -p "$W"
T0=$SECONDS
DEADLINE=${DEADLINE:-570}
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
BENCH=(python3 -m pyzero.bench collectives --device cuda)

log reduce kernels vs copy, alone on the GPU
timeout 60 python3 -m pyzero.bench.kernels --json "$W/kernels.json" || echo "KERNELS rc=$?"

log tests: three groups at once
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog
timeout 10 nvidia-cuda-mps-control -d && sleep 1 && echo "(MPS started)"
( timeout -s INT -k 20 "${GROUP_S:-270}" "${PT[@]}" --timeout 150 --junitxml "$W/tests_b1.xml" -m gpu tests/test_ipc_gpu.py \
    tests/test_torch_backend_gpu.py tests/test_compile.py > "$W/b1.log" 2>&1; echo "B1 rc=$?" >> "$W/b1.log" ) &
( PYZERO_TEST_NCCL_ROOT=$TN timeout -s INT -k 20 "${GROUP_S:-270}" "${PT[@]}" --timeout 150 --junitxml "$W/tests_b2.xml" \
    -m gpu tests/test_nccl_multirank_gpu.py > "$W/b2.log" 2>&1; echo "B2 rc=$?" >> "$W/b2.log" ) &
( unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  timeout -s INT -k 20 "${GROUP_S:-270}" "${PT[@]}" --timeout 150 --junitxml "$W/tests_a.xml" -m gpu tests/test_nccl_gpu.py \
    tests/test_kernels_gpu.py tests/test_offload.py tests/test_offload_options.py tests/test_offload_pipeline.py \
    tests/test_layers_gpu.py > "$W/a.log" 2>&1
  echo "A rc=$?" >> "$W/a.log" ) &
wait
for g in a b1 b2; do log "group $g"; grep -v "^frame #" "$W/$g.log" | tail -70; done

bench() {  # bench NAME SECONDS ARGS...: runs when time is left
  local name=$1 s=$2; shift 2
  if [ "$(left)" -lt $(( s / 2 )) ]; then echo "(skipped $name: $(left) s left)"; return; fi
  log "$name"
  CUDA_VISIBLE_DEVICES=0 timeout "$(( s < $(left) ? s : $(left) ))" "$@" || echo "$name rc=$?"
}
bench "ipc all_reduce, 2 processes, eager" 30 "${BENCH[@]}" --gpu-backend ipc --nproc 2 --backends pyzero \
  --op all_reduce --min 8 --max 1M --factor 4 --json "$W/ipc2_graph0.json"
bench "ipc all_reduce, 2 processes, 20 calls per CUDA graph" 30 "${BENCH[@]}" --gpu-backend ipc --nproc 2 \
  --backends pyzero --op all_reduce --min 8 --max 1M --factor 4 --graph 20 --json "$W/ipc2_graph20.json"
echo quit | timeout 10 nvidia-cuda-mps-control; echo "(MPS stopped)"
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
bench "world size 1 eager: nccl passthrough and torch's NCCL" 30 "${BENCH[@]}" --nproc 1 --backends nccl,torch \
  --op all_reduce --min 8 --max 1M --factor 8 --json "$W/nccl1_graph0.json"
bench "world size 1, 20 calls per CUDA graph: nccl passthrough and torch's NCCL" 30 "${BENCH[@]}" --nproc 1 \
  --backends nccl,torch --op all_reduce --min 8 --max 1M --factor 8 --graph 20 --json "$W/nccl1_graph20.json"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
timeout 10 nvidia-cuda-mps-control -d && sleep 1 && echo "(MPS started)"
bench "ipc point-to-point, 2 processes (each sends to the next, receives from the previous)" 35 "${BENCH[@]}" \
  --gpu-backend ipc --nproc 2 --backends pyzero --op sendrecv --min 8 --max 256M --factor 8 --json "$W/ipc2_sendrecv.json"
for NP in 2 4 8; do
  for A in ring oneshot twoshot; do
    bench "ipc all_reduce, $NP processes, algo $A" 25 "${BENCH[@]}" --gpu-backend ipc --nproc "$NP" --backends pyzero \
      --op all_reduce --algo "$A" --min 8 --max 16M --factor 16 --json "$W/ipc${NP}_${A}.json"
  done
done
echo quit | timeout 10 nvidia-cuda-mps-control; echo "(MPS stopped)"
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
bench "GPT-2 small, world size 1: DDP and DataParallel, memory breakdown" 60 python3 -m pyzero.bench train \
  --device cuda --nproc 1 --model gpt2 --batch 8 --seq 512 --runs torch-ddp,dp --bucket-mb 25 --first-bucket-mb 1 \
  --iters 8 --warmup 3 --memory --json "$W/train_dp.json"
log done
} 2>&1 | tee "$R/log.txt"
cp "$W"/*.xml "$R"/ 2>/dev/null
tar czf "$R/results.tgz" -C "$W" . 2>/dev/null
