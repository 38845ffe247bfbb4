"""``python -m mpigpu.soak``: the old name of ``python -m mpigpu.bench.soak``, kept working."""

import sys

from mpigpu.bench.soak import main

if __name__ == "__main__":
    sys.exit(main())
