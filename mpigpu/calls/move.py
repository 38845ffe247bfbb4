"""Data movement: ``broadcast``, ``allgather`` and ``alltoall`` (and ``alltoall_async``), three
families of the one road (mpigpu.calls.pipeline), with allreduce's conventions (array types,
``comm``, ``backend``, ``stream``, the one-thread rule, the cross-rank check with MismatchError on
every rank, inputs untouched on error).

Backends: cpu (MPI_Bcast / MPI_Allgatherv / MPI_Alltoallv), nccl (ncclBroadcast / ncclAllGather,
unequal first dimensions as one ncclBroadcast per rank in an NCCL group / grouped ncclSend and
ncclRecv), cuda-aware (MPI on device pointers after synchronising the stream), host (GPU arrays
staged through pinned memory). ipc does not implement them: ``auto`` passes over it.

allgather and alltoall let the first dimension differ between ranks: it rides in the signature's
``root`` field, which the check returns for every rank (``Family.per_rank``), so an allgather learns
every rank's rows, and an evenly split alltoall every rank's received rows, from the check itself.
An alltoall with explicit ``splits`` exchanges them in one MPI_Alltoall inside the call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpigpu.calls.handles import Handle
from mpigpu.calls.keys import family_key
from mpigpu.calls.pipeline import (
    Family,
    Record,
    call,
    call_async,
    check_root,
    copy_bytes,
    detach,
    finished,
    new_array,
    signature,
)
from mpigpu.calls.reduce import check_rows_out, lent, lent_pair, rows_view
from mpigpu.core._cuda import StreamRef
from mpigpu.core.arguments import check_backend_name
from mpigpu.core.arrays import ArrayView, as_view, require_c_order, scalar_fix
from mpigpu.core.errors import InvalidArgument, in_step
from mpigpu.core.ops import Op
from mpigpu.job.check import fail_together, mark_raised_everywhere
from mpigpu.runtime.context import Context
from mpigpu.runtime.plan import choose_cached

__all__ = ["allgather", "alltoall", "alltoall_async", "broadcast"]


def _launch(record: Record, method: str) -> Any:
    """The backend's ``method``, bound on its first use (creating the backend is collective: after the check)."""
    launch = record.launch
    if launch is None:
        launch = record.launch = getattr(record.ctx.backend(record.choice.backend), method)
    return launch


# -- broadcast ----------------------------------------------------------------------------------------------------
class _Broadcast(Family):
    name = "broadcast"

    def key(self, x: Any, root: Any, backend: Any) -> tuple[Any, ...] | None:
        return family_key("broadcast", x, None, root, backend) if type(root) is int else None

    def validate(self, ctx: Context, x: Any, root: Any, backend: Any) -> tuple[Record, Any]:
        root_ = check_root(root, ctx.size)
        check_backend_name(backend)
        xv = as_view(x, name="x")
        ctx.require_own_gpu(xv)
        if xv.readonly and xv.framework != "jax":
            raise InvalidArgument(
                scalar_fix(xv) or "x is read-only, so it cannot receive the broadcast in place: pass a writable array"
            )
        choice = choose_cached(ctx, xv, Op.SUM, backend, "broadcast")
        sig = signature("broadcast", xv, None, choice.backend, root=root_)
        keep = not xv.readonly  # JAX: a new array each call
        return Record(ctx, self, detach(xv) if keep else xv, None, Op.SUM, choice, sig, sig.packed(), extra=root_,
                      keep=keep), xv  # fmt: skip

    def execute(self, record: Record, args: tuple[Any, ...], stream: StreamRef | None, ranks: Any, live: Any) -> Any:
        ctx, x = record.ctx, args[0]
        xv = lent(record.x, x) if live is None else live
        result, finish, target = x, None, xv
        if xv.device is not None:
            ctx.activate_gpu()
        if xv.readonly:  # JAX: broadcast into a new array
            result, target, finish = new_array(xv, xv.shape, x)
            copy_bytes(target, xv, stream)
        if xv.size and ctx.size > 1:
            _launch(record, "broadcast")(target, record.extra, stream)
        return finished(ctx, result, finish, stream)

    def label(self, record: Record, phase: str) -> str:
        x = record.x
        if phase == "check":
            return f"broadcast of {x.size} {x.dtype.name} from rank {record.extra} (cross-rank argument check)"
        return f"broadcast({record.choice.backend}, {x.dtype.name} x {x.size}, root={record.extra})"


