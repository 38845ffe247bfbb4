"""Starting the timeline on every rank (MPIGPU_TIMELINE): its directory, and one clock for the job.

Collective, run when mpigpu starts on its first communicator, and only where the setting is on
(whether it is on is agreed with the other settings, so every rank runs these exchanges or none):

- each rank opens the directory as a private one (created 0700; a symbolic link, or a directory of
  another user or writable by others, is refused): a rank that cannot fails every rank with the same
  ConfigError naming it, before any call is recorded;
- ranks on another host than rank 0's measure their clock's offset to rank 0's (the best of a few
  round trips, NTP's estimate); ranks on rank 0's host share its clock (offset 0).
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

from mpigpu.core import timeline
from mpigpu.core._mpi import MPI
from mpigpu.core.config import Settings
from mpigpu.core.errors import ConfigError
from mpigpu.core.privatefs import PrivateDir, UntrustedPath
from mpigpu.core.typed import allgather_text

__all__ = ["clock_offset", "start_timeline"]

_ROUND_TRIPS = 8


def start_timeline(comm: Any, settings: Settings, node: int) -> None:
    """Turn the timeline on for this process, agreed with every rank of ``comm`` (collective where
    ``settings.timeline`` is set, which every rank agrees on; nothing where it is not). ``node``: this
    rank's node, which its file records so that the merged trace names it."""
    if settings.timeline is None or timeline.recorder() is not None:
        return
    directory: PrivateDir | None = None
    problem = ""
    try:
        directory = PrivateDir.open(settings.timeline)
    except (UntrustedPath, OSError) as exc:
        problem = str(exc) or type(exc).__name__
    problems = allgather_text(comm, problem)
    if any(problems):
        if directory is not None:
            directory.close()
        failed = "; ".join(f"rank {r}: {text}" for r, text in enumerate(problems) if text)
        from mpigpu.job.check import mark_raised_everywhere

        raise mark_raised_everywhere(
            comm,
            ConfigError(
                f"MPIGPU_TIMELINE={settings.timeline} cannot be used ({failed}). Give a directory of yours that "
                "only you can write (it is created 0700 if missing), not a symbolic link, or unset MPIGPU_TIMELINE."
            ),
            same_text=True,
        )
    assert directory is not None
    offset = clock_offset(comm)
    timeline.start(directory, comm.Get_rank(), comm.Get_size(), settings.timeline_events, offset, node)


def clock_offset(comm: Any) -> int:
    """Nanoseconds to add to this rank's ``timeline.now()`` to read rank 0's clock (collective): 0 on
    rank 0's host, else the offset of the fastest of a few round trips to rank 0."""
    hosts = allgather_text(comm, socket.gethostname())
    remote = [r for r, host in enumerate(hosts) if host != hosts[0]]
    if not remote:
        return 0
    mpi, rank = MPI(), comm.Get_rank()
    stamp = np.zeros(1, np.int64)
    offset = 0
    for peer in remote:  # rank 0 answers each remote rank in turn; the others wait in the next exchange
        if rank == 0:
            for _ in range(_ROUND_TRIPS):
                comm.Recv([stamp, mpi.INT64_T], source=peer, tag=7)
                stamp[0] = timeline.now()
                comm.Send([stamp, mpi.INT64_T], dest=peer, tag=7)
        elif rank == peer:
            best = None
            for _ in range(_ROUND_TRIPS):
                sent = timeline.now()
                comm.Send([stamp, mpi.INT64_T], dest=0, tag=7)
                comm.Recv([stamp, mpi.INT64_T], source=0, tag=7)
                back = timeline.now()
                if best is None or back - sent < best[0]:
                    best = (back - sent, int(stamp[0]) - (sent + back) // 2)
            assert best is not None
            offset = best[1]
    return offset
