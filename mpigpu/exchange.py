"""``reduce_scatter`` and ``alltoall`` (and their ``_async`` forms): the collectives of sharded data
parallel (ZeRO, FSDP) and of expert parallel layers, with allreduce's conventions (array types,
``comm``, ``backend``, ``stream``, the one-thread rule, the cross-rank check with MismatchError on
every rank, inputs untouched on error).

reduce_scatter: x's reduction (``op`` exactly as allreduce reduces it, the same bits) split by rows
of the first dimension as Horovod splits it: the first ``N % size`` ranks get ``N // size + 1``
rows, the others ``N // size``. alltoall: ``splits[j]`` rows of x go to rank j; rank r receives
every rank's rows for r, in rank order. The received counts travel in one MPI_Alltoall of the
splits inside the call.

Backends: cpu (allreduce, then this rank's rows; MPI_Alltoallv), host (allreduce's node-shared
reduction, each rank copying back only its own rows; MPI_Alltoallv, through pinned memory for GPU
arrays), nccl (ncclReduceScatter, padded to equal counts; grouped
ncclSend/ncclRecv), cuda-aware and ipc (their allreduce, then the rows; cuda-aware: MPI_Alltoallv on
device pointers; ipc has no alltoall).

``auto``: reduce_scatter runs on the backend allreduce's ``auto`` picks for x, so its rows are the bits
of ``allreduce(x, op)`` under ``auto`` as under a named backend (backends round float16 sums, averages
and products differently: on 2 GPUs auto's reduce_scatter on nccl and auto's allreduce on ipc differed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from mpigpu.backends import backend_code
from mpigpu.collectives import _copy, _new_array, _run, _watched
from mpigpu.core._cuda import StreamRef, resolve_stream
from mpigpu.core.arrays import ArrayView, as_view
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op, parse_op
from mpigpu.handles import Handle, reject, start
from mpigpu.job.check import COLLECTIVES, Signature, check_signature
from mpigpu.multi.call import refuse_if_bound
from mpigpu.runtime.context import Context, announce_rejection
from mpigpu.runtime.plan import Choice, choose_cached

__all__ = ["alltoall", "alltoall_async", "reduce_scatter", "reduce_scatter_async", "scatter_rows"]

_REDUCE_SCATTER, _ALLTOALL = COLLECTIVES.index("reduce_scatter"), COLLECTIVES.index("alltoall")


def scatter_rows(rows: int, size: int) -> list[int]:
    """Each rank's rows of a reduce_scatter of ``rows`` rows over ``size`` ranks (Horovod's split):
    the first ``rows % size`` ranks one more than the others."""
    base, extra = divmod(rows, size)
    return [base + (r < extra) for r in range(size)]


@dataclass(slots=True)
class _Call:
    """One validated call on this rank (local), ready for the cross-rank check and the data."""

    ctx: Context
    name: str  # "reduce_scatter" or "alltoall"
    x: ArrayView
    op: Op
    choice: Choice
    signature: Signature
    out: Any = None  # reduce_scatter: the caller's ``out``, or None for a new array
    splits: list[int] | None = None  # alltoall: rows to each rank
    return_splits: bool = False


# -- validation (local: no communication) ----------------------------------------------------------------
def _view(x: Any, backend: Any, name: str) -> ArrayView:
    if not isinstance(backend, str):
        raise InvalidArgument(f"backend must be a string such as 'auto' or 'nccl', not {type(backend).__name__}")
    xv = as_view(x, name="x")
    if not xv.shape:
        raise InvalidArgument(
            f"{name} splits x along its first dimension, but x has none (a 0-d array): pass x.reshape(1)"
        )
    return xv


def _check_out(out: ArrayView, x: ArrayView, shape: tuple[int, ...]) -> None:
    if out.shape != shape:
        raise InvalidArgument(
            f"out has shape {out.shape}, but this rank's rows of the result have shape {shape}: pass an array of "
            "that shape (mpigpu.exchange.scatter_rows gives every rank's rows), or leave out out"
        )
    if out.dtype != x.dtype:
        raise InvalidArgument(f"out has dtype {out.dtype.name}, but x has {x.dtype.name}: they must match")
    if out.device != x.device:
        raise InvalidArgument(f"out is on {out.where} but x is on {x.where}: put both in the same place")
    if out.readonly:
        raise InvalidArgument("out is read-only; pass a writable array")
    if out.overlaps(x):
        raise InvalidArgument("out overlaps x; pass an array that does not share memory with x")


def _validate_reduce_scatter(ctx: Context, x: Any, op: Any, out: Any, backend: Any) -> _Call:
    op_ = parse_op(op)
    xv = _view(x, backend, "reduce_scatter")
    ctx.require_own_gpu(xv)
    shape = (scatter_rows(xv.shape[0], ctx.size)[ctx.rank], *xv.shape[1:])
    if out is not None:
        _check_out(as_view(out, name="out"), xv, shape)
    choice = _reduce_scatter_choice(ctx, xv, op_, backend)
    signature = Signature(
        count=xv.size, dtype=xv.dtype.code, op=op_.code, backend=backend_code(choice.backend),
        placement=int(xv.on_device), shape=xv.shape, collective=_REDUCE_SCATTER,
    )  # fmt: skip
    return _Call(ctx, "reduce_scatter", xv, op_, choice, signature, out=out)


def _reduce_scatter_choice(ctx: Context, xv: ArrayView, op: Op, backend: str) -> Choice:
    """The named backend, or under ``auto`` the one allreduce's auto picks for x (module docstring)."""
    if backend != "auto":
        return choose_cached(ctx, xv, op, backend, "reduce_scatter")
    picked = choose_cached(ctx, xv, op, "auto", "allreduce")
    return Choice(picked.backend, f"allreduce's choice, so the rows are allreduce's bits: {picked.reason}")


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