BROADCAST = _Broadcast()


def broadcast(x: Any, root: int = 0, *, comm: Any = None, backend: str = "auto", stream: Any = None) -> Any:
    """Copy rank ``root``'s ``x`` into ``x`` on every rank of ``comm`` (in place) and return ``x``.

    JAX arrays are immutable: a new JAX array is returned. backend and stream as for ``allreduce``
    ("auto", "nccl", "cuda-aware", "host" or "cpu"; ipc does not broadcast).

    Collective: every rank passes the same shape, dtype, placement, root and backend; a mismatch
    raises MismatchError on every rank, and no array is changed.
    """
    return call(BROADCAST, comm, stream, (x, root, backend))


# -- allgather ----------------------------------------------------------------------------------------------------
def _rows_of(ctx: Context, mine: int) -> list[int]:
    """Every rank's first dimension where the check did not tell it (it was off, or one rank)."""
    return [mine] if ctx.size == 1 else _gather_rows(ctx, mine)


def _gather_rows(ctx: Context, mine: int) -> list[int]:
    """Every rank's first dimension (collective; one MPI_Allgather of an int64)."""
    from mpigpu.core._mpi import MPI

    everyone = np.empty(ctx.size, np.int64)
    ctx.comm.Allgather([np.array([mine], np.int64), MPI().INT64_T], [everyone, MPI().INT64_T])
    return [int(r) for r in everyone]


def _out_view(out: Any, xv: ArrayView, name: str) -> ArrayView | None:
    """``out``'s view, refused here (on this rank) unless it can take ``name``'s rows of x's kind."""
    if out is None:
        return None
    outv = as_view(out, name="out")
    check_rows_out(outv, xv, None, name)
    return outv


def _checked_shape(xv: ArrayView, outv: ArrayView | None, out_rows: int) -> tuple[int, ...]:
    """The signature's shape: x's trailing dimensions, led by ``out_rows`` when the call has an out,
    so every rank agrees on whether it passed one and how many rows it holds."""
    return xv.shape[1:] if outv is None else (out_rows, *xv.shape[1:])


def _output(ctx: Context, x: Any, xv: ArrayView, out: Any, outv: ArrayView | None, rows: int,
            name: str) -> tuple[Any, ArrayView, Any]:  # fmt: skip
    """(result, its view, finish): the caller's ``out``, refused on every rank unless it holds ``rows``
    rows (every rank found the same rows in the check), else a new array."""
    if outv is None:
        return new_array(xv, (rows, *xv.shape[1:]), x)
    if outv.shape[0] != rows:
        raise mark_raised_everywhere(ctx.comm, in_step(InvalidArgument(
            f"out has {outv.shape[0]} rows, but {name} gives every rank {rows}: pass an out of shape "
            f"{(rows, *xv.shape[1:])}")), same_text=True)  # fmt: skip
    return out, outv, None


