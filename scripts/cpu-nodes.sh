#!/usr/bin/env bash
# allreduce across MPI nodes on CPUs, one mpiexec per layout: auto, the cpu and host backends and
# comm.Allreduce, merged into one JSON file (scripts/cpu_nodes.py; docs/scaling.md reads it).
#
#   MPIEXEC=/path/to/mpich/mpiexec OUT=/some/dir scripts/cpu-nodes.sh
#
# MPI nodes on one machine: MPICH's fork launcher with named hosts (Intel MPI refuses fork for named
# hosts: use MPICH's mpiexec, e.g. the mpich wheel's). Layouts: LAYOUTS (default "1x8 2x1 2x4 4x2 4x4";
# "2+1" style entries too), 16 cores for 4x4. Writes $OUT/cpu-nodes-<date>.json and one log per layout;
# about 3 minutes on 16 cores (an estimate from the calls per column; not yet timed there). ROUNDS,
# SCALE and SIZES are passed on; PYTHON names the interpreter (default python).
set -euo pipefail
cd "$(dirname "$0")/.."
MPIEXEC=${MPIEXEC:-mpiexec}
OUT=${OUT:-bench/results}
LAYOUTS=${LAYOUTS:-"1x8 2x1 2x4 4x2 4x4"}
ROUNDS=${ROUNDS:-20}
SCALE=${SCALE:-0.25}
SIZES=${SIZES:-8,65536,1048576,8388608}
LIMIT=${LIMIT:-240}  # seconds per layout before it counts as hung
PY=${PYTHON:-python}
mkdir -p "$OUT"
json="$OUT/cpu-nodes-$(date -u +%Y-%m-%d).json"
status=0
for layout in $LAYOUTS; do
    if [[ $layout == *x* ]]; then  # nodes x ranks per node
        nodes=${layout%x*} per=${layout#*x}
        counts=$(for ((i = 0; i < nodes; i++)); do printf '%s ' "$per"; done)
    else  # "2+1": each node's ranks
        counts=${layout//+/ }
    fi
    hosts="" n=0 i=0
    for c in $counts; do
        hosts+="${hosts:+,}node$i:$c"
        n=$((n + c)) i=$((i + 1))
    done
    echo "== $layout: $MPIEXEC -launcher fork -hosts $hosts -n $n" >&2
    if ! timeout "$LIMIT" "$MPIEXEC" -launcher fork -hosts "$hosts" -n "$n" "$PY" scripts/cpu_nodes.py \
        --json "$json" --rounds "$ROUNDS" --scale "$SCALE" --sizes "$SIZES" >"$OUT/cpu-nodes-$layout.log" 2>&1; then
        echo "   $layout failed (status $?): $OUT/cpu-nodes-$layout.log" >&2
        status=1
    fi
    tail -n +1 "$OUT/cpu-nodes-$layout.log" | grep '^{' >&2 || true
done
echo "$json" >&2
exit $status