def _validate_alltoall(ctx: Context, x: Any, splits: Any, backend: Any, return_splits: bool) -> _Call:
    xv = _view(x, backend, "alltoall")
    ctx.require_own_gpu(xv)
    splits_ = _check_splits(splits, xv.shape[0], ctx.size)
    trailing = xv.shape[1:]
    # The first dimension differs between ranks: the backend is chosen without it, so that every
    # rank chooses the same one (auto's size rules would otherwise split the ranks).
    row = ArrayView(None, 0, (0, *trailing), xv.dtype, xv.device, False, xv.framework)
    choice = choose_cached(ctx, row, Op.SUM, backend, "alltoall")
    signature = Signature(
        count=math.prod(trailing), dtype=xv.dtype.code, op=0, backend=backend_code(choice.backend),
        placement=int(xv.on_device), shape=trailing, collective=_ALLTOALL,
    )  # fmt: skip
    return _Call(ctx, "alltoall", xv, Op.SUM, choice, signature, splits=splits_, return_splits=bool(return_splits))


def _validated(ctx: Context, validate: Any, stream: Any, on_error: Any) -> tuple[_Call, StreamRef | None]:
    """``validate()`` and the stream; any failure joins the other ranks' check (``on_error``) first."""
    try:
        call = validate()
        ref = resolve_stream(stream, call.x.framework, call.x.device) if call.x.on_device else None
    except Exception as exc:  # not only MpigpuError: any failure here must reach the other ranks
        on_error(ctx, exc)
        raise
    return call, ref


# -- the collective part: check, data ----------------------------------------------------------------------
def _check(call: _Call, label: str) -> None:
    """The cross-rank check (collective): MismatchError on every rank unless all agree."""
    ctx = call.ctx
    if not ctx.settings.check:
        return
    if ctx.watchdog.on:  # a rank that never arrives would leave the others waiting here
        with ctx.watchdog.watch(f"{label} (cross-rank argument check)"):
            check_signature(ctx.comm, call.signature, call.name, backend_name=call.choice.backend)
    else:
        check_signature(ctx.comm, call.signature, call.name, backend_name=call.choice.backend)