class _Allgather(Family):
    name = "allgather"
    per_rank = True  # the first dimension, in the signature's root field

    def key(self, x: Any, out: Any, backend: Any) -> tuple[Any, ...] | None:
        return family_key("allgather", x, out, backend)

    def validate(self, ctx: Context, x: Any, out: Any, backend: Any) -> tuple[Record, Any]:
        check_backend_name(backend)
        xv = as_view(x, name="x")
        ctx.require_own_gpu(xv)
        require_c_order(xv, "allgather")
        if not xv.shape:
            raise InvalidArgument(
                "allgather concatenates along the first dimension, but x has none (a 0-d array): pass x.reshape(1)"
            )
        outv = _out_view(out, xv, "allgather")
        choice = choose_cached(ctx, xv, Op.SUM, backend, "allgather")
        shape = _checked_shape(xv, outv, 0 if outv is None else outv.shape[0])
        sig = signature("allgather", xv, None, choice.backend, shape=shape, root=xv.shape[0],
                        placement=int(xv.on_device))  # fmt: skip
        record = Record(ctx, self, detach(xv), None if outv is None else detach(outv), Op.SUM, choice, sig,
                        sig.packed())  # fmt: skip
        return record, (xv, outv)

    def execute(self, record: Record, args: tuple[Any, ...], stream: StreamRef | None, ranks: Any, live: Any) -> Any:
        ctx, x, out = record.ctx, args[0], args[1]
        xv, outv = lent_pair(record, x, out) if live is None else live
        rows = ranks if ranks is not None else _rows_of(ctx, xv.shape[0])
        result, outv, finish = _output(ctx, x, xv, out, outv, sum(rows), "allgather")
        if xv.device is not None:
            ctx.activate_gpu()
        if ctx.size == 1:
            copy_bytes(outv, xv, stream)
        elif outv.nbytes:
            _launch(record, "allgather")(xv, outv, rows, stream)
        return finished(ctx, result, finish, stream)

    def label(self, record: Record, phase: str) -> str:
        x = record.x
        if phase == "check":
            return f"allgather of {x.shape[0]} x {list(x.shape[1:])} {x.dtype.name} (cross-rank argument check)"
        return f"allgather({record.choice.backend}, {x.dtype.name}, {x.shape[0]} rows here)"


ALLGATHER = _Allgather()


def allgather(x: Any, *, out: Any = None, comm: Any = None, backend: str = "auto", stream: Any = None) -> Any:
    """Concatenate every rank's ``x`` along the first dimension, in rank order, into ``out`` (returned)
    or a new array of ``x``'s framework, dtype and placement (NumPy, CuPy, PyTorch; JAX gets a JAX array).

    The first dimension may differ between ranks (zero rows too); the other dimensions, the dtype,
    the placement and the backend must match: else MismatchError on every rank. out: an array of x's
    kind, dtype and place, C order, of shape ``(total rows, *x.shape[1:])``, made once and passed to
    every call (as torch's ``all_gather_into_tensor``); every rank passes one or none does. One that
    cannot take the rows raises on every rank before anything is written. backend and stream as for
    ``allreduce`` (ipc does not allgather). The result is ready in the stream's order.
    """
    return call(ALLGATHER, comm, stream, (x, out, backend))


# -- alltoall -----------------------------------------------------------------------------------------------------
_EXPLICIT = -1  # the root field of an alltoall with explicit splits (an even split carries its rows)


def _check_splits(splits: Any, rows: int, size: int) -> list[int]:
    """``splits`` as a list of ``size`` non-negative ints summing to ``rows`` (None: an even split)."""
    if splits is None:
        if rows % size:
            raise InvalidArgument(
                f"x has {rows} rows, which do not divide evenly over {size} ranks: pass splits, the rows for each "
                f"rank in rank order (summing to {rows})"
            )
        return [rows // size] * size
    if hasattr(splits, "tolist"):  # NumPy arrays, torch tensors
        splits = splits.tolist()
    if isinstance(splits, (str, bytes)) or not hasattr(splits, "__iter__"):
        raise InvalidArgument(f"splits must be a sequence of {size} row counts, not {type(splits).__name__}")
    values = list(splits)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0]
    if bad:
        raise InvalidArgument(f"splits must hold non-negative integers; got {bad[0]!r}")
    if len(values) != size:
        raise InvalidArgument(
            f"splits has {len(values)} entries, but the communicator has {size} ranks: give one per rank"
        )
    if sum(values) != rows:
        raise InvalidArgument(f"splits sum to {sum(values)}, but x has {rows} rows: they must be equal")
    return [int(v) for v in values]


