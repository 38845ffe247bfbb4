"""``mpigpu.arrays.raw_view`` (earlier docs/jax.md): now ``mpigpu.core.arrays``. Kept working, with a
DeprecationWarning."""

from mpigpu._moved import moved

__getattr__ = moved(__name__, "mpigpu.core.arrays")
