"""The one place that imports mpi4py.

Importing mpigpu starts nothing: MPI is initialised the first time a function here needs it,
which is the first collective, ``select_device``, ``info`` or a command's ``main``.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from mpigpu.core.errors import MissingDependency, install_hint

__all__ = ["MPI", "LibraryInfo", "launcher_local_rank", "launcher_rank", "libmpi_path", "library_info", "world"]

_FIX = (
    f"Install an MPI: {install_hint('mpi', 'mpich')} bundles MPICH (laptops, CI); on a cluster load the "
    "site's MPI module instead (mpi4py then finds it, or set MPI4PY_LIBMPI=/path/to/libmpi.so)."
)


def launcher_rank() -> int:
    """This process's rank as the launcher announced it (-1 outside a launcher); starts no MPI."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return -1


def launcher_local_rank() -> int:
    """This process's rank among the job's processes on its node, as the launcher announced it (-1 if
    none did); starts no MPI."""
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                "PALS_LOCAL_RANKID", "SLURM_LOCALID"):  # fmt: skip
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return -1


@functools.cache
def MPI() -> ModuleType:
    """Return ``mpi4py.MPI``, initialising MPI on first call (mpi4py's ``rc`` settings apply)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError as exc:
        raise MissingDependency(f"mpi4py is not installed. `pip install mpi4py`, then: {_FIX}") from exc
    try:
        from mpi4py import MPI as mod
    except (ImportError, RuntimeError, OSError) as exc:
        raise MissingDependency(f"mpi4py could not load an MPI library ({exc}). {_FIX}") from exc
    return mod


def world() -> Any:
    """The world communicator."""
    return MPI().COMM_WORLD


@dataclass(frozen=True)
class LibraryInfo:
    """Which MPI library mpi4py loaded, and how it was found."""

    name: str  # "MPICH", "Open MPI", "Intel MPI", "MVAPICH", "Cray MPICH", or the first word
    version: str  # the library's own version line
    standard: str  # MPI standard version, e.g. "4.1"
    path: str  # the loaded libmpi, or "" if unknown
    found_by: str  # how mpi4py found it


def _classify(version_text: str) -> str:
    text = version_text.lower()
    if "intel(r) mpi" in text or "intel mpi" in text:
        return "Intel MPI"
    if "open mpi" in text:
        return "Open MPI"
    if "mvapich" in text:
        return "MVAPICH"
    if "cray" in text:
        return "Cray MPICH"
    if "mpich" in text:
        return "MPICH"
    return version_text.split()[0] if version_text.split() else "unknown"


def libmpi_path() -> str:
    """Path of the libmpi shared object loaded into this process ("" if it cannot be seen)."""
    MPI()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libmpi" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return ""


@functools.cache
def library_info() -> LibraryInfo:
    """Describe the loaded MPI library (cached)."""
    mod = MPI()
    text = mod.Get_library_version().replace("\0", "").strip()
    first = text.splitlines()[0].strip() if text else "unknown"
    major, minor = mod.Get_version()
    path = libmpi_path()
    if os.environ.get("MPI4PY_LIBMPI"):
        found_by = f"MPI4PY_LIBMPI={os.environ['MPI4PY_LIBMPI']}"
    elif path.startswith(sys.prefix):
        found_by = f"the Python environment ({sys.prefix}), e.g. the mpich wheel"
    elif path:
        found_by = "the system's library search path"
    else:
        found_by = "mpi4py's default"
    name = _classify(text)
    version = " ".join(first.split())
    return LibraryInfo(name=name, version=version, standard=f"{major}.{minor}", path=path, found_by=found_by)
