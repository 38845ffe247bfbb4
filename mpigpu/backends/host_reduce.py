"""The host backend's NumPy reductions: rows of the node's slots reduced in rank order (both routes,
and the finishing step after a GPU partial), the semantics NumPy's ufuncs lack (float min/max,
exact integer avg: mpigpu.core.ops), and the exchange of node partials across nodes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from mpigpu.backends.host_layout import split_even
from mpigpu.core.ops import Op, finish_avg, from_keys, int_avg_rows, minmax_rows, to_keys

if TYPE_CHECKING:
    from mpigpu.core.dtypes import DType

__all__ = [
    "CPU_BLOCK",
    "GATHER_MAX",
    "INT_AVG_NODES",
    "Stacked",
    "finish",
    "internode",
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
INT_AVG_NODES = (
    "integer avg across several nodes is not supported by the host backend (its per-node partial is held "
    "in the element type, where the exact sum does not fit); use backend 'cpu' for NumPy arrays, 'nccl' "
    "or 'cuda-aware' for GPU arrays, or backend='auto', which picks one of them"
)


def _by_semantics(
    rows: Sequence[np.ndarray] | np.ndarray, op: Op, dtype: DType, nranks: int, dst: np.ndarray, final: bool
) -> bool:
    """Reduce the ops whose NumPy ufunc does not follow mpigpu's semantics; False for the others."""
    if dtype.is_float and op in (Op.MIN, Op.MAX):
        minmax_rows(rows, op, dst)  # NaN propagates, -0.0 < +0.0, canonical NaN
        return True
    if op is Op.AVG and not dtype.is_float:
        assert final, INT_AVG_NODES
        int_avg_rows(rows, nranks, dst)  # exact: no wrap-around
        return True
    return False


def _start(op: Op, acc: np.dtype) -> dict[str, Any]:
    """NumPy's add.reduce starts from +0.0, which turns a sum of -0.0s into +0.0; -0.0 is the identity."""
    return {"initial": -0.0} if op.base is Op.SUM and acc.kind == "f" else {}


def finish(acc: np.ndarray, op: Op, dtype: DType, nranks: int, dst: np.ndarray) -> None:
    """dst = acc finished: avg divided by ``nranks`` (C truncation for integers), rounded once to
    ``dtype``. ``acc`` may be ``dst`` itself (same type) or a float32 accumulator."""
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
    """Reduce ``buf`` over the members of ``comm`` (one per node, ordered by node), in place.

    Small messages: every member gathers every partial and folds them in member order. Larger:
    MPI_Reduce_scatter gives each member one block, reduced once, then MPI_Allgatherv. Either way
    each element is computed once or identically everywhere, so all members hold the same bits.
    ``gather`` is scratch of at least ``comm size * buf.nbytes`` bytes (uint8) for the first form.
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
        with np.errstate(all="ignore"):
            op.ufunc.reduce(rows, axis=0, dtype=buf.dtype, out=buf, **_start(op, buf.dtype))  # node order
        return
    ranges = split_even(buf.size, members)
    counts = [b - a for a, b in ranges]
    displs = [a for a, _ in ranges]
    mine = ranges[comm.Get_rank()]
    block = buf[mine[0] : mine[1]].copy()
    comm.Reduce_scatter(buf, block, counts, op=op.mpi)
    comm.Allgatherv(block, [buf, (counts, displs)])