def _reduce_scatter(call: _Call, stream: StreamRef | None) -> Any:
    ctx, xv = call.ctx, call.x
    _check(call, f"reduce_scatter of {list(xv.shape)} {xv.dtype.name}")
    rows = scatter_rows(xv.shape[0], ctx.size)
    if call.out is None:
        result, finish = _new_array(xv, (rows[ctx.rank], *xv.shape[1:]))
    else:
        result, finish = call.out, None
    out = as_view(result, name="out")
    if xv.on_device:
        ctx.activate_gpu()
    if ctx.size == 1:  # every op's result is x itself
        _copy(out, xv, stream)
    elif xv.size:
        label = lambda: f"reduce_scatter({call.choice.backend}, {xv.dtype.name} x {xv.size}, op={call.op.value})"  # noqa: E731
        _watched(ctx, label, _run, ctx, call.choice.backend, "reduce_scatter", xv.on_device, xv, out, call.op, rows,
                 stream)  # fmt: skip
    return finish(result) if finish is not None else result


def _received(ctx: Context, splits: list[int]) -> list[int]:
    """The rows every rank sends this one, in rank order (collective: one MPI_Alltoall)."""
    if ctx.size == 1:
        return list(splits)
    from mpigpu.core._mpi import MPI

    mine, theirs = np.array(splits, np.int64), np.empty(ctx.size, np.int64)
    if ctx.watchdog.on:
        with ctx.watchdog.watch("alltoall (exchanging the row counts)"):
            ctx.comm.Alltoall([mine, MPI().INT64_T], [theirs, MPI().INT64_T])
    else:
        ctx.comm.Alltoall([mine, MPI().INT64_T], [theirs, MPI().INT64_T])
    return [int(r) for r in theirs]


def _alltoall(call: _Call, stream: StreamRef | None) -> Any:
    ctx, xv = call.ctx, call.x
    assert call.splits is not None
    trailing = xv.shape[1:]
    _check(call, f"alltoall of {xv.shape[0]} x {list(trailing)} {xv.dtype.name}")
    received = _received(ctx, call.splits)
    result, finish = _new_array(xv, (sum(received), *trailing))
    out = as_view(result, name="out")
    if xv.on_device:
        ctx.activate_gpu()
    if ctx.size == 1:
        _copy(out, xv, stream)
    else:
        label = lambda: f"alltoall({call.choice.backend}, {xv.dtype.name}, splits {call.splits})"  # noqa: E731
        _watched(ctx, label, _run, ctx, call.choice.backend, "alltoall", xv.on_device, xv, out, call.splits, received,
                 stream)  # fmt: skip
    result = finish(result) if finish is not None else result
    return (result, received) if call.return_splits else result


# -- the public calls --------------------------------------------------------------------------------------------
def reduce_scatter(
    x: Any, op: str | Op = "avg", *, out: Any = None, comm: Any = None, backend: str = "auto", stream: Any = None
) -> Any:
    """Reduce ``x`` across the ranks of ``comm`` and return this rank's rows of the result.

    Every rank passes an array of the same shape ``(N, ...)`` and dtype. The result is what
    ``allreduce(x, op)`` gives (the same bits), split along the first dimension: rank r gets
    ``scatter_rows(N, size)[r]`` rows (the first ``N % size`` ranks ``N // size + 1``, the others
    ``N // size``; possibly 0), starting at row ``sum(scatter_rows(N, size)[:r])``.

    op, backend and stream as for ``allreduce``. out: None returns a new array of x's kind (NumPy,
    CuPy, PyTorch; JAX gets a JAX array) in x's place; else an array of shape ``(rows_r, ...)``
    that receives the rows and is returned. ``x`` is never written.

    Collective: a mismatch (shape, dtype, op, placement, backend) or a rank rejecting its own
    arguments raises on every rank, and no array is written.
    """
    refuse_if_bound("reduce_scatter", comm)  # no form over several devices per process: refused on every rank
    ctx = Context.get(comm)
    ctx.enter("reduce_scatter")  # the one-thread rule
    try:
        ctx.wait_async()  # calls queued by the *_async functions on this communicator reach MPI first
        validate = partial(_validate_reduce_scatter, ctx, x, op, out, backend)
        return _reduce_scatter(*_validated(ctx, validate, stream, announce_rejection))
    finally:
        ctx.leave()


