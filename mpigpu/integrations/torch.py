"""``from mpigpu.integrations.torch import BackwardAverager`` (earlier docs and samples): now
``from mpigpu import BackwardAverager`` (``mpigpu.training.torch``); kept working, with a DeprecationWarning."""

from mpigpu._moved import moved

__getattr__ = moved(__name__, "mpigpu.training.torch", use="from mpigpu import BackwardAverager")
