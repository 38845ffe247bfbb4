"""The host backend's NumPy reductions: rows of the node's slots reduced in rank order (both routes,
and the finishing step after a GPU partial), the semantics NumPy's ufuncs lack (float min/max,
exact integer avg: mpigpu.core.ops), and the exchange of node partials across nodes.

Across nodes the order is fixed by the layout: each node reduces its ranks in rank order into a
partial (``partial_type``: float32 for the half types, the exact integer average's 64-bit parts for
integer avg), and the partials are combined in node order, each element once or identically on
every member, so every rank ends with the same bits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from mpigpu.backends.host_layout import split_even
from mpigpu.core._mpi import MPI
from mpigpu.core.ops import Op, finish_avg, from_keys, int_avg_join, int_avg_parts, int_avg_rows, minmax_rows, to_keys

if TYPE_CHECKING:
    from mpigpu.core.dtypes import DType

__all__ = [
    "CPU_BLOCK",
    "GATHER_MAX",
    "Stacked",
    "finish",
    "internode",
    "partial_type",
    "reduce_rows",
    "reduce_stacked",
    "stacked_reducer",
]  # fmt: skip

CPU_BLOCK = 1 << 20  # NumPy reduction block, bytes per row (larger blocks measured faster: fewer calls)
GATHER_MAX = 1 << 20  # across nodes, gather whole partials up to this many bytes in all


def reduce_rows(
    rows: Sequence[np.ndarray],
    op: Op,
    dtype: DType,
    nranks: int,
    dst: np.ndarray,
    *,
    final: bool,
    scratch: np.ndarray,
) -> None:
    """dst = rows[0] op rows[1] op ... in rank order, in the accumulator type.

    final: dst holds ``dtype`` values, finished (avg divided by ``nranks``, half types rounded once);
    otherwise dst holds the unfinished accumulator (float32 for half types). ``scratch`` is a float32
    buffer of at least one block, used for the half types."""
    if _by_semantics(rows, op, dtype, nranks, dst, final):
        return
    count = dst.size
    step = max(1, CPU_BLOCK // dtype.itemsize)
    if dtype.is_float:  # overflow to inf and NaN are IEEE results, not errors
        with np.errstate(all="ignore"):
            _reduce_blocks(rows, op, dtype, nranks, dst, final, scratch, count, step)
    else:
        _reduce_blocks(rows, op, dtype, nranks, dst, final, scratch, count, step)


def _reduce_blocks(
    rows: Sequence[np.ndarray],
    op: Op,
    dtype: DType,
    nranks: int,
    dst: np.ndarray,
    final: bool,
    scratch: np.ndarray,
    count: int,
    step: int,
) -> None:
    ufunc = op.ufunc
    direct = not dtype.is_half or dst.dtype == np.float32  # accumulate straight into dst
    for b0 in range(0, count, step):
        b1 = min(count, b0 + step)
        block = rows if count <= step else [row[b0:b1] for row in rows]  # one block: no slicing
        acc = (dst if count <= step else dst[b0:b1]) if direct else scratch[: b1 - b0]
        if dtype.is_half:  # widen first: float16 + float16 would round in float16
            np.copyto(acc, block[0], casting="unsafe")
            for row in block[1:]:
                ufunc(acc, row, out=acc, casting="unsafe")
        elif len(block) == 1:
            np.copyto(acc, block[0])
        else:
            ufunc(block[0], block[1], out=acc)
            for row in block[2:]:
                ufunc(acc, row, out=acc)
        if final and (op is Op.AVG or not direct):
            _finish(acc, op, dtype, nranks, dst if count <= step else dst[b0:b1])


def reduce_stacked(
    stacked: np.ndarray, op: Op, dtype: DType, nranks: int, dst: np.ndarray, *, final: bool, scratch: np.ndarray
) -> None:
    """Like reduce_rows, for rows that are one strided 2-D array (ranks x count): a single NumPy
    reduction along the rank axis, in rank order (the latency route, where calls are what costs)."""
    if _by_semantics(stacked, op, dtype, nranks, dst, final):
        return
    acc_np = np.dtype(np.float32) if dtype.is_half else dtype.np
    acc = dst if dst.dtype == acc_np else scratch[: dst.size]
    with np.errstate(all="ignore"):
        op.ufunc.reduce(stacked, axis=0, dtype=acc_np, out=acc, **_start(op, acc_np))
        if final and (op is Op.AVG or acc is not dst):
            _finish(acc, op, dtype, nranks, dst)


Stacked = Callable[[np.ndarray, np.ndarray], None]  # (ranks x count rows, destination): one reduction, all else fixed


def stacked_reducer(op: Op, dtype: DType, nranks: int, scratch: np.ndarray) -> Stacked:
    """``reduce_stacked(stacked, op, dtype, nranks, dst, final=True, scratch=scratch)`` with all but the
    arrays fixed: what it decides per call (semantics, accumulator, warnings, avg's division) decided
    once, for a bound call (the latency route on NumPy arrays)."""
    if dtype.is_half or (dtype.is_float and op in (Op.MIN, Op.MAX)) or (op is Op.AVG and not dtype.is_float):
        return partial(_final_stacked, op=op, dtype=dtype, nranks=nranks, scratch=scratch)
    reduce, kind, start = op.ufunc.reduce, dtype.np, _start(op, dtype.np)
    if not dtype.is_float:  # integers wrap around in NumPy's loops without a floating-point flag: no errstate

        def exact(stacked: np.ndarray, dst: np.ndarray) -> None:
            reduce(stacked, axis=0, dtype=kind, out=dst, **start)

        return exact
    divisor = kind.type(nranks) if op is Op.AVG else None

    def in_float(stacked: np.ndarray, dst: np.ndarray) -> None:
        with np.errstate(all="ignore"):  # overflow to inf and NaN are IEEE results, not errors
            reduce(stacked, axis=0, dtype=kind, out=dst, **start)
            if divisor is not None:
                np.divide(dst, divisor, out=dst)

    return in_float


def _final_stacked(
    stacked: np.ndarray, dst: np.ndarray, *, op: Op, dtype: DType, nranks: int, scratch: np.ndarray
) -> None:
    reduce_stacked(stacked, op, dtype, nranks, dst, final=True, scratch=scratch)


# -- semantics NumPy's ufuncs lack (mpigpu.core.ops): float min/max, exact integer avg ----------------
INT_AVG_BLOCK = 1 << 16  # elements per block of the integer average's 64-bit parts (they stay in cache)


def partial_type(dtype: DType, op: Op) -> tuple[np.dtype, int]:
    """A node partial's element type and how many of them one element takes: the exact integer
    average's uint64 parts (``int_avg_parts``: one word, two for the 64-bit types), float32 for the
    half types, else the dtype itself (one)."""
    if op is Op.AVG and not dtype.is_float:
        return np.dtype(np.uint64), 2 if dtype.itemsize == 8 else 1
    return (np.dtype(np.float32) if dtype.is_half else dtype.np), 1


def _int_avg_partial(rows: Sequence[np.ndarray] | np.ndarray, nranks: int, dst: np.ndarray) -> None:
    """dst = the sum over ``rows`` (this node's ranks) of ``int_avg_parts``, element by element: one
    uint64 word per element, or two (q then r) for 64-bit types, so that a slice of elements is a slice
    of dst and the partials of several nodes add up word by word (modulo 2**64, as the parts allow)."""
    count = len(rows[0])
    words = dst.reshape(count, -1)
    if words.shape[1] == 1:  # 8..32-bit: the parts are the values, sign-extended; added in place
        acc = dst.view(np.int64)
        np.copyto(acc, rows[0])
        for row in rows[1:]:
            np.add(acc, row, out=acc)
        return
    for b0 in range(0, count, INT_AVG_BLOCK):
        b1 = min(count, b0 + INT_AVG_BLOCK)
        total = int_avg_parts(np.asarray(rows[0][b0:b1]), nranks)
        for row in rows[1:]:
            total += int_avg_parts(np.asarray(row[b0:b1]), nranks)
        words[b0:b1] = total.reshape(words.shape[1], b1 - b0).T


def _int_avg_final(acc: np.ndarray, nranks: int, dst: np.ndarray) -> None:
    """dst = the exact integer average from every node's ``_int_avg_partial``, summed."""
    count = dst.size
    words = acc.reshape(count, -1)
    for b0 in range(0, count, INT_AVG_BLOCK):
        b1 = min(count, b0 + INT_AVG_BLOCK)
        int_avg_join(np.ascontiguousarray(words[b0:b1].T).reshape(-1), nranks, dst[b0:b1])


def _by_semantics(
    rows: Sequence[np.ndarray] | np.ndarray, op: Op, dtype: DType, nranks: int, dst: np.ndarray, final: bool
) -> bool:
    """Reduce the ops whose NumPy ufunc does not follow mpigpu's semantics; False for the others."""
    if dtype.is_float and op in (Op.MIN, Op.MAX):
        minmax_rows(rows, op, dst)  # NaN propagates, -0.0 < +0.0, canonical NaN
        return True
    if op is Op.AVG and not dtype.is_float:  # exact: no wrap-around
        if final:
            int_avg_rows(rows, nranks, dst)
        else:
            _int_avg_partial(rows, nranks, dst)
        return True
    return False


def _start(op: Op, acc: np.dtype) -> dict[str, Any]:
    """NumPy's add.reduce starts from +0.0, which turns a sum of -0.0s into +0.0; -0.0 is the identity."""
    return {"initial": -0.0} if op.base is Op.SUM and acc.kind == "f" else {}


def finish(acc: np.ndarray, op: Op, dtype: DType, nranks: int, dst: np.ndarray) -> None:
    """dst = acc (a node partial reduced across nodes) finished: avg divided by ``nranks`` (for
    integers the exact average of the parts, truncated as C does), rounded once to ``dtype``. ``acc``
    may be ``dst`` itself (same type) or the wider partial of ``partial_type``."""
    if op is Op.AVG and not dtype.is_float:
        _int_avg_final(acc, nranks, dst)
        return
    with np.errstate(all="ignore"):
        _finish(acc, op, dtype, nranks, dst)


def _finish(acc: np.ndarray, op: Op, dtype: DType, nranks: int, dst: np.ndarray) -> None:
    if op is Op.AVG and not dtype.is_float:
        finish_avg(acc, nranks, dtype, dst)
        return
    if op is Op.AVG:
        np.divide(acc, acc.dtype.type(nranks), out=acc)
    if not np.may_share_memory(acc, dst):
        np.copyto(dst, acc, casting="unsafe")


# -- across nodes ---------------------------------------------------------------------------------
def internode(comm: Any, buf: np.ndarray, op: Op, gather: np.ndarray) -> None:
    """Reduce ``buf`` over the members of ``comm`` (one per node, ordered by node), in place, the
    members' rows combined in member (node) order.

    Small messages: every member gathers every partial and folds them all. Larger: an all-to-all
    hands each member one block of every member's partial, which it folds, then MPI_Allgatherv
    spreads the folded blocks (the traffic of MPI_Reduce_scatter, whose operand order would be the
    MPI library's). Either way each element is computed once or identically everywhere, so all
    members hold the same bits. ``gather`` is scratch of at least ``comm size * buf.nbytes`` bytes.
    """
    members = comm.Get_size()
    if members == 1:
        return
    if op in (Op.MIN, Op.MAX) and buf.dtype.kind == "f":  # as keys: MPI's integer MIN/MAX is exact
        keys = to_keys(buf, op)
        internode(comm, keys, op, gather)
        from_keys(keys, buf)
        return
    if members <= 2 or buf.nbytes * members <= GATHER_MAX or buf.size < members:
        rows = gather[: members * buf.nbytes].view(buf.dtype).reshape(members, buf.size)
        comm.Allgather(buf, rows)
        _fold(rows, op, buf)
        return
    ranges = split_even(buf.size, members)
    counts = [b - a for a, b in ranges]
    displs = [a for a, _ in ranges]
    lo, hi = ranges[comm.Get_rank()]
    rows = gather[: members * (hi - lo) * buf.itemsize].view(buf.dtype).reshape(members, hi - lo)
    comm.Alltoallv([buf, (counts, displs)], [rows, ([hi - lo] * members, [m * (hi - lo) for m in range(members)])])
    _fold(rows, op, buf[lo:hi])
    comm.Allgatherv(MPI().IN_PLACE, [buf, (counts, displs)])


def _fold(rows: np.ndarray, op: Op, dst: np.ndarray) -> None:
    """dst = rows[0] op rows[1] op ..., in row order, in dst's type (integer words wrap)."""
    with np.errstate(all="ignore"):
        op.ufunc.reduce(rows, axis=0, dtype=dst.dtype, out=dst, **_start(op, dst.dtype))
