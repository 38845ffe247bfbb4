"""``python -m mpigpu.benchmark``: the same command as ``python -m mpigpu.bench``."""

import sys

from mpigpu.bench.main import main

if __name__ == "__main__":
    sys.exit(main())
