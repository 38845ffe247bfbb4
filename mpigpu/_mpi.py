"""``from mpigpu._mpi import world`` (earlier samples): now ``mpigpu.core._mpi``; a program uses
``from mpi4py import MPI`` and ``MPI.COMM_WORLD``. Kept working, with a DeprecationWarning."""

from mpigpu._moved import moved

__getattr__ = moved(__name__, "mpigpu.core._mpi", use="use `from mpi4py import MPI` and MPI.COMM_WORLD")
