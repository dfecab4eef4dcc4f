#!/usr/bin/env bash
# GPU checks, in one command, on a machine with at least one CUDA GPU:
#   builds pyzero from source with nvcc for the local GPU's architecture, runs the
#   GPU tests (pytest -m gpu: kernels, the nccl backend at world size 1 and, with
#   2+ GPUs, at world size = GPU count) and the GPU benches (kernels; collectives
#   on every GPU: pyzero ring, native NCCL passthrough, torch), and writes what they printed,
#   plus a JSON record, to benchmarks/results/gpu_<gpu name>_<date>.{txt,json}.
# Uses the current Python environment (torch with CUDA must be installed).
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA GPU visible to torch")
PY
ARCH=$(python -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}')")
GPU=$(python -c "import torch, re; print(re.sub(r'[^A-Za-z0-9]+', '_', torch.cuda.get_device_name(0)).strip('_'))")
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
STAMP=$(date -u +%Y%m%d)
OUT=benchmarks/results/gpu_${GPU}_${STAMP}
mkdir -p benchmarks/results
export PYZERO_CUDA=1 PYZERO_CUDA_ARCH="$ARCH"
pip install -q "pybind11>=2.12" "cmake>=3.24" ninja "nvidia-nccl-cu13; platform_system == 'Linux'" 2>/dev/null || true
python setup.py build_ext --inplace > "${OUT}_build.log" 2>&1 || { tail -40 "${OUT}_build.log"; exit 1; }
{
  echo "# pyzero GPU check, $(date -u -Iseconds)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python -c "import pyzero, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda); print(pyzero.build_info())"
  echo "## GPU tests"
  PYTHONPATH=. python -m pytest -q -m gpu -p no:cacheprovider tests || echo "GPU TESTS FAILED"
  echo "## reduce kernel bandwidth vs device-to-device copy"
  PYTHONPATH=. python -m pyzero.bench.kernels --json "${OUT}_kernels.json" || echo "KERNEL BENCH FAILED"
  echo "## collectives on ${NGPU} GPU(s): pyzero ring | pyzero native passthrough (nccl) | torch.distributed nccl"
  PYTHONPATH=. python -m pyzero.bench collectives --device cuda --nproc "${NGPU}" --backends pyzero,nccl,torch \
    --op all --min 8 --max 256M --factor 4 --json "${OUT}_collectives.json" || echo "COLLECTIVES BENCH FAILED"
} 2>&1 | tee "${OUT}.txt"
echo "wrote ${OUT}.txt"
