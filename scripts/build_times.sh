#!/usr/bin/env bash
# Times pyzero's build (`python setup.py build_ext --inplace`) from a copy of the committed tree, on a quiet
# machine: clean with CUDA for 80;90, nothing changed, one .cpp changed, kernels.cu changed, clean for one
# architecture, clean without CUDA. Prints the machine, the tools' versions and a table; with RECORD=1 also
# writes it to benchmarks/results/build_times_cpu<cores>_<date>.txt (the next free suffix, b-z, when that day
# has one; written only when every build succeeded). Run with the project's venv active (or PYTHON=...): it
# needs pybind11, cmake and ninja there, and nvcc where setup.py looks (CUDACXX, CUDA_HOME, PATH,
# /usr/local/cuda/bin): the CUDA rows build with PYZERO_CUDA=1 (without nvcc the script stops before building).
set -euo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}
find_nvcc() {  # (as setup.py's find_nvcc)
  if [ -n "${CUDACXX:-}" ]; then
    [ -x "$CUDACXX" ] && echo "$CUDACXX"
    return
  fi
  local home=${CUDA_HOME:-${CUDA_PATH:-}}
  if [ -n "$home" ] && [ -x "$home/bin/nvcc" ]; then echo "$home/bin/nvcc"; return; fi
  command -v nvcc && return
  [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc
}
NVCC=$(find_nvcc) || true
[ -n "$NVCC" ] || { echo "build_times.sh: no nvcc (CUDACXX${CUDACXX:+=$CUDACXX}, CUDA_HOME, PATH," \
  "/usr/local/cuda/bin): the CUDA rows need it; set CUDACXX or CUDA_HOME" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git archive HEAD | tar -x -C "$WORK"

report() {
  echo "# pyzero build times, \`python setup.py build_ext --inplace\` in a copy of the committed tree"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)   commit: $(git rev-parse --short HEAD)"
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "gcc: $(gcc -dumpfullversion)   nvcc: $("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')   $("$PY" -c 'import cmake, ninja, pybind11; print("cmake", cmake.__version__, " ninja", ninja.__version__, " pybind11", pybind11.__version__)' 2>/dev/null || echo "cmake $(cmake --version | head -1)")"
  echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0])')   parallel jobs: $(nproc)"
  echo
  echo "| build | seconds |"
  echo "| --- | --- |"
  timed() {  # label, then env assignments for the build
    local label=$1; shift
    local t0 t1
    t0=$(date +%s.%N)
    (cd "$WORK" && env "$@" "$PY" setup.py -q build_ext --inplace > "$WORK/last.log" 2>&1) \
      || { cat "$WORK/last.log" >&2; echo "build failed: $label" >&2; exit 1; }
    t1=$(date +%s.%N)
    awk -v l="$label" -v a="$t0" -v b="$t1" 'BEGIN { printf "| %s | %.1f |\n", l, b - a }'
  }
  # (PYZERO_CUDA=1: a CUDA row that cannot build with CUDA fails, rather than quietly timing a CPU-only build)
  local cuda=(PYZERO_CUDA=1 "CUDACXX=$NVCC") two="PYZERO_CUDA_ARCH=80;90"
  timed "clean, CUDA for 80;90" "${cuda[@]}" "$two"
  timed "nothing changed" "${cuda[@]}" "$two"
  touch "$WORK/csrc/cpu_optim.cpp"
  timed "one .cpp changed (cpu_optim.cpp)" "${cuda[@]}" "$two"
  touch "$WORK/csrc/kernels.cu"
  timed "kernels.cu changed" "${cuda[@]}" "$two"
  rm -rf "$WORK/build"
  timed "clean, CUDA for one architecture (90)" "${cuda[@]}" "PYZERO_CUDA_ARCH=90"
  rm -rf "$WORK/build"
  timed "clean, without CUDA" "PYZERO_CUDA=0"
}

if [ "${RECORD:-0}" = 1 ]; then
  base="benchmarks/results/build_times_cpu$(nproc)_$(date +%Y%m%d)" out=""
  for s in "" b c d e f g h i j k l m n o p q r s t u v w x y z; do [ -e "$base$s.txt" ] || { out=$base$s.txt; break; }; done
  [ -n "$out" ] || { echo "build_times.sh: $base.txt and ${base}b-z.txt are all taken" >&2; exit 1; }
  report | tee "$WORK/report.txt"  # (a failed build stops here: no record, rather than a truncated one)
  mkdir -p benchmarks/results && mv "$WORK/report.txt" "$out"
  echo "-> $out"
else
  report
fi
