"""``from mpigpu.failsafe import abort_on_exception`` (earlier samples): now ``mpigpu.job.failsafe``; a
program calls ``mpigpu.install_abort_handler()``. Kept working, with a DeprecationWarning."""

from mpigpu._moved import moved

__getattr__ = moved(__name__, "mpigpu.job.failsafe", use="call mpigpu.install_abort_handler()")
