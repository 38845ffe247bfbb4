"""Fixed-format exchanges between ranks: integers and UTF-8 text in typed MPI buffers, never pickle.

mpi4py's lowercase calls (``comm.allgather(obj)``, ``comm.bcast(obj)``, ``comm.allreduce(int)``)
pickle their objects and hold the GIL while they wait; what mpigpu exchanges to start on a
communicator (settings, layout, devices, capabilities, the tuning table, ipc handles) goes through
these instead. What still pickles is listed in docs/troubleshooting.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpigpu.core._mpi import MPI

__all__ = ["allgather_bytes", "allgather_ints", "allgather_text", "allreduce_int", "bcast_text"]


def allreduce_int(comm: Any, value: int, op: str) -> int:
    """``value`` reduced over the ranks with ``op`` ("min", "max" or "sum"), as an int64 (collective)."""
    mpi = MPI()
    result = np.zeros(1, np.int64)
    comm.Allreduce([np.array([value], np.int64), mpi.INT64_T], [result, mpi.INT64_T], getattr(mpi, op.upper()))
    return int(result[0])


def allgather_ints(comm: Any, values: Sequence[int]) -> list[tuple[int, ...]]:
    """Every rank's ``values`` (the same count on every rank), in rank order (collective)."""
    mpi = MPI()
    mine = np.array(values, np.int64).reshape(-1)
    everyone = np.empty((comm.Get_size(), mine.size), np.int64)
    comm.Allgather([mine, mpi.INT64_T], [everyone, mpi.INT64_T])
    return [tuple(int(v) for v in row) for row in everyone]


def allgather_bytes(comm: Any, data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order (collective: the lengths, then the bytes)."""
    mpi = MPI()
    mine = np.frombuffer(data, np.uint8)
    counts = np.array([n for (n,) in allgather_ints(comm, [mine.size])], np.int64)
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
    everyone = np.empty(max(1, int(counts.sum())), np.uint8)
    comm.Allgatherv([mine, mpi.BYTE], [everyone, (counts.tolist(), offsets.tolist()), mpi.BYTE])
    return [everyone[o : o + n].tobytes() for o, n in zip(offsets.tolist(), counts.tolist(), strict=True)]


def allgather_text(comm: Any, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (collective)."""
    return [data.decode() for data in allgather_bytes(comm, text.encode())]


def bcast_text(comm: Any, text: str | None, root: int = 0) -> str | None:
    """``root``'s ``text`` (or None) on every rank (collective: the length, then the UTF-8 bytes)."""
    mpi = MPI()
    data = b"" if text is None else text.encode()
    header = np.array([-1 if text is None else len(data)], np.int64)
    comm.Bcast([header, mpi.INT64_T], root=root)
    if header[0] < 0:
        return None
    buffer = np.frombuffer(data, np.uint8).copy() if comm.Get_rank() == root else np.empty(int(header[0]), np.uint8)
    if buffer.size:
        comm.Bcast([buffer, mpi.BYTE], root=root)
    return buffer.tobytes().decode()
