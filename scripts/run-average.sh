#!/usr/bin/env bash
# Set up a virtual environment with mpigpu and an embedded MPI, then average a gradient over 4 ranks.
# Needs only Python 3.10+ and pip. Extra arguments go to mpigpu.average (e.g. --size 64M --dtype bfloat16).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/pip" install -q -e ".[mpi]"
exec "$venv/bin/mpiexec" -n "${NP:-4}" "$venv/bin/python" -m mpigpu.average "$@"
