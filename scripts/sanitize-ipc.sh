#!/usr/bin/env bash
# compute-sanitizer over the ipc kernels: memcheck, racecheck and synccheck, each run with every rank
# under the sanitizer:  $MPIRUN -np 2 compute-sanitizer --tool T python3 scripts/ipc_sanitize_driver.py
#
#   scripts/sanitize-ipc.sh
#
# Needs a machine with 2+ GPUs that the ipc backend can use (python -m mpigpu.info says so).
# Environment (all optional):
#   NP=2                     ranks
#   MPIRUN=mpirun            launcher; MPIRUN_ARGS for its options (default: --allow-run-as-root for
#                            Open MPI run as root, nothing otherwise)
#   PYTHON=python3
#   TOOLS="memcheck racecheck synccheck"
#   COMPUTE_SANITIZER=compute-sanitizer
#   OUT=./sanitize-results   per-rank sanitizer logs, the driver's output, summary.txt
#   MPIGPU_TIMEOUT=600       a barrier that never completes traps after this many seconds instead of hanging
# Exit status: 0 only if no tool reported an error and the driver found every result right.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/sanitize-results}
NP=${NP:-2}
MPIRUN=${MPIRUN:-mpirun}
if [ -z "${MPIRUN_ARGS+set}" ]; then
  MPIRUN_ARGS=""
  if [ "$(id -u)" = 0 ] && "$MPIRUN" --version 2>&1 | grep -qi "open mpi"; then MPIRUN_ARGS="--allow-run-as-root"; fi
fi
PY=${PYTHON:-python3}
TOOLS=${TOOLS:-memcheck racecheck synccheck}
SANITIZER=${COMPUTE_SANITIZER:-compute-sanitizer}
export MPIGPU_TIMEOUT=${MPIGPU_TIMEOUT:-600} PYTHONUNBUFFERED=1
# the kernel cache: the caller's MPIGPU_CACHE_DIR, else a private directory for this run only (a fixed
# path under a shared /tmp could be created first by another user: mpigpu would refuse it)
if [ -z "${MPIGPU_CACHE_DIR:-}" ]; then
  MPIGPU_CACHE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/mpigpu-cache.XXXXXX") || { echo "mktemp -d failed"; exit 1; }
  trap 'rm -rf "$MPIGPU_CACHE_DIR"' EXIT
fi
export MPIGPU_CACHE_DIR
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
command -v "$SANITIZER" >/dev/null || { echo "$SANITIZER not found: set COMPUTE_SANITIZER=/path/to/compute-sanitizer" | tee -a "$SUMMARY"; exit 2; }

# Compile the kernels once without the sanitizer (NVRTC is slow under it), and check the driver.
# shellcheck disable=SC2086
if ! $MPIRUN $MPIRUN_ARGS -np "$NP" "$PY" scripts/ipc_sanitize_driver.py >"$OUT/plain.out" 2>&1; then
  echo "FAIL plain run (no sanitizer): $(tail -n 3 "$OUT/plain.out" | tr '\n' ' ')" | tee -a "$SUMMARY"
  exit 1
fi
echo "PASS plain run (no sanitizer): $(tail -n 1 "$OUT/plain.out")" | tee -a "$SUMMARY"

failures=0
for tool in $TOOLS; do
  rm -f "$OUT/$tool".rank*.log
  # shellcheck disable=SC2086
  $MPIRUN $MPIRUN_ARGS -np "$NP" "$SANITIZER" --tool "$tool" --error-exitcode 99 --print-limit 100 \
    --log-file "$OUT/$tool.rank%p.log" "$PY" scripts/ipc_sanitize_driver.py >"$OUT/$tool.out" 2>&1
  rc=$?
  logs=$(ls "$OUT/$tool".rank*.log 2>/dev/null | wc -l)
  summaries=$(grep -hE "(ERROR|RACECHECK) SUMMARY" "$OUT/$tool".rank*.log 2>/dev/null | sort | uniq -c | tr -s ' ' | tr '\n' ';')
  # errors (racecheck: "N hazards displayed (E errors, W warnings)"; the others: "ERROR SUMMARY: E errors")
  reported=$(grep -hE "ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: .*\([1-9][0-9]* error" "$OUT/$tool".rank*.log 2>/dev/null | wc -l)
  if [ "$rc" -eq 0 ] && [ "$reported" -eq 0 ] && [ "$logs" -ge "$NP" ]; then
    verdict=PASS
  else
    verdict=FAIL
    failures=$((failures + 1))
  fi
  echo "$verdict $tool: rc=$rc, $logs rank logs, summaries:$summaries driver: $(tail -n 1 "$OUT/$tool.out")" | tee -a "$SUMMARY"
done
echo "failed tools: $failures" | tee -a "$SUMMARY"
[ "$failures" -eq 0 ]
