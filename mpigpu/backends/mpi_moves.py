"""Broadcast, allgather and alltoall as plain MPI byte moves, shared by the backends that hand memory to MPI
(cpu: NumPy arrays; cuda-aware: device pointers; host: pinned staging buffers). Data movement needs
no reduction semantics, so every dtype travels as MPI_BYTE."""

from __future__ import annotations

from itertools import accumulate
from typing import Any

from mpigpu.core._mpi import MPI

__all__ = ["allgather_bytes", "alltoall_bytes", "broadcast_bytes", "byte_counts", "row_bytes"]


_COUNTS: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}


def byte_counts(rows: list[int], row_bytes: int) -> tuple[list[int], list[int]]:
    """Per-rank byte counts and displacements of an allgather of ``rows[r]`` rows of ``row_bytes``
    (remembered: a training loop repeats a few; treat as read-only)."""
    key = (row_bytes, *rows)
    found = _COUNTS.get(key)
    if found is None:
        if len(_COUNTS) >= 4096:
            _COUNTS.clear()
        counts = [r * row_bytes for r in rows]
        found = _COUNTS[key] = (counts, [0, *accumulate(counts)][:-1])
    return found


def row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one row (first-dimension index) of a C-order array of ``shape``."""
    count = itemsize
    for extent in shape[1:]:
        count *= extent
    return count


def broadcast_bytes(comm: Any, buf: Any, nbytes: int, root: int) -> None:
    """MPI_Bcast of ``nbytes`` at ``buf`` (a writable buffer: NumPy array or mpi4py buffer)."""
    comm.Bcast([buf, nbytes, MPI().BYTE], root=root)


def allgather_bytes(comm: Any, send: Any, recv: Any, rows: list[int], row_bytes: int) -> None:
    """MPI_Allgatherv: rank r's ``rows[r] * row_bytes`` bytes at ``send`` land at its offset in ``recv``."""
    counts, displs = byte_counts(rows, row_bytes)
    byte = MPI().BYTE
    comm.Allgatherv([send, counts[comm.Get_rank()], byte], [recv, (counts, displs), byte])


def alltoall_bytes(comm: Any, send: Any, recv: Any, send_rows: list[int], recv_rows: list[int], row_bytes: int) -> None:
    """MPI_Alltoallv: ``send_rows[j]`` rows of ``send`` go to rank j, in rank order; ``recv_rows[j]``
    rows from rank j land in ``recv``, in rank order."""
    byte = MPI().BYTE
    comm.Alltoallv([send, byte_counts(send_rows, row_bytes), byte], [recv, byte_counts(recv_rows, row_bytes), byte])