def _splits_key(splits: Any) -> Any:
    """A hashable stand-in for ``splits`` in the call's key (exact ints only: 2.0 must be refused, not
    found as 2), or a marker that sends the call down validation."""
    if splits is None:
        return None
    if (type(splits) is list or type(splits) is tuple) and all(type(v) is int for v in splits):
        return tuple(splits)
    raise TypeError("no key")  # find() then validates the call


class _Alltoall(Family):
    name = "alltoall"
    per_rank = True  # an even split's rows, in the signature's root field

    def key(self, x: Any, splits: Any, out: Any, backend: Any, return_splits: Any) -> tuple[Any, ...] | None:
        return family_key("alltoall", x, out, _splits_key(splits), backend, bool(return_splits))

    def validate(self, ctx: Context, x: Any, splits: Any, out: Any, backend: Any,
                 return_splits: Any) -> tuple[Record, Any]:  # fmt: skip
        xv = rows_view(x, backend, "alltoall")
        ctx.require_own_gpu(xv)
        splits_ = _check_splits(splits, xv.shape[0], ctx.size)
        outv = _out_view(out, xv, "alltoall")
        trailing = xv.shape[1:]
        # The first dimension differs between ranks: the backend is chosen without it, so that every
        # rank chooses the same one (auto's size rules would otherwise split the ranks).
        row = ArrayView(None, 0, (0, *trailing), xv.dtype, xv.device, False, xv.framework)
        choice = choose_cached(ctx, row, Op.SUM, backend, "alltoall")
        root = xv.shape[0] if splits is None else _EXPLICIT
        # An even split's out holds as many rows on every rank; explicit splits' outs are checked in
        # the exchange of the splits (_exchange_splits).
        shape = _checked_shape(xv, outv, _EXPLICIT if outv is None or splits is not None else outv.shape[0])
        sig = signature("alltoall", xv, None, choice.backend, shape=shape, root=root, placement=int(xv.on_device))
        record = Record(ctx, self, detach(xv), None if outv is None else detach(outv), Op.SUM, choice, sig,
                        sig.packed(), extra=(splits_, bool(return_splits)))  # fmt: skip
        return record, (xv, outv)

    def execute(self, record: Record, args: tuple[Any, ...], stream: StreamRef | None, ranks: Any, live: Any) -> Any:
        ctx, x, out = record.ctx, args[0], args[2]
        xv, outv = lent_pair(record, x, out) if live is None else live
        splits, return_splits = record.extra
        received = _received(ctx, splits, ranks, None if outv is None else outv.shape[0])
        result, outv, finish = _output(ctx, x, xv, out, outv, sum(received), "alltoall")
        if xv.device is not None:
            ctx.activate_gpu()
        if ctx.size == 1:
            copy_bytes(outv, xv, stream)
        else:
            _launch(record, "alltoall")(xv, outv, splits, received, stream)
        result = finished(ctx, result, finish, stream)
        return (result, received) if return_splits else result

    def label(self, record: Record, phase: str) -> str:
        x = record.x
        if phase == "check":
            return f"alltoall of {x.shape[0]} x {list(x.shape[1:])} {x.dtype.name} (cross-rank argument check)"
        return f"alltoall({record.choice.backend}, {x.dtype.name}, splits {record.extra[0]})"


