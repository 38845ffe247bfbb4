"""``python -m mpigpu.timeline``."""

import sys

from mpigpu.timeline import main

sys.exit(main())
