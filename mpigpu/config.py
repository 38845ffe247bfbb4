"""``from mpigpu.config import parse_count`` (earlier samples): now ``mpigpu.core.config``. Kept working,
with a DeprecationWarning."""

from mpigpu._moved import moved

__getattr__ = moved(__name__, "mpigpu.core.config")
