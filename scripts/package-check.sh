#!/usr/bin/env bash
# Build mpigpu as a user gets it and run it from a fresh environment (CI calls this from .ci/run):
#   python -m build (a wheel and an sdist, once), check that both carry the CUDA kernels' sources
#   (.cu, .cuh), the JAX FFI handler's source (.cc), the check board's (.c) and py.typed, install the
#   wheel and the mpich wheel into a new venv, then `mpiexec -n 2 python -m mpigpu.average` on a small
#   size, `--version` against mpigpu/_version.py, and (with a C compiler here) `mpigpu.info`'s word that
#   the check board runs its compiled exchange.
# Runs from a temporary directory, so the checkout's own mpigpu/ cannot stand in for the installed one.
# Usage: scripts/package-check.sh        (PYTHON=python3.x to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH

echo "== package: build a wheel and an sdist"
"$python" -m venv "$work/build-env"
"$work/build-env/bin/pip" install -q build
# from a copy of the checkout's files (git's view: tracked and new, not ignored): setuptools writes
# its scratch folders (build/, *.egg-info) there, not into the checkout
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$work/src"
"$work/build-env/bin/python" -m build -q --outdir "$work/dist" "$work/src" >"$work/build.log" 2>&1 || {
  cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/mpigpu-*.whl)
sdist=$(ls "$work"/dist/mpigpu-*.tar.gz)
expected=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$root/mpigpu/_version.py")
"$work/build-env/bin/python" - "$wheel" "$sdist" "$root" <<'PY'
import sys, tarfile, zipfile
from pathlib import Path
wheel, sdist, root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
sources = [*(root / "mpigpu/kernels").glob("*.cu*"), *(root / "mpigpu/jax").glob("*.cc"), *(root / "mpigpu/job").glob("*.c")]
wanted = {p.relative_to(root).as_posix() for p in sources} | {"mpigpu/py.typed"}
assert len(wanted) > 1, "no kernel sources found"
in_wheel = set(zipfile.ZipFile(wheel).namelist())
in_sdist = {"/".join(n.split("/")[1:]) for n in tarfile.open(sdist).getnames()}
for name, members in (("wheel", in_wheel), ("sdist", in_sdist)):
    missing = sorted(wanted - members)
    if missing:
        sys.exit(f"package: the {name} lacks {', '.join(missing)}")
print(f"package: wheel and sdist carry {len(wanted) - 1} kernel, FFI handler and board sources and py.typed")
PY

echo "== package: install the wheel and mpich into a fresh venv, then run the average on 2 ranks"
"$python" -m venv "$work/user-env"
"$work/user-env/bin/pip" install -q "$wheel" mpich
cd "$work"
version=$("$work/user-env/bin/python" -m mpigpu.average --version)
[ "$version" = "mpigpu $expected" ] || { echo "package: --version printed '$version', not 'mpigpu $expected'"; exit 1; }
timeout 120 "$work/user-env/bin/mpiexec" -n 2 "$work/user-env/bin/python" -m mpigpu.average --size 64K --iters 3 --warmup 1 \
  | tee "$work/average.txt"
grep -q "^# PASS: 0 wrong elements over 2 ranks" "$work/average.txt"
# the check board's compiled exchange, built from the installed package's source where a C compiler is here
if command -v "${CC:-cc}" >/dev/null || command -v gcc >/dev/null; then
  timeout 120 "$work/user-env/bin/mpiexec" -n 2 "$work/user-env/bin/python" -m mpigpu.info | tee "$work/info.txt" \
    | grep "^Argument check"
  grep -q "^Argument check .*compiled exchange on every rank" "$work/info.txt" || {
    echo "package: the installed mpigpu's check board does not run its compiled exchange"; exit 1; }
fi
echo "package: OK ($version)"
