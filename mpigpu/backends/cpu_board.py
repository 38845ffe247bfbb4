"""The cpu backend's tiny allreduce: the cross-rank check and the data in one post on the check board.

A host allreduce of at most ``DATA_BYTES`` (mpigpu.job.check_board) needs one exchange: each rank
posts its data beside its signature, and once every rank's signature agrees, every rank reduces
every rank's posted data itself, in rank order. On one node the post is a store into node-shared
memory and no MPI call runs; across nodes it is one exchange of the slots among the node leaders
(mpigpu.job.node_mpi_board; the flat mpigpu.job.mpi_board at one rank per node), in place of
MPI_Allreduce(MAX) of the signature followed by MPI_Allreduce of the data. The same
operations in the same order on every rank give the same bits on every rank by construction (NaN
payloads and signed zeros included); a float NaN is then made the canonical NaN, as the MPI path
makes it (mpigpu.backends.cpu), so the result does not depend on which path ran. On a mismatch no
rank reads the posted data: every rank raises the check's MismatchError with nothing written, as the
separate check raises it, and the next call pairs. One post replaces the check's post and
MPI_Allreduce: a call costs the check alone.
"""

from __future__ import annotations

import contextvars
import ctypes
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from mpigpu.backends.cpu import Reduce, has_nan, is_plain
from mpigpu.core.ops import Op, canonicalize_nan
from mpigpu.job.check import Signature, raise_mismatch
from mpigpu.job.check_board import DATA_BYTES, SLOT_BYTES, Board
from mpigpu.job.native_board import Native

if TYPE_CHECKING:
    from mpigpu.core.arrays import ArrayView

__all__ = ["bind_board_allreduce", "fits_board", "quietly"]

# NumPy 2 keeps its floating-point error settings in a context variable: a Context of our own that holds
# them is entered for ~0.3 us, where ``np.errstate`` costs ~1 us a call. NumPy 1 keeps them per thread.
_CONTEXT_ERRSTATE = int(np.__version__.split(".")[0]) >= 2
# inside the reduction: overflow and inf - inf give IEEE results with no warning; the rest as NumPy's defaults
_QUIET = {"divide": "warn", "over": "ignore", "under": "ignore", "invalid": "ignore"}


