"""The old home of the PyTorch integration (``mpigpu.integrations.torch``), now ``mpigpu.training.torch``:
kept so that ``from mpigpu.integrations.torch import BackwardAverager``, which earlier docs showed, works."""