def _received(ctx: Context, splits: list[int], ranks: list[int] | None, out_rows: int | None) -> list[int]:
    """The rows every rank sends this one, in rank order: from the check when every rank split evenly
    (each sends a ``size``-th of its rows), else (a rank passed splits, or the check was off) from
    one exchange of the splits on every rank (collective; ``out_rows``: this rank's out's, or None)."""
    size = ctx.size
    if size == 1:
        return list(splits)
    if ranks is not None and _EXPLICIT not in ranks:  # every rank read the same posts: all decide alike
        return [v // size for v in ranks]
    if out_rows is None:
        return _exchange_splits(ctx, splits)
    return _exchange_splits_and_outs(ctx, splits, out_rows)


def _exchange_splits(ctx: Context, splits: list[int]) -> list[int]:
    """Every rank's splits for this one, in rank order (collective: one MPI_Alltoall)."""
    from mpigpu.core._mpi import MPI

    mine, theirs = np.array(splits, np.int64), np.empty(ctx.size, np.int64)
    ctx.comm.Alltoall([mine, MPI().INT64_T], [theirs, MPI().INT64_T])
    return [int(r) for r in theirs]


def _exchange_splits_and_outs(ctx: Context, splits: list[int], out_rows: int) -> list[int]:
    """``_exchange_splits`` where every rank passed an out (the check agreed on that): one
    MPI_Allgather of every rank's splits and out rows, so every rank learns which outs cannot take
    their rows and all raise for the same call (collective), before anything is written."""
    from mpigpu.core._mpi import MPI

    size, rank = ctx.size, ctx.rank
    table = np.empty((size, size + 1), np.int64)
    ctx.comm.Allgather([np.array([*splits, out_rows], np.int64), MPI().INT64_T], [table, MPI().INT64_T])
    wants = table[:, :size].sum(axis=0)  # the rows each rank receives
    bad = [r for r in range(size) if table[r, size] != wants[r]]
    if bad:
        error = None
        if rank in bad:
            error = in_step(InvalidArgument(
                f"out has {out_rows} rows, but the ranks' splits send this rank {int(wants[rank])}: pass an out "
                "of that many rows"
            ))  # fmt: skip
        fail_together(ctx.comm, error, "alltoall")
    return [int(r) for r in table[:, rank]]


ALLTOALL = _Alltoall()


def alltoall(
    x: Any,
    splits: Any = None,
    *,
    comm: Any = None,
    backend: str = "auto",
    out: Any = None,
    stream: Any = None,
    return_splits: bool = False,
) -> Any:
    """Send ``splits[j]`` rows of ``x`` to rank j, in rank order, and return the rows every rank sent
    this one, concatenated in rank order, as a new array of x's kind in x's place.

    splits: a sequence (list, tuple, NumPy array or tensor) of one non-negative row count per rank,
    summing to ``x.shape[0]``; None splits x evenly (then ``x.shape[0]`` must divide by the number
    of ranks). The first dimension may differ between ranks; the
    other dimensions, the dtype, the placement and the backend must match (else MismatchError on
    every rank). return_splits=True returns ``(array, received)``, ``received[j]`` the rows that came
    from rank j. out: an array of x's kind, dtype and place, C order, of shape ``(sum(received),
    *x.shape[1:])``, made once and passed to every call (as torch's ``all_to_all_single``) and
    returned; every rank passes one or none does (and, with one, every rank passes splits or none
    does). One that cannot take the rows raises on every rank before anything is written. backend
    and stream as for ``allreduce`` (ipc does not alltoall).
    """
    return call(ALLTOALL, comm, stream, (x, splits, out, backend, return_splits))


def alltoall_async(
    x: Any,
    splits: Any = None,
    *,
    comm: Any = None,
    backend: str = "auto",
    out: Any = None,
    stream: Any = None,
    return_splits: bool = False,
) -> Handle:
    """Start ``alltoall(x, splits, ...)`` and return its Handle; ``wait()`` returns what ``alltoall``
    returns. Runs as ``allreduce_async`` runs (see mpigpu.calls.handles): do not modify ``x`` (or read
    ``out``) until then. An out whose rows the other ranks' calls contradict raises from ``wait()``,
    on every rank, as a cross-rank mismatch does; the queue goes on."""
    return call_async(ALLTOALL, comm, stream, (x, splits, out, backend, return_splits))
