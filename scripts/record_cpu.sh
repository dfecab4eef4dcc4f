#!/usr/bin/env bash
# Records the CPU benchmarks into benchmarks/results/<name>_cpu<cores>_<date>.{txt,json} on a quiet
# machine (nothing else running: the numbers are side-by-side ratios, but a busy machine still adds
# noise). Run inside the project's venv. Arguments: the benches to record (default: all), among
#   collectives train ps optim plan faults hier peers pairs
# (peers: the side-by-side set against DeepSpeed, gloo, torch DDP and FSDP2, three times each;
#  pairs: all_reduce per call against DeepSpeed in PAIRS (default 8) fresh pairs of ranks; MODE=slow
#  or fast: only pairs in that exchange mode)
# DeepSpeed's CPU all-reduce joins the collectives table when deepspeed is importable
# (PYTHONPATH may point at a separate install of it).
# A record is never overwritten: a name already recorded that day takes the next free suffix
# (<name>_cpu<cores>_<date>b, c, ... z). Every bench runs, failed or not; the script exits 1 when any
# failed (the last lines name them), 2 for an unknown bench (before anything runs).
set -euo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
DATE=$(date +%Y%m%d)
CORES=$(nproc)
OUT=benchmarks/results
ALL="collectives train ps optim plan faults hier peers pairs"
WHAT=${*:-$ALL}
for w in $WHAT; do
  [[ " $ALL " == *" $w "* ]] || { echo "record_cpu.sh: unknown bench '$w'; expected some of: $ALL" >&2; exit 2; }
