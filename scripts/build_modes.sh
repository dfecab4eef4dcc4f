#!/usr/bin/env bash
# Every way of building pyzero from source, each from a fresh copy of this checkout into fresh
# virtual environments under one temporary folder:
#
#   editable-isolated  pip install -e .                          CUDA, TORCH_CUDA_ARCH_LIST=8.6
#   editable-plain     pip install --no-build-isolation -e .     no CUDA
#   install-isolated   pip install .                             no CUDA
#   install-plain      pip install --no-build-isolation .        no CUDA
#   wheel              python -m build: the sdist, then the wheel from the sdist (isolated);
#                      the sdist must hold csrc/, CMakeLists.txt, pyzero/; the wheel is
#                      installed into another fresh venv          CUDA, PYZERO_CUDA_ARCH=90
#
# CUDA modes need nvcc (without it they build without CUDA, and say so). Every venv gets
# torch==2.13.0 (the CPU build: nothing imported before pyzero loads NCCL, the strictest case).
# In each: `import pyzero` first (before torch), build_info() as built, no RUNPATH in _C, NCCL
# (CUDA builds) loaded from the venv's nvidia-nccl-cu13, `pyzero-bench --help`, a 2-rank
# all_reduce checked against the closed-form sum, and for CUDA builds the cubins listed by
# cuobjdump (when there is one) equal to the requested architectures.
# Every package comes from one folder of wheels downloaded once at the start (PYZERO_WHEELS=DIR
# keeps and reuses one); every install after that runs with --no-index, so the builds, isolated
# ones included, need no network. Prints the time each mode took.
#
#   scripts/build_modes.sh [mode ...]    (default: all five)
#   PYTHON=python3.12 picks the interpreter; PYZERO_KEEP=1 keeps the temporary folder.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
unset PYTHONPATH VIRTUAL_ENV PYZERO_CUDA PYZERO_CUDA_ARCH TORCH_CUDA_ARCH_LIST PYZERO_NCCL_ROOT PYZERO_TEST_NCCL CUDACXX \
  PIP_REQUIRE_VIRTUALENV
