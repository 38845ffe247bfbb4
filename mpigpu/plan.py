"""``mpigpu.plan`` (earlier docs/bench.md: ``mpigpu.plan.machine_signature``): now ``mpigpu.runtime.plan``
and, for the tuning table's machine signature, ``mpigpu.runtime.tuning``. Kept working, with a
DeprecationWarning."""

from mpigpu._moved import moved

__getattr__ = moved(__name__, "mpigpu.runtime.plan", "mpigpu.runtime.tuning")
