"""``python -m mpigpu.bench``: the benchmark command (mpigpu.bench.main)."""

import sys

from mpigpu.bench.main import main

sys.exit(main())
