"""The node-local check board: the cross-rank argument check through node-shared memory.

When every rank of a communicator is on one node, the signature check needs no MPI collective:
each rank writes its signature into a node-shared segment and reads everyone else's. Layout: per
rank, two slots (the parity of the per-communicator check number ``k``), each ``[k, 9 values, data]``
on its own 256 bytes. The data (at most ``DATA_BYTES``) is what a tiny host allreduce posts beside its
signature (``agree_with``): when the ranks agree, every rank reads every rank's data from the board and
no MPI call moves it. A rank writes its values, fences (``MPI_Win_sync``: a memory barrier, needed
on weakly ordered CPUs such as Grace; x86 keeps stores in order and loads in order, so there the
fence is left out), then writes ``k``; it waits until every rank's slot of parity ``k % 2`` holds
``k``, fences, and compares every rank's values with its own. All equal on one rank means all equal
on every rank, and any difference is seen by every rank (each compares with the one that differs, or
is it), so every rank reaches the same verdict.

A caller that posts the same signature many times packs it once (``pack``) and posts the bytes
(``agree_packed``): a check is then a copy of 72 bytes, one store, the wait and the comparisons.

Two parities are enough: a rank can reach check ``k + 2`` (and overwrite the slot of parity
``k % 2``) only after every rank has written ``k + 1``, and a rank writes ``k + 1`` only after it
finished reading the slots of ``k``.

Waiting does not burn an oversubscribed machine (``shm.wait_at_least``: it spins briefly, then yields
the CPU, then sleeps in short steps). A rank that never arrives leaves the others waiting here exactly as in an MPI
collective, so the caller's watchdog (``MPIGPU_TIMEOUT``) ends it with its usual error.
"""

from __future__ import annotations

import contextlib
import platform
import struct
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from mpigpu.core._mpi import MPI
from mpigpu.core.errors import MpigpuError
from mpigpu.core.typed import allreduce_int
from mpigpu.job.native_board import Native, Plan, compiled, plan
from mpigpu.job.shm import SharedSegment, wait_at_least

__all__ = [
    "DATA_BYTES",
    "SLOT_BYTES",
    "WEAK_ORDER",
    "Board",
    "BoardPosts",
    "CheckBoard",
    "board_for",
    "made_on_every_rank",
    "open_board",
    "pack",
    "register",
]

FIELDS = 9  # values per signature (check._FIELDS)
_SLOT = 32  # int64 per slot: [k, 9 values, data] = 256 bytes, four cache lines
_VALUES = 8 * FIELDS  # bytes of a slot's values
_DATA = 8 + _VALUES  # a slot's data: its offset in bytes (16-byte aligned) and its size
SLOT_BYTES = 8 * _SLOT
DATA_BYTES = SLOT_BYTES - _DATA
_PACK = struct.Struct(f"={FIELDS}q").pack  # native int64, as the "q" view reads them
# x86 (total store order) never reorders a store with an earlier store, nor a load with an earlier load:
# the values are visible before k without a fence. Elsewhere (Arm: Grace) the fences are needed.
WEAK_ORDER = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686")


Posts = tuple[np.ndarray, np.ndarray]  # this rank's row of a board's ``rows``, per parity (``post_row``)


class Board(Protocol):
    """What the check's callers use of a board: this node-shared one, or one across nodes (the two-level
    mpigpu.job.node_mpi_board, the flat mpigpu.job.mpi_board)."""

    comm: Any
    size: int
    rank: int
    k: int
    native: Native | None  # the compiled exchange (mpigpu.job.native_board), or None: the Python path

    def agree(self, values: list[int]) -> bool: ...
    def agree_packed(self, packed: bytes) -> bool: ...
    def rows(self, dtype: Any, shape: tuple[int, ...]) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]: ...
    def agree_with(self, packed: bytes, data: np.ndarray, rows: tuple[tuple[np.ndarray, ...], ...]) -> Any: ...
    def post_row(self, rows: Any, parity: int) -> np.ndarray: ...
    def agree_folding(self, packed: bytes, data: np.ndarray, posts: Posts, fold: int) -> bool: ...
    def posted(self) -> list[list[int]]: ...
    def reached(self) -> list[int] | None: ...
    def close(self) -> None: ...


B = TypeVar("B", bound=Board)

# id(communicator object) -> (that object, its board): check_signature looks its communicator up here
_BOARDS: dict[int, tuple[Any, Board]] = {}


def pack(values: list[int]) -> bytes:
    """A signature's FIELDS values as the board stores them (made once per signature by callers that
    post it many times)."""
    return _PACK(*values)