MODES=("$@")
[ ${#MODES[@]} -gt 0 ] || MODES=(editable-isolated editable-plain install-isolated install-plain wheel)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pyzero-build-modes.XXXXXX")
if [ "${PYZERO_KEEP:-0}" = 1 ]; then echo "keeping $WORK"; else trap 'rm -rf "$WORK"' EXIT; fi
WHEELS=${PYZERO_WHEELS:-$WORK/wheels}
mkdir -p "$WHEELS"
WHEELS=$(cd "$WHEELS" && pwd)

if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then CUDA=1; else
  CUDA=0; echo "no nvcc: the CUDA modes build without CUDA"; fi

log() { echo "== $*"; }
T0=$SECONDS
log "tools venv, and every wheel the modes install, into $WHEELS"
"$PY" -m venv "$WORK/tools"
TOOLS="$WORK/tools/bin/python"
"$TOOLS" -m pip download -q -d "$WHEELS" torch==2.13.0 numpy "setuptools>=77" "pybind11>=2.12" \
  "cmake>=3.24" ninja "nvidia-nccl-cu13; platform_system == 'Linux'" build >"$WORK/download.log" 2>&1 ||
  { grep -v "is ignored" "$WORK/download.log"; exit 1; }
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELS" PIP_DISABLE_PIP_VERSION_CHECK=1
"$TOOLS" -m pip install -q build
# cuobjdump, to read the cubins: the toolkit's, or the nvidia-cuda-cuobjdump package (best effort).
CUOBJDUMP=$(command -v cuobjdump || true)
[ -n "$CUOBJDUMP" ] || [ ! -x /usr/local/cuda/bin/cuobjdump ] || CUOBJDUMP=/usr/local/cuda/bin/cuobjdump
if [ -z "$CUOBJDUMP" ] && [ "$CUDA" = 1 ]; then
  env -u PIP_NO_INDEX -u PIP_FIND_LINKS "$TOOLS" -m pip install -q nvidia-cuda-cuobjdump >/dev/null 2>&1 || true
  CUOBJDUMP=$(ls "$WORK"/tools/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump 2>/dev/null | head -1 || true)
fi
[ -n "$CUOBJDUMP" ] || echo "no cuobjdump: the cubins are not checked"
echo "setup: $((SECONDS - T0)) s"

cat > "$WORK/check.py" <<'PY'
import pyzero  # first: nothing has loaded NCCL or torch yet

import json, os, re, shutil, subprocess, sys
from pathlib import Path

info = pyzero.build_info()
where = Path(pyzero.__file__).resolve().parent
print("pyzero", pyzero.__version__, "from", where, info)
want_cuda, want_archs, home = os.environ["WANT_CUDA"] == "1", os.environ["WANT_ARCHS"], os.environ["WANT_HOME"]
assert info["cuda"] is want_cuda, f"build_info()['cuda'] = {info['cuda']}, expected {want_cuda}"
assert str(where).startswith(str(Path(home).resolve())), f"pyzero imported from {where}, expected under {home}"
so = Path(pyzero._C.__file__)
if shutil.which("readelf"):
    dyn = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    assert "RPATH" not in dyn and "RUNPATH" not in dyn and "libnccl" not in dyn, dyn  # NCCL: opened at import
if want_cuda:
    assert info["cuda_archs"] == want_archs.split(";"), info
    maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libnccl" in l})
    assert len(maps) == 1 and maps[0].startswith(sys.prefix), f"NCCL from {maps}, expected the venv's"
    assert pyzero.nccl_library()["path"] == maps[0] and not pyzero.nccl_library()["test"], pyzero.nccl_library()
    print("NCCL from", maps[0])
    tool = os.environ.get("CUOBJDUMP")
    if tool:
        elf = subprocess.run([tool, "--list-elf", str(so)], capture_output=True, text=True, check=True).stdout
        cubins = re.findall(r"\.sm_(\w+)\.cubin", elf)  # one per arch from each .cu file
        want = want_archs.split(";")
        assert sorted(set(cubins)) == sorted(want) and all(cubins.count(a) == cubins.count(want[0]) for a in want), elf
        print("cubins", sorted(set(cubins)), "x", len(cubins) // len(want))

import torch
from pyzero.launch import run_ranks


def rank_fn():
    pyzero.init(backend="shm")
    r = pyzero.get_rank()
    t = torch.arange(4096, dtype=torch.float32) * (r + 1)
    pyzero.all_reduce(t)
    pyzero.destroy()
    return t


res = run_ranks(rank_fn, 2, timeout=60)
want = torch.arange(4096, dtype=torch.float32) * 3  # ranks hold 1x and 2x
for r in res:
    assert torch.equal(r.value, want), f"rank {r.rank}: all_reduce gave {r.value[:4]}..., expected {want[:4]}..."
print("2-rank all_reduce == 3 * arange(4096) on both ranks")
PY

src_copy() {  # this checkout's files (tracked, and untracked but not ignored) into $1
  mkdir -p "$1"
  if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z -co --exclude-standard |
      tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -C "$1" -xf -
  else  # an unpacked sdist, say
    (cd "$ROOT" && tar --exclude=./build --exclude=./.venv --exclude='*.so' --exclude=./pyzero/_build_config.py \
      -cf - .) | tar -C "$1" -xf -
  fi
}
new_venv() {  # fresh venv $1 with torch
  "$PY" -m venv "$1"
  "$1/bin/python" -m pip install -q --no-compile torch==2.13.0 numpy
}
build_tools() {  # what a build without isolation needs, into venv $1
  "$1/bin/python" -m pip install -q --no-compile "setuptools>=77" "pybind11>=2.12" "cmake>=3.24" ninja \
    "nvidia-nccl-cu13; platform_system == 'Linux'"
}
declare -A TOOK BUILT
timed_build() {  # in folder $1 runs the rest, recording its time as this mode's build time
  local t=$SECONDS dir=$1 rc=0
  shift
  (cd "$dir" && "$@") || rc=$?
  BUILT[$MODE]=$((SECONDS - t))
  return $rc
}
check() {  # venv $1, pyzero expected under $2, CUDA $3 (0/1), archs $4
  (cd "$WORK" && WANT_HOME=$2 WANT_CUDA=$3 WANT_ARCHS=$4 CUOBJDUMP=$CUOBJDUMP "$1/bin/python" "$WORK/check.py")
  (cd "$WORK" && "$1/bin/pyzero-bench" --help >/dev/null)
}

mode_editable-isolated() {
  local d=$WORK/editable-isolated
  new_venv "$d/venv"; src_copy "$d/src"
  timed_build "$d/src" env PYZERO_CUDA="$CUDA" TORCH_CUDA_ARCH_LIST="8.6" "$d/venv/bin/python" -m pip install -q -e .
  check "$d/venv" "$d/src" "$CUDA" 86
}
mode_editable-plain() {
  local d=$WORK/editable-plain
  new_venv "$d/venv"; build_tools "$d/venv"; src_copy "$d/src"
  timed_build "$d/src" env PYZERO_CUDA=0 "$d/venv/bin/python" -m pip install -q --no-build-isolation -e .
  check "$d/venv" "$d/src" 0 ""
}
mode_install-isolated() {
  local d=$WORK/install-isolated
  new_venv "$d/venv"; src_copy "$d/src"
  timed_build "$d/src" env PYZERO_CUDA=0 "$d/venv/bin/python" -m pip install -q .
  check "$d/venv" "$d/venv" 0 ""
}
mode_install-plain() {
  local d=$WORK/install-plain
  new_venv "$d/venv"; build_tools "$d/venv"; src_copy "$d/src"
  timed_build "$d/src" env PYZERO_CUDA=0 "$d/venv/bin/python" -m pip install -q --no-build-isolation .
  check "$d/venv" "$d/venv" 0 ""
}
mode_wheel() {
  local d=$WORK/wheel
  src_copy "$d/src"
  timed_build "$d/src" env PYZERO_CUDA="$CUDA" PYZERO_CUDA_ARCH=90 "$TOOLS" -m build --outdir "$d/dist" . \
    >"$d/build.log" 2>&1 || { tail -40 "$d/build.log"; return 1; }
  local sdist wheel listing
  sdist=$(ls "$d"/dist/pyzero-*.tar.gz); wheel=$(ls "$d"/dist/pyzero-*.whl)
  listing=$(tar tzf "$sdist")
  for f in CMakeLists.txt setup.py pyproject.toml csrc/bindings.cpp csrc/kernels.cu pyzero/__init__.py \
           pyzero/_loader.py; do
    grep -qx "pyzero-[^/]*/$f" <<<"$listing" || { echo "sdist $sdist lacks $f"; return 1; }
  done
  ! grep -qE '\.so$|_build_config\.py$' <<<"$listing" || { echo "sdist $sdist holds build outputs"; return 1; }
  echo "sdist $(basename "$sdist"): $(wc -l <<<"$listing") entries; wheel $(basename "$wheel")"
  new_venv "$d/venv"
  "$d/venv/bin/python" -m pip install -q --no-compile "$wheel"
  check "$d/venv" "$d/venv" "$CUDA" 90
}

for MODE in "${MODES[@]}"; do
  declare -F "mode_$MODE" >/dev/null || { echo "unknown mode $MODE"; exit 2; }
done
for MODE in "${MODES[@]}"; do
  log "$MODE"
  t=$SECONDS
  "mode_$MODE"
  TOOK[$MODE]=$((SECONDS - t))
  echo "$MODE: ok in ${TOOK[$MODE]} s"
done
log "build modes (torch==2.13.0, $(nproc) cores): whole mode (fresh venvs, install, build, checks) | the build command"
for MODE in "${MODES[@]}"; do printf '  %-18s %4d s | %4d s\n' "$MODE" "${TOOK[$MODE]}" "${BUILT[$MODE]:-0}"; done
echo "all ${#MODES[@]} modes built and checked in $((SECONDS - T0)) s"
echo "build_modes: ${#MODES[@]} passed, 0 failed"
