#!/usr/bin/env bash
# Set up a virtual environment and run mpigpu's whole test suite, as CI does:
#   serial tests, then the MPI tests under mpiexec with 1, 2, 3 and 4 ranks (3: an odd count, where
#   MPI takes its non-power-of-two algorithms and averages do not divide evenly), then across MPI's own
#   nodes (MPICH's fork launcher with named hosts, docs/nodes.md): the whole MPI suite on 2 nodes of 2
#   ranks and on 3 nodes of 1 (the flat board: one rank per node), and the reductions' files on uneven
#   nodes of 2 and 1.
# Needs only Python 3.10+ and pip; MPI comes from the mpich wheel (the `mpi` extra).
# Usage: scripts/test.sh [extra pytest arguments]      (VENV=path to choose the environment)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv-test}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
echo "scripts/test.sh installs into $venv (about 1.7 GB, mostly PyTorch; later runs reuse it):"
echo "  - mpigpu itself (editable) with its mpi, test, plot and dev extras: numpy, mpi4py, the mpich wheel"
echo "    (an MPI for machines without one), pytest, pytest-mpi, matplotlib, ruff, import-linter"
echo "  - PyTorch 2.13 (CPU build) and JAX (CPU): the training samples, the Horovod and JAX layers and"
echo "    their tests use them"
pip install -q --upgrade pip >/dev/null
pip install -q -e ".[mpi,test,plot,dev]"
pip install -q "torch==2.13.0" "jax>=0.4"

rm -f .pytest-rank*.log
results=$(mktemp -d)
status=0
run() {  # run <name> <command...>: a pytest run that writes junit XML to $results/<name>.xml
  local name=$1; shift
  echo "== $name: $*"
  if ! "$@" --junitxml="$results/$name.xml"; then
    status=1
    for log in .pytest-rank*.log; do
      [ -s "$log" ] && { echo "--- $log"; tail -n 60 "$log"; }
    done
  fi
}
run serial python -m pytest -q "$@"
for n in 1 2 3 4; do
  run "mpi-$n" mpiexec -n "$n" python -m pytest -q --with-mpi --only-mpi "$@"
done
# Across nodes: MPICH's launcher (Hydra) starts one proxy per named host; with the fork launcher they run
# here, and MPI_COMM_TYPE_SHARED splits the ranks by host, as on a cluster. Other launchers have no such mode.
# At 2+1 the files of the reductions whose steps depend on node sizes (the host backend's users); 2x2 runs all.
uneven=(tests/backends tests/test_allreduce_mpi.py tests/test_exchange_mpi.py tests/test_persistent_mpi.py)
if mpiexec --version 2>&1 | grep -q HYDRA; then
  run "mpi-2x2" mpiexec -launcher fork -hosts nodeA:2,nodeB:2 -n 4 python -m pytest -q --with-mpi --only-mpi "$@"
  run "mpi-1+1+1" mpiexec -launcher fork -hosts nodeA:1,nodeB:1,nodeC:1 -n 3 python -m pytest -q --with-mpi --only-mpi "$@"
  run "mpi-2+1" mpiexec -launcher fork -hosts nodeA:2,nodeB:1 -n 3 python -m pytest -q --with-mpi --only-mpi \
    "${uneven[@]}" "$@"
else
  echo "== across nodes: skipped (mpiexec is not MPICH's Hydra, which alone starts named hosts here)"
fi
# One closing line over all runs (each pytest run above printed its own summary).
python - "$results" <<'PY'
import sys, glob, xml.etree.ElementTree as ET
totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in glob.glob(f"{sys.argv[1]}/*.xml"):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
failed = totals["failures"] + totals["errors"]
passed = totals["tests"] - failed - totals["skipped"]
print(f"all runs: {passed} passed, {failed} failed, {totals['skipped']} skipped")
PY
rm -rf "$results"
exit $status
