#!/usr/bin/env bash
# Prepare a git-ignored folder that runs Horovod's own PyTorch tests, and its PyTorch synthetic benchmark,
# against mpigpu.horovod.torch (docs/horovod.md, docs/training.md). Nothing of Horovod is committed here: the
# files are copied, unchanged, from a Horovod checkout.
#   scripts/hvd-suite.sh /path/to/horovod-checkout [DEST]        (DEST defaults to .hvd-suite)
# Then, from DEST:  PYTHONPATH=$PWD:<mpigpu checkout> mpiexec -n 2 python -m pytest -c pytest.ini \
#                       --rootdir . test/parallel/test_torch.py
# and, from the checkout, the benchmark beside DDP:  python scripts/hvd_synthetic.py --help
set -euo pipefail
src=${1:?usage: scripts/hvd-suite.sh HOROVOD_CHECKOUT [DEST]}
dest=${2:-$(cd "$(dirname "$0")/.." && pwd)/.hvd-suite}
read_src() {  # read_src PATH: a file of the checkout (a work tree, or a bare git directory at HEAD)
  if [ -f "$src/$1" ]; then cat "$src/$1"; else git -C "$src" show "HEAD:$1"; fi
}
mkdir -p "$dest/test/parallel" "$dest/test/utils" "$dest/horovod/torch" "$dest/horovod/runner/util" \
  "$dest/examples/pytorch"
read_src test/parallel/test_torch.py >"$dest/test/parallel/test_torch.py"
read_src test/utils/common.py >"$dest/test/utils/common.py"
# issue 37: Horovod's synthetic benchmark, run as it is (scripts/hvd_synthetic.py)
read_src examples/pytorch/pytorch_synthetic_benchmark.py >"$dest/examples/pytorch/pytorch_synthetic_benchmark.py"
: >"$dest/pytest.ini"
# the alias: `import horovod.torch` is mpigpu's layer
: >"$dest/horovod/__init__.py"
cat >"$dest/horovod/torch/__init__.py" <<'PY'
import mpigpu.horovod.torch as _impl

globals().update({k: v for k, v in vars(_impl).items() if not k.startswith("__")})
PY
# what common.py imports beyond the alias
: >"$dest/horovod/runner/__init__.py"
: >"$dest/horovod/runner/util/__init__.py"
cat >"$dest/horovod/runner/util/threads.py" <<'PY'
import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
PY
# (always: the GPU image may lack them, and these stand-ins are all the tests use of them)
echo "from pickle import *  # noqa" >"$dest/cloudpickle.py"
echo "from unittest.mock import *  # noqa" >"$dest/mock.py"
echo "ready: $dest"