class BoardPosts:
    """What every board does around its own exchange: the check's count and its path (``agree_packed``: the
    compiled exchange, else the board's ``_agree_in_python``), the check of unpacked values, and a call's
    data posted in this rank's row of ``rows`` (``post_row``) before the check, for the Python fold
    (``agree_with``) or the compiled one (``agree_folding``)."""

    rank: int
    k: int
    native: Native | None

    def agree_packed(self, packed: bytes) -> bool:
        """``agree`` for values already packed (``pack``) whose failed flag is 0: True when every rank posted
        these very bytes (collective), as check ``k + 1``: in the compiled exchange where the board has one,
        else on the board's Python path (``_agree_in_python``). The hot path of every call's check."""
        k = self.k + 1
        self.k = k
        native = self.native
        if native is not None:
            return native.run(k, packed)
        return self._agree_in_python(k, packed)

    def _agree_in_python(self, k: int, packed: bytes) -> bool:
        """Check ``k`` of ``packed`` on this board's Python path (``k`` already counted)."""
        raise NotImplementedError

    def post_row(self, rows: Any, parity: int) -> np.ndarray:
        """This rank's row of ``rows`` (a board's ``rows``) for checks of ``parity``: where its data goes."""
        return rows[parity][self.rank]  # type: ignore[no-any-return]

    def agree(self, values: list[int]) -> bool:
        """Post ``values`` (FIELDS int64) as check ``k + 1``; True when every rank posted the same values
        with values[0] (the failed flag) 0 (collective)."""
        return self.agree_packed(_PACK(*values)) and values[0] == 0

    def agree_with(self, packed: bytes, data: np.ndarray, rows: Any) -> Any:
        """``agree_packed`` with ``data`` posted beside the values (``rows`` from the board's ``rows``, for
        data's dtype and shape): every rank's rows of this check when every rank posted ``packed``
        (collective), else None. The rows hold until this rank's next check: no rank writes a slot of
        this parity again before this rank has posted the next check."""
        parity = (self.k + 1) & 1
        self.post_row(rows, parity)[...] = data  # before k is posted, as the values are
        return rows[parity] if self.agree_packed(packed) else None

    def agree_folding(self, packed: bytes, data: np.ndarray, posts: Posts, fold: int) -> bool:
        """``agree_with`` on the compiled path (``native`` set), the rows reduced there into the result of
        ``fold`` (a native_board.Fold's address): True where every rank posted ``packed``. ``posts``: this
        rank's row per parity (``post_row`` of the board's ``rows``, found once by the caller). A tiny
        call's hot path: one C call, no other call of Python's."""
        native = self.native
        assert native is not None
        k = self.k + 1
        posts[k & 1][...] = data  # before k is posted
        self.k = k
        rc = native.call(native.addresses[k & 1], k, packed, fold)
        return rc == 1 or native.verdict(rc)


