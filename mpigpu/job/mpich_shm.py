"""MPICH's own shared-memory segment of a job, removed when mpigpu ends the job.

MPICH (the ``mpich`` wheel included) keeps one 2-4 MiB file per job and node, named
``/dev/shm/mpich_shm_<hash of the job's PMI name>_<node>``, which every rank of the node maps; it
unlinks it in ``MPI_Finalize``. ``MPI_Abort`` kills the ranks first, so each job that ends that way
left its file behind (54 after one run of the test suite). A rank that ends the job removes the
segments it maps itself: they are its own job's, never another job's, and unlinking a name leaves the
mappings of the other ranks valid until they end. Open MPI and MPICH builds without such files:
nothing to do.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["remove_own_segments"]

_SHM_DIR = "/dev/shm/"
_PREFIX = "mpich"  # mpich_shm_* (MPICH 4.1+); other MPICH segments of the job go with it


def _own_segments() -> set[str]:
    """Paths of the MPICH files in /dev/shm that this process maps (its job's, on this node)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:  # not Linux
        return set()
    found = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(_SHM_DIR + _PREFIX) and not fields[5].endswith(" (deleted)"):
            found.add(fields[5])
    return found


def remove_own_segments() -> None:
    """Unlink this job's MPICH files in /dev/shm: call it only when the job is about to end by
    ``MPI_Abort`` (a rank still starting would no longer find them). Never raises."""
    for path in _own_segments():
        with contextlib.suppress(OSError):
            os.unlink(path)
