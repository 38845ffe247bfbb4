"""The order in which the ranks of a job leave when every rank ends with the same error, so that the
launcher reports the error's status and no launcher banner.

MPICH's hydra kills every other process of the job as soon as one exits after ``MPI_Finalize`` (its
PMI socket closes without a "finalize" message), and a process it kills while it still forwards some
rank's output is reported as "BAD TERMINATION ... EXIT CODE: 9", the job's status 9. Four plain
mpi4py processes that each call ``MPI_Finalize`` and exit 1 got that in 6 of 12 runs on a loaded
2-core machine. So after ``MPI_Finalize`` each rank points its copies of the stdout and stderr pipes
at /dev/null; each rank other than 0 then names itself ``mpigpu-left`` (``/proc/self/comm``) and
waits for rank 0 to exit; rank 0 waits until every other rank of its node has that name, then exits
first, with the error's status: hydra then has no output to forward and ends the others quietly.
Ranks on other nodes cannot be seen: rank 0 gives them ``REMOTE_GRACE_S``. Open MPI's mpirun reports
the first non-zero status the same way.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

__all__ = ["Peers", "after_finalize", "gather_peers"]

WAIT_S = 5.0  # the longest wait for the other side (every rank, after MPI_Finalize)
REMOTE_GRACE_S = 0.5  # rank 0's wait for ranks on other nodes, which it cannot see
LEFT = b"mpigpu-left"  # a rank's name once it is past MPI_Finalize (at most 15 bytes)
_POLL_S = 0.002

Process = tuple[int, str]  # (pid, start time from /proc/<pid>/stat: tells a reused pid apart)


class Peers:
    """What a rank needs after MPI_Finalize: rank 0 the other processes of its node; the others rank
    0's process where it runs on their node."""

    def __init__(self, rank: int, local: list[Process], remote: bool) -> None:
        self.rank, self.local, self.remote = rank, local, remote


def _stat(pid: int) -> tuple[bytes, str] | None:
    """The process's state and start time in clock ticks since boot (fields 3 and 22 of proc(5)'s
    /proc/<pid>/stat), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        return fields[0], fields[19].decode()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str:
    """The process's start time ("" where /proc cannot tell)."""
    stat = _stat(pid)
    return stat[1] if stat else ""


def _alive(process: Process) -> bool:
    """The process runs: the same pid with the same start time, and not a zombie."""
    pid, started = process
    stat = _stat(pid)
    return stat is not None and stat[0] != b"Z" and stat[1] == started


def _has_left(process: Process) -> bool:
    """The process is past MPI_Finalize (it carries LEFT as its name) or has ended."""
    if not _alive(process):
        return True
    try:
        with open(f"/proc/{process[0]}/comm", "rb") as comm:
            return comm.read().strip() == LEFT
    except OSError:
        return True


def _close_output() -> None:
    """Point every descriptor of this process that writes to the launcher's stdout or stderr pipe at
    /dev/null, so the pipes close before any rank exits. Hydra's proxy stops waiting on output once
    every pipe is closed; while one is open, a rank it kills on another's exit is reported as killed
    (status 9 under the banner) rather than ended. Libraries hold copies of both (MPICH: two more)."""
    targets = set()
    for fd in (1, 2):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        if target.startswith(("pipe:", "socket:")):
            targets.add(target)
    if not targets:
        return
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in fds:
        try:
            if fd != null and os.readlink(f"/proc/self/fd/{fd}") in targets:
                os.dup2(null, fd)
        except OSError:
            pass
    os.close(null)


def gather_peers(comm: Any) -> Peers:
    """Every rank, before ``MPI_Finalize``: exchange each rank's host and process (a collective of all
    ranks, so also the barrier past which every rank has joined the ending)."""
    pid = os.getpid()
    mine = (socket.gethostname(), pid, _start_time(pid))
    every = comm.allgather(mine)
    rank, host = comm.Get_rank(), mine[0]
    if rank == 0:
        local = [(p, started) for h, p, started in every[1:] if h == host and started]
        return Peers(0, local, any(h != host for h, _, _ in every))
    h, p, started = every[0]
    return Peers(rank, [(p, started)] if h == host and started else [], h != host)


def _wait(until: Any, processes: list[Process]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(until(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def after_finalize(peers: Peers) -> None:
    """Every rank, after ``MPI_Finalize`` and before exiting with the error's status: rank 0 returns
    once every other rank of its node is past MPI_Finalize (at most WAIT_S, and REMOTE_GRACE_S more
    where ranks run elsewhere); another rank says it is past and returns once rank 0 has exited (the
    launcher usually ends it first; at most WAIT_S)."""
    _close_output()
    if peers.rank == 0:
        _wait(_has_left, peers.local)
        if peers.remote:
            time.sleep(REMOTE_GRACE_S)
        return
    try:
        with open("/proc/self/comm", "wb") as comm:
            comm.write(LEFT)
    except OSError:  # not Linux: rank 0 waits its grace instead
        pass
    if peers.local:
        _wait(lambda p: not _alive(p), peers.local)
    elif peers.remote:  # rank 0 runs elsewhere: outwait its grace
        time.sleep(2 * REMOTE_GRACE_S)