def reduce_scatter_async(
    x: Any, op: str | Op = "avg", *, out: Any = None, comm: Any = None, backend: str = "auto", stream: Any = None
) -> Handle:
    """Start ``reduce_scatter(x, op, out=..., ...)`` and return its Handle; ``wait()`` returns the
    array. Runs as ``allreduce_async`` runs (see mpigpu.handles): do not modify ``x`` (or read
    ``out``) until then. Invalid arguments raise here, on every rank; a cross-rank mismatch on a
    background-thread backend is raised by ``wait()``."""
    refuse_if_bound("reduce_scatter_async", comm)  # no form over several devices per process: refused on every rank
    ctx = Context.get(comm)
    ctx.enter("reduce_scatter_async")
    try:
        validate = partial(_validate_reduce_scatter, ctx, x, op, out, backend)
        call, ref = _validated(ctx, validate, stream, reject)
        return start(ctx, call.choice.backend, ref, partial(_reduce_scatter, call))
    finally:
        ctx.leave()


def alltoall(
    x: Any,
    splits: Any = None,
    *,
    comm: Any = None,
    backend: str = "auto",
    stream: Any = None,
    return_splits: bool = False,
) -> Any:
    """Send ``splits[j]`` rows of ``x`` to rank j, in rank order, and return the rows every rank sent
    this one, concatenated in rank order, as a new array of x's kind in x's place.

    splits: a sequence (list, tuple, NumPy array or tensor) of one non-negative row count per rank,
    summing to ``x.shape[0]``; None splits x evenly (then ``x.shape[0]`` must divide by the number
    of ranks). The first dimension may differ between ranks; the other dimensions, the dtype, the
    placement and the backend must match (else MismatchError on every rank). return_splits=True
    returns ``(array, received)``, ``received[j]`` the rows that came from rank j. backend and
    stream as for ``allreduce`` (ipc does not alltoall).
    """
    refuse_if_bound("alltoall", comm)  # no form over several devices per process: refused on every rank
    ctx = Context.get(comm)
    ctx.enter("alltoall")
    try:
        ctx.wait_async()
        validate = partial(_validate_alltoall, ctx, x, splits, backend, return_splits)
        return _alltoall(*_validated(ctx, validate, stream, announce_rejection))
    finally:
        ctx.leave()


def alltoall_async(
    x: Any,
    splits: Any = None,
    *,
    comm: Any = None,
    backend: str = "auto",
    stream: Any = None,
    return_splits: bool = False,
) -> Handle:
    """Start ``alltoall(x, splits, ...)`` and return its Handle; ``wait()`` returns what ``alltoall``
    returns. Runs as ``allreduce_async`` runs (see mpigpu.handles): do not modify ``x`` until then."""
    refuse_if_bound("alltoall_async", comm)  # no form over several devices per process: refused on every rank
    ctx = Context.get(comm)
    ctx.enter("alltoall_async")
    try:
        validate = partial(_validate_alltoall, ctx, x, splits, backend, return_splits)
        call, ref = _validated(ctx, validate, stream, reject)
        return start(ctx, call.choice.backend, ref, partial(_alltoall, call))
    finally:
        ctx.leave()