def quietly() -> Callable[..., Any]:
    """``run(f, *args, **kwargs)``: ``f(*args, **kwargs)`` under _QUIET's settings whatever the caller
    set (the same on every rank), the caller's own untouched outside it. One per bound launch: a
    Context cannot be entered twice at once, and a launch never runs twice at once (the one-thread
    rule)."""
    if _CONTEXT_ERRSTATE:
        quiet = contextvars.Context()
        quiet.run(np.seterr, **_QUIET)  # only inside ``quiet``
        return quiet.run

    def run(f: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with np.errstate(**_QUIET):
            return f(*args, **kwargs)

    return run


def fits_board(x: ArrayView, op: Op) -> bool:
    """Whether an allreduce of host array ``x`` with ``op`` takes the board: at most DATA_BYTES, and
    an op MPI_Allreduce takes as it is (``is_plain``: not float min/max, integer avg or a half type)."""
    return x.device is None and 0 < x.nbytes <= DATA_BYTES and is_plain(x.dtype, op)


def _stacks(rows: tuple[tuple[np.ndarray, ...], ...], count: int, is_float: bool) -> tuple[np.ndarray, ...] | None:
    """Per parity, every rank's row as one read-only array of shape (ranks, *row shape) over the board's
    slots (rows at one stride: SLOT_BYTES on the MPI board, 2 * SLOT_BYTES on the node board, whose
    rank holds both parities' slots side by side), for one ``ufunc.reduce`` over axis 0 in place of a
    call per row; None where that would not add the rows one after another in rank order, or gains nothing.

    NumPy's reduction over axis 0 walks the other axes innermost when their stride is the smaller
    one: each step adds a whole row to the running result, rank by rank, exactly as the loop of
    calls does. With one element per row the reduced axis would be the inner loop, which NumPy sums
    pairwise for floats (another order): there, and at two ranks, the loop stays. Integers give the
    same bits in any order."""
    n = len(rows[0])
    if n <= 2 or (count < 2 and is_float):
        return None
    stacks = []
    for parity in rows:
        first = parity[0]
        base = first.__array_interface__["data"][0]
        step = parity[1].__array_interface__["data"][0] - base  # MpiBoard: a slot; the node board: two
        addresses = [row.__array_interface__["data"][0] for row in parity]
        if step < SLOT_BYTES or addresses != [base + r * step for r in range(n)]:
            return None  # not slots at one stride, one after another: the loop
        stacks.append(as_strided(first, (n, *first.shape), (step, *first.strides), writeable=False))
    return tuple(stacks)


def _compiled(board: Board, comm: Any, x: ArrayView, op: Op, sig: Signature, packed: bytes,
              shape: tuple[int, ...], rows: Any) -> Reduce:  # fmt: skip
    """The launch on the board's compiled exchange: the post, the check and the fold in one C call
    (mpigpu.job.native_board), into a result of the record's own, then copied to the destination."""
    result = np.empty(shape, x.dtype.np)
    fold = Native.fold(x.dtype.code, op, x.size, result.ctypes.data)
    address = ctypes.addressof(fold)
    agree = board.agree_folding
    posts = (board.post_row(rows, 0), board.post_row(rows, 1))

    def launch(stream: Any, src: np.ndarray, dst: np.ndarray, _fold: Any = fold) -> None:  # _fold: kept alive
        if not agree(packed, src, posts, address):
            raise_mismatch(comm, sig, "cpu")
        dst[...] = result

    return launch


def bind_board_allreduce(board: Board, comm: Any, x: ArrayView, op: Op, sig: Signature, packed: bytes) -> Reduce:
    """The launch ``(stream, source, destination)`` of one record: post ``packed`` (the record's
    signature) and the source on ``board``, then, where every rank agrees, the reduction of every
    rank's row in rank order into the destination; else MismatchError on every rank (collective
    over ``comm``, the board's communicator)."""
    shape = x.shape if x.order == "C" else tuple(reversed(x.shape))  # the host array is C-ordered (arrays.py)
    rows = board.rows(x.dtype.np, shape)
    if board.native is not None:
        return _compiled(board, comm, x, op, sig, packed, shape, rows)
    post, combine, n = board.agree_with, op.ufunc, board.size

    def agreed(src: np.ndarray) -> tuple[np.ndarray, ...]:
        posted = post(packed, src, rows)
        if posted is None:
            raise_mismatch(comm, sig, "cpu")
        return posted

    stacks = _stacks(rows, x.size, x.dtype.is_float)
    # a float reduction starts from a value that leaves the first row as it is (-0.0 + -0.0 stays -0.0,
    # where NumPy's identity +0.0 would not), then adds the rows as the loop does; integers (sum, prod,
    # min, max) need none: any start NumPy takes gives the same bits
    start = {"initial": 1.0 if op is Op.PROD else -0.0} if x.dtype.is_float else {}

    def fold(posted: tuple[np.ndarray, ...], dst: np.ndarray) -> None:
        if stacks is not None:  # one ufunc call: the rows in rank order, as the loop below adds them
            combine.reduce(stacks[0] if posted is rows[0] else stacks[1], axis=0, out=dst, **start)
            return
        combine(posted[0], posted[1], out=dst)
        for row in posted[2:]:
            combine(dst, row, out=dst)

    if not x.dtype.is_float:  # integers: any order gives the same bits, and NumPy's loops raise no flag
        return lambda stream, src, dst: fold(agreed(src), dst)

    divisor = x.dtype.np.type(n) if op is Op.AVG else None
    # Python's float arithmetic is float64's own, and for float32 one addition or product rounded once
    # to float32 is float32's own (53 >= 2 * 24 + 2 bits): where it is exact, 1-D rows combine as
    # Python floats, with no NumPy call; a result out of range or NaN takes NumPy's path.
    in_python = len(shape) == 1 and (x.dtype.np == np.float64 or n == 2)
    top = float(np.finfo(x.dtype.np).max)
    pair = operator.mul if op is Op.PROD else operator.add

    quiet = quietly()

    def reduce_rows(posted: tuple[np.ndarray, ...], dst: np.ndarray) -> None:
        fold(posted, dst)
        if divisor is not None:
            np.divide(dst, divisor, out=dst)

    def floats(stream: Any, src: np.ndarray, dst: np.ndarray) -> None:
        posted = agreed(src)
        if in_python:
            values = posted[0].tolist()
            for row in posted[1:]:
                values = list(map(pair, values, row.tolist()))
            if sum(map(abs, values)) <= top:  # every value finite and in range (NaN compares False)
                dst[...] = values
                if divisor is not None:
                    np.divide(dst, divisor, out=dst)  # IEEE division, as the MPI path's avg
                return
        quiet(reduce_rows, posted, dst)
        if has_nan(dst):
            canonicalize_nan(dst)

    return floats