done
mkdir -p "$OUT"
tag() {  # tag NAME: the record's path without .txt/.json, the first of NAME's suffixes not recorded yet
  local s base=$OUT/$1_cpu${CORES}_${DATE}
  for s in "" b c d e f g h i j k l m n o p q r s t u v w x y z; do
    [ -e "$base$s.txt" ] || [ -e "$base$s.json" ] || { echo "$base$s"; return 0; }
  done
  echo "record_cpu.sh: $base.txt and ${base}b-z.txt are all taken (a record is never overwritten)" >&2
  return 1
}
FAILED=()
run() {  # name, then the command (its --json path from tag, taken before the .txt exists: the same name)
  local name=$1 f rc=0; shift
  f=$(tag "$name").txt
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$f" 2>&1 || rc=$?
  echo "   exit $rc, $((SECONDS - t0)) s -> $f"
  [ "$rc" = 0 ] || FAILED+=("$name (exit $rc)")
}
for w in $WHAT; do
  case $w in
    collectives)
      run collectives_all_reduce "$PY" -m pyzero.bench collectives --op all_reduce --min 8 --max 64M --factor 4 \
        --nproc 2 --backends pyzero,torch,torch-pyzero,deepspeed --json "$(tag collectives_all_reduce).json"
      for n in 3 4; do  # oversubscribed on 2 cores: recorded, not judged
        run collectives_vs_deepspeed_${n}ranks "$PY" -m pyzero.bench collectives --op all_reduce --min 8 --max 64M \
          --factor 4 --nproc $n --backends pyzero,deepspeed --json "$(tag collectives_vs_deepspeed_${n}ranks).json"
      done ;;
    train)
      run train "$PY" -m pyzero.bench train --runs torch-local,torch-ddp,torch-ddp-pyzero,dp,zero1,zero2,zero3,fsdp2,fsdp2-pyzero \
        --nproc 2 --iters 30 --json "$(tag train).json"
      for i in 1 2 3; do  # torch's DDP and FSDP2 on gloo and on "pyzero", beside no communication at all
        run train_torch_backend_repeat$i "$PY" -m pyzero.bench train --runs torch-local,torch-ddp,torch-ddp-pyzero,fsdp2,fsdp2-pyzero \
          --nproc 2 --iters 30 --json "$(tag train_torch_backend_repeat$i).json"
      done
      for i in 1 2 3; do  # ZeRO-3 against torch DDP, repeated for the spread
        run train_zero3_repeat$i "$PY" -m pyzero.bench train --runs torch-ddp,zero2,zero3 --nproc 2 --iters 30 \
          --json "$(tag train_zero3_repeat$i).json"
      done ;;
    peers)  # every backend in turn at each size, rounds for the medians; each set three times for the spread
      for i in 1 2 3; do
        run collectives_peers_run$i "$PY" -m pyzero.bench collectives --op all_reduce --min 8 --max 64M --factor 4 \
          --nproc 2 --backends pyzero,torch,deepspeed --rounds 3 --json "$(tag collectives_peers_run$i).json"
        run collectives_peers_mid_run$i "$PY" -m pyzero.bench collectives --op all_reduce --min 64K --max 1M \
          --factor 2 --nproc 2 --backends pyzero,deepspeed --rounds 5 --json "$(tag collectives_peers_mid_run$i).json"
        run collectives_peers_percall_run$i "$PY" -m pyzero.bench collectives --op all_reduce --min 8 --max 1M \
          --factor 4 --nproc 2 --backends pyzero,deepspeed --per-call --rounds 3 \
          --json "$(tag collectives_peers_percall_run$i).json"
        run train_peers_run$i "$PY" -m pyzero.bench train --runs torch-ddp,fsdp2,dp,zero2,zero3 --nproc 2 --iters 30 \
          --json "$(tag train_peers_run$i).json"
      done
      for n in 3 4; do for i in 1 2; do  # oversubscribed on 2 cores: recorded, not judged
        run collectives_peers_${n}ranks_run$i "$PY" -m pyzero.bench collectives --op all_reduce --min 8 --max 64M \
          --factor 4 --nproc $n --backends pyzero,deepspeed --rounds 3 --json "$(tag collectives_peers_${n}ranks_run$i).json"
      done; done ;;
    pairs)  # fresh pairs of ranks, each with its exchange probe: both modes of a machine in one record
      # (every size from 8 B to 64 MiB, at least 200 calls of each, so p99 is not just the slowest call;
      # pyzero-fixed: auto without its measured choice, what the choice costs or buys in each pair)
      # (MODE=slow or fast: only sets of ranks the exchange probe puts in that mode, recorded as
      #  collectives_pairs_<mode>; fresh sets start until PAIRS of them have run)
      name=collectives_pairs${MODE:+_$MODE}
      run $name "$PY" -m pyzero.bench collectives --op all_reduce --min 8 --max 64M --factor 2 \
        --nproc 2 --backends pyzero,pyzero-fixed,deepspeed --per-call --rounds 10 --block 100 --min-calls 200 --pairs "${PAIRS:-8}" \
        --exchange-mode "${MODE:-any}" --json "$(tag $name).json" ;;
    ps)
      run ps "$PY" -m pyzero.bench ps --samples 4096 --batch 32 --seq 64 --transport --json "$(tag ps).json" ;;
    optim)
      run optim "$PY" -m pyzero.bench optim --min 1M --max 256M --factor 4 --threads 1,2 --json "$(tag optim).json" ;;
    plan)  # the 4-rank table first: validation takes a table per group size
      run collectives_all_4ranks "$PY" -m pyzero.bench collectives --op all --min 8 --max 64M --factor 4 --nproc 4 \
        --backends pyzero --json "$(tag collectives_all_4ranks).json"
      for i in 1 2 3; do  # every layout 3 times, interleaved; the whole validation repeated for the spread
        run plan_validate_rounds3_run$i "$PY" -m pyzero.plan.cli validate --nproc 2,4 --model gpt-tiny --steps 10 \
          --warmup 2 --rounds 3 --json "$(tag plan_validate_rounds3_run$i).json"
      done ;;
    faults)
      run faults "$PY" -m pyzero.bench faults --tries "${TRIES:-5}" --json "$(tag faults).json"
      run faults_hier "$PY" -m pyzero.bench faults --backend hier --tries "${TRIES:-5}" --json "$(tag faults_hier).json"
      run faults_overhead "$PY" -m pyzero.bench faults --overhead --json "$(tag faults_overhead).json"
      run soak "$PY" -m pyzero.bench soak --seconds "${SOAK_SECONDS:-20}" --nproc 2 3 4 ;;
    hier)
      run hier "$PY" -m pyzero.bench hier --model gpt-nano --steps 200 --throttle 200 --json "$(tag hier).json"
      for i in 1 2 3; do  # a faster link: the collectives alone, repeated for the spread
        run hier_2gbit_run$i "$PY" -m pyzero.bench hier --parts collectives --throttle 2000 \
          --json "$(tag hier_2gbit_run$i).json"
      done ;;
  esac
done
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "record_cpu.sh: FAILED: ${FAILED[*]}"
  exit 1
fi
echo "record_cpu.sh: every bench passed"