class CheckBoard(BoardPosts):
    """Signatures of every rank of ``comm``, exchanged through a node-shared segment.

    Collective to create and close (over ``shared_comm``, the ranks of ``comm`` in the same order, all
    on one node). Used by one thread at a time, in the same order on every rank (the callers' rule)."""

    def __init__(self, comm: Any, shared_comm: Any) -> None:
        self.comm = comm
        self.size = shared_comm.Get_size()
        self.rank = shared_comm.Get_rank()
        if self.size != comm.Get_size() or self.rank != comm.Get_rank():
            raise MpigpuError("a check board needs every rank of its communicator on one node, in the same order")
        segment = SharedSegment(shared_comm, 2 * _SLOT * 8 * self.size)
        segment.touch(2 * _SLOT * 8 * self.rank, 2 * _SLOT * 8)  # k = 0 in both slots: no check yet
        segment.barrier()
        self._segment: SharedSegment | None = segment
        self._bytes: memoryview = memoryview(segment.array)
        self._mv: memoryview = self._bytes.cast("q")
        self._fence = segment.fence if WEAK_ORDER else None
        # slot offsets (in int64) of parity 0 and 1: this rank's, and every rank's in rank order
        self._mine = (2 * _SLOT * self.rank, 2 * _SLOT * self.rank + _SLOT)
        self._all = tuple(tuple(2 * _SLOT * r + p * _SLOT for r in range(self.size)) for p in (0, 1))
        # per parity: this rank's values (a view of their bytes), and (k's index, a view of the values'
        # bytes) of every other rank's slot; views made once, as slicing costs more than comparing
        self._my_values = tuple(self._bytes[8 * m + 8 : 8 * m + 8 + _VALUES] for m in self._mine)
        self._others = tuple(
            tuple((slot, self._bytes[8 * slot + 8 : 8 * slot + 8 + _VALUES]) for r, slot in enumerate(slots)
                  if r != self.rank)
            for slots in self._all
        )  # fmt: skip
        self.k = 0  # checks made on this board
        self.native = compiled(self._plans)  # the same steps in one C call, where the helper is here

    def _plans(self) -> list[tuple[Plan, list[Any]]]:
        """Per parity, this board as the compiled exchange sees it: post, wait for every other rank, compare."""
        assert self._segment is not None
        base = self._segment.array.ctypes.data
        plans = []
        for p in (0, 1):
            mine = base + 8 * self._mine[p]
            others = [base + 8 * slot for r, slot in enumerate(self._all[p]) if r != self.rank]
            plans.append(plan(mine, mine, others, [base + 8 * slot for slot in self._all[p]]))
        return plans

    def _agree_in_python(self, k: int, packed: bytes) -> bool:
        """Post on the node-shared segment, wait for every other rank's post of ``k``, compare."""
        parity = k & 1
        mv = self._mv
        self._my_values[parity][:] = packed
        fence = self._fence
        if fence is not None:
            fence()  # the values are visible before k is
        mv[self._mine[parity]] = k
        others = self._others[parity]
        for slot, _ in others:
            if mv[slot] != k:  # a slot of this parity holds k - 2 until its rank posts k, never more than k
                wait_at_least(mv, slot, k)
        if fence is not None:
            fence()  # k was seen: the values written before it are read after it
        for _, values in others:  # noqa: SIM110 - the hot path: no generator
            if values != packed:
                return False
        return True

    def rows(self, dtype: Any, shape: tuple[int, ...]) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        """Per parity, every rank's data area as an array of ``dtype`` and ``shape`` (at most DATA_BYTES),
        in rank order: views into the board for ``agree_with``, made once by its caller."""
        assert self._segment is not None, "the board is closed"
        array = self._segment.array
        return tuple(
            tuple(np.ndarray(shape, dtype, buffer=array, offset=8 * slot + _DATA) for slot in slots)
            for slots in self._all
        )  # type: ignore[return-value]

    def posted(self) -> list[list[int]]:
        """Every rank's values of the last check, in rank order (local). Valid until this rank's next
        check: no rank can overwrite a slot of parity k % 2 before this rank has posted k + 1."""
        mv = self._mv
        return [list(mv[slot + 1 : slot + 1 + FIELDS]) for slot in self._all[self.k & 1]]

    def reached(self) -> list[int]:
        """The last check number each rank has posted, in rank order (local; for the stall report:
        a rank whose number is below ``k`` has not reached this rank's check)."""
        mv = self._mv
        return [max(mv[self._all[0][r]], mv[self._all[1][r]]) for r in range(self.size)]

    def close(self) -> None:
        """Free the segment (collective; idempotent)."""
        if board_for(self.comm) is self:
            del _BOARDS[id(self.comm)]
        self.native = None  # its plans point into the segment
        if self._segment is not None:
            with contextlib.suppress(BufferError):  # a view still exported: freed with the segment anyway
                for view in (*self._my_values, *(values for slots in self._others for _, values in slots)):
                    view.release()
                self._mv.release()
                self._bytes.release()
            segment, self._segment = self._segment, None
            segment.close()


def register(comm: Any, board: Board | None) -> None:
    """Make ``board`` the one ``board_for(comm)`` finds (None: forget ``comm``'s)."""
    if board is None:
        _BOARDS.pop(id(comm), None)
    else:
        _BOARDS[id(comm)] = (comm, board)


def board_for(comm: Any) -> Board | None:
    """The board of ``comm`` (the communicator object itself), or None: check through MPI_Allreduce."""
    entry = _BOARDS.get(id(comm))
    if entry is not None and entry[0] is comm:
        return entry[1]
    return None


def open_board(comm: Any, shared_comm: Any | None) -> CheckBoard | None:
    """Make the board of ``comm`` when ``shared_comm`` (ranks of ``comm`` sharing memory, same order)
    holds all of it, and register it for ``check_signature``; None (check through MPI) when the
    communicator spans nodes or the segment cannot be made on every rank. Collective over ``comm``."""
    mpi = MPI()
    size = comm.Get_size()
    usable = shared_comm is not None and shared_comm != mpi.COMM_NULL and shared_comm.Get_size() == size
    if not allreduce_int(comm, int(usable), "min"):
        return None  # spans nodes (or simulated: MPIGPU_NODE_SIZE): MPI_Allreduce
    board = made_on_every_rank(comm, lambda: CheckBoard(comm, shared_comm))
    if board is not None:
        register(comm, board)
    return board


def made_on_every_rank(comm: Any, make: Callable[[], B]) -> B | None:
    """``make()`` (a board, collective to create and to close) where it succeeds on every rank of ``comm``,
    else None on every rank, the boards made on some closed again (collective over ``comm``)."""
    board: B | None = None
    try:
        board = make()
    except (MpigpuError, MPI().Exception):
        board = None
    if not allreduce_int(comm, int(board is not None), "min"):
        if board is not None:
            board.close()
        return None
    return board
