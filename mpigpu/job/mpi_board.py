"""The check board across nodes: the cross-rank argument check, and a tiny allreduce's data, in one
MPI_Allgather.

Where a communicator's ranks span nodes, no memory is shared among all of them, so the node-shared
board (mpigpu.job.check_board) cannot serve. Where a node holds two ranks or more, ``open_mpi_board``
opens the two-level board (mpigpu.job.node_mpi_board: the same slots, moved among the node leaders
only); with one rank per node, this flat one, whose Allgather is already the leaders' exchange. It
keeps the node board's interface and its slot layout (per rank ``[k, 9 values, data]`` on 256 bytes;
``k`` unused here: the Allgather is the wait) and moves the slots with one MPI_Allgather (in place:
each rank writes its own slot of the receive buffer, then every rank holds every rank's slot). Every
rank then compares every rank's values with its own, as on the node board, so every rank reaches the
same verdict; and a tiny host allreduce
(mpigpu.backends.cpu_board) reduces every rank's posted data in rank order: the check and the data
in one MPI round instead of MPI_Allreduce(MAX) of the signature and then MPI_Allreduce of the data.

Every check moves the whole slot, data area included, whatever the caller posts: the Allgather's
count must be the same on every rank, and a rank whose call takes the fused path may meet one whose
call does not (its signature differs: the check fails on every rank, nothing is read). The cost
grows with the ranks (256 bytes each), where MPI_Allreduce(MAX) of 18 int64 does not: the board is
used up to ``MAX_RANKS`` ranks, and the check goes through MPI_Allreduce(MAX) past it
(docs/scaling.md gives the model).

No rank can run ahead: the Allgather completes on a rank only once every rank has posted, so the
check numbers of ``reached`` are not known here (the stall report says so).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpigpu.core._mpi import MPI
from mpigpu.job.check_board import DATA_BYTES, FIELDS, SLOT_BYTES, BoardPosts, board_for, register
from mpigpu.job.native_board import Exchange, Plan, compiled, plan
from mpigpu.job.node_mpi_board import NodeMpiBoard, open_node_mpi_board
from mpigpu.job.topology import Layout

__all__ = ["MAX_RANKS", "MpiBoard", "open_mpi_board"]

# Up to this many ranks the check travels as an Allgather of 256-byte slots (64 KiB at 256 ranks),
# beyond it as MPI_Allreduce(MAX) of 144 bytes, whose cost does not grow with the payload.
MAX_RANKS = 256
_VALUES = 8 * FIELDS
_DATA = 8 + _VALUES  # a slot's data: its offset in bytes
assert SLOT_BYTES - _DATA == DATA_BYTES, "the same slot layout as the node board"


class MpiBoard(BoardPosts):
    """Signatures (and tiny data) of every rank of ``comm``, exchanged by one MPI_Allgather per check.

    Used by one thread at a time, in the same order on every rank (the callers' rule), as the node
    board. Nothing to free but its buffers: ``close`` only unregisters it."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.k = 0  # checks made on this board
        # two receive buffers, alternating per check (the node board's parities): rows a caller got from
        # check k stay intact while this rank posts check k + 1
        self._buffers = tuple(np.zeros(SLOT_BYTES * self.size, np.uint8) for _ in (0, 1))
        self._bytes = tuple(memoryview(b) for b in self._buffers)
        self._counters = tuple(mv.cast("q") for mv in self._bytes)
        mine = SLOT_BYTES * self.rank
        self._my_values = tuple(mv[mine + 8 : mine + _DATA] for mv in self._bytes)
        self._others = tuple(
            tuple(mv[SLOT_BYTES * r + 8 : SLOT_BYTES * r + _DATA] for r in range(self.size) if r != self.rank)
            for mv in self._bytes
        )
        mpi = MPI()
        self._gather = comm.Allgather
        self._in_place = mpi.IN_PLACE
        self._specs = tuple([b, mpi.BYTE] for b in self._buffers)  # made once: the call's buffer argument
        self.native = compiled(self._plans, exchanges=True)  # the same steps in one C call, where it is here

    def _plans(self) -> list[tuple[Plan, list[Any]]]:
        """Per parity, this board as the compiled exchange sees it: post, Allgather in place, compare."""
        in_place = int(MPI().IN_PLACE)
        plans = []
        for buffer in self._buffers:
            base = buffer.ctypes.data
            rows = [base + SLOT_BYTES * r for r in range(self.size)]
            gather = Exchange(self.comm, in_place, base, SLOT_BYTES)
            plans.append(plan(rows[self.rank], None, [], rows, gather))
        return plans

    def _agree_in_python(self, k: int, packed: bytes) -> bool:
        """Post, one MPI_Allgather of every rank's slot, compare."""
        parity = k & 1
        self._my_values[parity][:] = packed
        self._gather(self._in_place, self._specs[parity])
        for values in self._others[parity]:  # noqa: SIM110 - the hot path: no generator
            if values != packed:
                return False
        return True

    def rows(self, dtype: Any, shape: tuple[int, ...]) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        """Per parity, every rank's data area as an array of ``dtype`` and ``shape`` (at most DATA_BYTES),
        in rank order: views into the receive buffers for ``agree_with``."""
        return tuple(
            tuple(np.ndarray(shape, dtype, buffer=b, offset=SLOT_BYTES * r + _DATA) for r in range(self.size))
            for b in self._buffers
        )  # type: ignore[return-value]

    def posted(self) -> list[list[int]]:
        """Every rank's values of the last check, in rank order (local)."""
        counters = self._counters[self.k & 1]
        step = SLOT_BYTES // 8
        return [list(counters[step * r + 1 : step * r + 1 + FIELDS]) for r in range(self.size)]

    def reached(self) -> None:
        """Not known: the ranks meet in the Allgather, which no rank passes before every rank is in it."""
        return None

    def close(self) -> None:
        """Unregister the board (local; idempotent; the buffers go with the object)."""
        if board_for(self.comm) is self:
            register(self.comm, None)
        self.native = None


def open_mpi_board(comm: Any, layout: Layout | None = None) -> MpiBoard | NodeMpiBoard | None:
    """The board of ``comm`` across nodes (the caller found no node board), registered for
    ``check_signature``: the two-level one (mpigpu.job.node_mpi_board) where ``layout`` (``comm``'s
    nodes) is given and a node holds two ranks or more, else the flat Allgather; None past MAX_RANKS
    ranks, where the check goes through MPI_Allreduce. Collective over ``comm`` where ``layout`` is
    given (local otherwise); the choice is the same on every rank."""
    if comm.Get_size() > MAX_RANKS:
        return None
    if layout is not None:
        two_level = open_node_mpi_board(comm, layout.node_comm, layout.nodes)
        if two_level is not None:
            return two_level
    board = MpiBoard(comm)
    register(comm, board)
    return board
