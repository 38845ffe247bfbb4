"""MPICH's own shared-memory segment of a job, removed when mpigpu ends the job.

MPICH (the ``mpich`` wheel included) keeps one 2-4 MiB file per job and node, named
``/dev/shm/mpich_shm_<hash of the job's PMI name>_<node>``, which every rank of the node maps; it
unlinks it in ``MPI_Finalize``. ``MPI_Abort`` kills the ranks first, so each job that ends that way
left its file behind (54 after one run of the test suite). A rank that ends the job removes the
segments it maps itself: they are its own job's, never another job's, and unlinking a name leaves the
mappings of the other ranks valid until they end. Open MPI and MPICH builds without such files:
nothing to do.

A rank killed outright (``kill -9``, the OOM killer) removes nothing: ``leftovers`` finds the files
of jobs that are gone (``python -m mpigpu.cleanup`` removes them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import time

__all__ = ["Leftover", "leftovers", "remove", "remove_own_segments"]

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


@dataclasses.dataclass(frozen=True)
class Leftover:
    """An MPICH file of a job that is gone: this user's, a regular file, mapped and held by no process."""

    name: str
    nbytes: int
    age_s: float
    inode: int


def _held(directory: str) -> tuple[set[str], list[int]]:
    """Names of the files in ``directory`` that a process maps or holds open, and the processes whose
    maps could not be read (another user's; or non-dumpable ones, such as a container's init: an MPI
    rank is an ordinary process its user can read)."""
    prefix = os.path.join(directory, "")
    held: set[str] = set()
    unread = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = line.split(maxsplit=5)[5:]
                    if path and path[0].startswith(prefix):
                        held.add(path[0].rstrip("\n").removesuffix(" (deleted)")[len(prefix) :])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        held.add(target[len(prefix) :])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended meanwhile
        except PermissionError:
            unread.append(int(pid))
    return held, unread


def leftovers(directory: str = _SHM_DIR, min_age_s: float = 60.0) -> tuple[list[Leftover], list[int]]:
    """MPICH's files in ``directory`` whose job is gone: owned by this user, with no access for anyone
    else (so only this user's processes can map them), regular files (a symlink is never followed),
    older than ``min_age_s`` (a job still starting may not have mapped its file yet), and mapped and
    held open by no process that could be read; and the processes that could not be read."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        me, now = os.geteuid(), time.time()
        candidates = []
        for name in os.listdir(dir_fd):
            if not name.startswith(_PREFIX):
                continue
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != me or st.st_mode & 0o077:
                continue
            if now - st.st_mtime >= min_age_s:
                candidates.append(Leftover(name, st.st_size, now - st.st_mtime, st.st_ino))
    finally:
        os.close(dir_fd)
    if not candidates:
        return [], []
    held, unread = _held(directory)
    return [c for c in candidates if c.name not in held], unread


def remove(directory: str, found: list[Leftover]) -> list[Leftover]:
    """Unlink each of ``found`` in ``directory`` that is still the same file (name and inode); the removed."""
    removed = []
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for leftover in found:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(leftover.name, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_ino == leftover.inode:
                    os.unlink(leftover.name, dir_fd=dir_fd)
                    removed.append(leftover)
    finally:
        os.close(dir_fd)
    return removed
