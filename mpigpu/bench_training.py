"""``python -m mpigpu.bench_training``: the old name of ``python -m mpigpu.bench.training``, kept working."""

import sys

from mpigpu.bench.training import main

if __name__ == "__main__":
    sys.exit(main())
