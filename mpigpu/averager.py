"""``from mpigpu.averager import Averager`` (earlier docs and samples): now ``from mpigpu import Averager``
(``mpigpu.training.averager``). Kept working, with a DeprecationWarning."""

from mpigpu._moved import moved

__getattr__ = moved(__name__, "mpigpu.training.averager", use="from mpigpu import Averager")
