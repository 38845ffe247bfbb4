"""The reductions: ``allreduce`` and ``reduce_scatter`` (and their ``_async`` forms), two families
of the one road (mpigpu.calls.pipeline).

reduce_scatter: x's reduction (``op`` exactly as allreduce reduces it, the same bits) split by rows
of the first dimension as Horovod splits it: the first ``N % size`` ranks get ``N // size + 1``
rows, the others ``N // size``. Backends: cpu (allreduce, then this rank's rows), host (allreduce's
node-shared reduction, each rank copying back only its own rows), nccl (ncclReduceScatter, padded to
equal counts), cuda-aware and ipc (their allreduce, then the rows). ``auto`` (``scatter_choice``): on
host arrays the backend allreduce's ``auto`` picks for x, so its rows are the bits of
``allreduce(x, op)`` there too; on GPUs the reduce_scatter rules, nccl's reduceScatter first (ipc's,
an allreduce and a copy, cost 46-50 us from 8 B to 1 MiB on 2 x H100 where nccl's cost 33-39), so
the rows need not be auto's allreduce's bits (backends round float16 sums, averages and products
differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from mpigpu.calls.handles import Handle
from mpigpu.calls.keys import call_key, family_key
from mpigpu.calls.pipeline import (
    Family,
    Record,
    call,
    call_async,
    call_remembered_in_place,
    check,
    copy_bytes,
    detach,
    finished,
    host_of,
    hosts_of,
    log_choice,
    new_array,
    signature,
    stream_of,
    values_key,
)
from mpigpu.core._cuda import StreamRef
from mpigpu.core.arguments import check_backend_name, op_of, reduction_arguments
from mpigpu.core.arrays import ArrayView, as_view, check_out, copy_single, require_c_order
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op, parse_op
from mpigpu.job.device import GpuInfo
from mpigpu.multi.binding import over_devices
from mpigpu.runtime.context import Context, announce_rejection
from mpigpu.runtime.plan import Choice, choose, choose_cached, remember

__all__ = [
    "Prepared",
    "allreduce",
    "allreduce_async",
    "bind",
    "bound",
    "check_rows_out",
    "explain",
    "lent_pair",
    "prepare",
    "reduce_scatter",
    "reduce_scatter_async",
    "run",
    "scatter_choice",
    "scatter_rows",
    "select_device",
]


def _nothing(stream: StreamRef | None, x_host: Any = None, out_host: Any = None) -> None:
    return None


# -- allreduce -------------------------------------------------------------------------------------------------
class _Allreduce(Family):
    """allreduce(x, op, out, backend): in place (out None), into ``out``, or into a new array for
    inputs that cannot be written (JAX)."""

    name = "allreduce"
    key = staticmethod(call_key)  # (x, op, out, backend): mpigpu.calls.keys reads it

    def validate(self, ctx: Context, x: Any, op: Any, out: Any, backend: Any) -> tuple[Record, Any]:
        op_, xv, outv = reduction_arguments(x, op, out, backend)  # the one validator
        finish = None
        if outv is None:
            if xv.framework == "jax":
                result, outv, finish = new_array(xv, xv.shape, x)
            else:
                outv, result = xv, x
        else:
            result = out
        live = (xv, outv, result, finish)
        # check_out, require_own_gpu, the choice and the signature are functions of the values in this
        # key alone (and of the context's fixed state): another object with these values shares the
        # record. A JAX input's output is a new array each call: a record for this call only.
        key = None if finish is not None else values_key(xv, None if out is None else outv, op_, backend)
        record = None if key is None else ctx.plan_cache.get(key)
        if record is None:
            if out is not None:
                check_out(xv, outv)
            ctx.require_own_gpu(xv)
            choice = choose_cached(ctx, xv, op_, backend)
            sig = signature("allreduce", xv, op_, choice.backend)
            if key is None:
                return Record(ctx, self, xv, outv, op_, choice, sig, sig.packed(), keep=False), live
            detached = detach(xv)
            record = Record(ctx, self, detached, detached if outv is xv else detach(outv), op_, choice, sig,
                            sig.packed())  # fmt: skip
            record.fused = _fused(ctx, record)
            remember(ctx, key, record)
        return record, live

    def execute(self, record: Record, args: tuple[Any, ...], stream: StreamRef | None, ranks: Any, live: Any) -> Any:
        rx = record.x
        if live is None:  # a remembered call: this call's own host arrays (the key holds their layout)
            x, _, out, _ = args
            if rx.device is None:
                x_host, out_host = hosts_of(record, x, out)
            else:
                record.ctx.activate_gpu()
                x_host = out_host = None
            (record.fused or record.launch or bound(record))(stream, x_host, out_host)
            return x if out is None else out
        if rx.device is not None:
            record.ctx.activate_gpu()
        xv, outv, result, finish = live
        if record.keep:
            (record.fused or record.launch or bound(record))(stream, xv.host, outv.host)
        elif xv.size:  # JAX: this call's new output
            ctx = record.ctx
            if ctx.size == 1:
                copy_single(xv, outv, stream)
            else:
                ctx.backend(record.choice.backend).allreduce(xv, outv, record.op, stream)
        return finished(record.ctx, result, finish, stream)

    def label(self, record: Record, phase: str) -> str:
        x = record.x
        if phase == "check":
            return f"allreduce of {x.size} {x.dtype.name} (cross-rank argument check)"
        return f"allreduce({record.choice.backend}, {x.dtype.name} x {x.size}, op={record.op.value})"


ALLREDUCE = _Allreduce()


def bind(ctx: Context, x: ArrayView, out: ArrayView, op: Op, backend: str) -> Any:
    """The call with everything but the stream (and the host arrays) fixed: the backend's bound
    launch, made here on its first use (collective: call it where every rank runs the call)."""
    if not x.size:
        return _nothing
    if ctx.size == 1:
        return partial(copy_single, x, out)
    if x.on_device:
        ctx.activate_gpu()
    return ctx.backend(backend).bind_allreduce(x, out, op)


def _fused(ctx: Context, record: Record) -> Any:
    """The record's launch with the check in it, where the call takes the check board (the cpu
    backend, at most DATA_BYTES, more than one rank, the check on and through the board: the same
    on every rank whose signature agrees), else None."""
    board = ctx.check_board
    if board is None or ctx.size == 1 or record.choice.backend != "cpu":
        return None
    from mpigpu.backends.cpu_board import bind_board_allreduce, fits_board  # with the backend it belongs to

    if not fits_board(record.x, record.op):
        return None
    return bind_board_allreduce(board, ctx.comm, record.x, record.op, record.signature, record.packed)


def bound(record: Record) -> Any:
    """The record's launch, bound on its first use (see ``bind``)."""
    launch = record.launch
    if launch is None:
        assert record.out is not None
        launch = record.launch = bind(record.ctx, record.x, record.out, record.op, record.choice.backend)
    return launch


def allreduce(
    x: Any,
    op: str | Op = "avg",
    *,
    out: Any = None,
    comm: Any = None,
    backend: str = "auto",
    stream: Any = None,
) -> Any:
    """Reduce ``x`` across all ranks of ``comm`` (default: the world) and return the result.

    op:      "avg" (default), "sum", "min", "max" or "prod".
    out:     None reduces in place and returns ``x``; an array receives the result, ``x`` untouched.
             (JAX arrays are immutable: a new JAX array is returned.)
    backend: "auto" (default) or one of "nccl", "cuda-aware", "host", "ipc", "cpu".
    stream:  for GPU arrays, the stream the call is ordered on (cuda.core, CuPy or PyTorch stream,
             anything with ``__cuda_stream__``, or an int handle). Default: the array framework's
             current stream. The result is ready in that stream's order when this returns.

    Collective: every rank must call it with the same size, dtype, op and backend; a mismatch
    raises MismatchError on every rank. Bad arguments leave the caller's arrays unchanged.

    A call with the arguments of an earlier one reuses what that one worked out (its record: one
    lookup, the cross-rank check and the backend's launch, as a persistent request's start).

    Several devices per process (mpigpu.multi): from a thread bound with ``mpigpu.on_device(i)`` the
    call takes part as that device; ``x`` a list (one array per device of this process; ``out`` and
    ``stream`` then lists too, or None) reduces them all from this thread and returns the list. Either
    way every device of every rank is a participant, and avg divides by their number.
    """
    in_place = type(x) is np.ndarray and out is None
    if in_place and call_remembered_in_place("allreduce", comm, x, op, backend):
        return x  # a call made before: the road's steps for its record in one function
    if over_devices(x):
        from mpigpu.calls.devices import allreduce_devices

        return allreduce_devices(x, op, out, comm, backend, stream)
    return call(ALLREDUCE, comm, stream, (x, op, out, backend))


def allreduce_async(
    x: Any,
    op: str | Op = "avg",
    *,
    out: Any = None,
    comm: Any = None,
    backend: str = "auto",
    stream: Any = None,
) -> Handle:
    """Start ``allreduce(x, op, out=..., comm=..., backend=..., stream=...)`` and return its Handle.

    Do not modify ``x`` (or read ``out``) until ``handle.wait()`` returns. Invalid arguments raise
    here, at once; the other ranks then get a MismatchError. For background-thread backends a
    cross-rank mismatch is raised by ``wait()``. Collective, like ``allreduce``: every rank starts
    the same calls in the same order. From a thread bound with ``on_device`` (or with a list) the call
    runs at once, as the devices must meet; ``wait()`` waits for the GPU work it enqueued."""
    if over_devices(x):
        from mpigpu.calls.devices_async import start_handle

        name, result, enqueued = start_handle(x, op, out, comm, backend, stream)
        return Handle(name, result=result, event=enqueued)
    return call_async(ALLREDUCE, comm, stream, (x, op, out, backend))


# -- a call prepared once (persistent requests, the average command) ----------------------------------------------
@dataclass(slots=True)
class Prepared:
    """A validated call whose ranks agreed, ready to run (treat as read-only): the record, this
    call's views and stream, and what ``allreduce`` returns."""

    ctx: Context
    record: Record
    x: ArrayView
    out: ArrayView
    stream: StreamRef | None
    result: Any  # what allreduce returns (out, x, or a new array for immutable inputs)
    finish: Any = None  # callable(out_view) -> result object, for immutable inputs (JAX)

    @property
    def op(self) -> Op:
        return self.record.op

    @property
    def choice(self) -> Choice:
        return self.record.choice

    def recorded(self) -> Record | None:
        """The record shared with ``allreduce``'s calls (None for JAX: a new output each call)."""
        return self.record if self.record.keep else None


def prepare(
    x: Any,
    op: str | Op = "avg",
    *,
    out: Any = None,
    comm: Any = None,
    backend: str = "auto",
    stream: Any = None,
) -> Prepared:
    """Validate an allreduce on every rank and check that all ranks agree (collective): the first
    half of the road, for a call run later by ``run`` (a persistent request's set-up).

    A rank whose own arguments are wrong raises its error; the other ranks raise MismatchError
    naming that rank, so no rank is left waiting."""
    ctx = Context.get(comm)
    ctx.enter("prepare")  # the one-thread rule
    try:
        ctx.wait_async()  # calls queued by the async forms on this communicator reach MPI first
        try:
            record, live = ALLREDUCE.validate(ctx, x, op, out, backend)  # shared by its values with allreduce's calls
        except Exception as exc:  # any failure here must reach the other ranks
            announce_rejection(ctx, exc)
            raise
        ref = stream_of(ctx, record, stream)
        if ctx.size > 1 and ctx.settings.check:
            with ctx.watchdog.watch(ALLREDUCE.label(record, "check")):
                check(ctx, record)
        xv, outv, result, finish = live
        return Prepared(ctx, record, xv, outv, ref, result, finish)
    finally:
        ctx.leave()


def run(prepared: Prepared) -> Any:
    """Run a prepared call's data part (no check: ``prepare`` made it) and return the result object."""
    ctx, record = prepared.ctx, prepared.record
    live = (prepared.x, prepared.out, prepared.result, prepared.finish)
    with ctx.watchdog.watch(ALLREDUCE.label(record, "data")):
        result = ALLREDUCE.execute(record, (), prepared.stream, None, live)
    if ctx.settings.log:
        log_choice(ctx, record.x, record.choice)
    return result


def explain(x: Any, op: str | Op = "avg", *, comm: Any = None, backend: str = "auto") -> Choice:
    """Which backend ``allreduce`` would use for ``x``, and why (local; moves no data)."""
    ctx = Context.get(comm)
    return choose(ctx, as_view(x), parse_op(op), backend)


def select_device(comm: Any = None) -> GpuInfo | None:
    """Bind this rank to its GPU (node-local rank modulo visible GPUs), make it current, and return it.

    Collective over ``comm`` (default: the world). Returns None on a machine with no GPU. Use the
    returned ``index`` for your framework: ``torch.cuda.set_device(mpigpu.select_device().index)``; for JAX
    call ``mpigpu.jax.init()`` instead (before JAX starts), which binds JAX's default device to it.
    """
    ctx = Context.get(comm)
    if ctx.gpu is not None:
        ctx.activate_gpu()
    return ctx.gpu


# -- reduce_scatter ---------------------------------------------------------------------------------------------
def scatter_rows(rows: int, size: int) -> list[int]:
    """Each rank's rows of a reduce_scatter of ``rows`` rows over ``size`` ranks (Horovod's split):
    the first ``rows % size`` ranks one more than the others."""
    base, extra = divmod(rows, size)
    return [base + (r < extra) for r in range(size)]


def check_rows_out(out: ArrayView, x: ArrayView, rows: int | None, name: str) -> None:
    """Refuse an ``out`` that cannot receive ``name``'s result of ``rows`` rows (None: any number,
    which the cross-rank check settles) of x's other dimensions: its shape, dtype, place, framework,
    layout, writability, or memory shared with x (local: InvalidArgument on this rank)."""
    if len(out.shape) != len(x.shape) or out.shape[1:] != x.shape[1:] or rows not in (None, out.shape[0]):
        want = ("rows" if rows is None else str(rows), *map(str, x.shape[1:]))
        raise InvalidArgument(
            f"out has shape {out.shape}, but {name}'s result on this rank has shape ({', '.join(want)}"
            f"{',' if len(want) == 1 else ''}): pass an array of that shape, or leave out out"
        )
    if out.dtype != x.dtype:
        raise InvalidArgument(f"out has dtype {out.dtype.name}, but x has {x.dtype.name}: they must match")
    if out.device != x.device:
        raise InvalidArgument(f"out is on {out.where} but x is on {x.where}: put both in the same place")
    if out.framework != x.framework:
        raise InvalidArgument(f"out is a {out.framework} array but x a {x.framework} one: pass an out of x's kind")
    if out.readonly:
        raise InvalidArgument("out is read-only; pass a writable array")
    require_c_order(out, name, "out")
    if out.overlaps(x):
        raise InvalidArgument("out overlaps x; pass an array that does not share memory with x")


def rows_view(x: Any, backend: Any, name: str) -> ArrayView:
    """x's view for a collective that splits it by rows of its first dimension."""
    check_backend_name(backend)
    xv = as_view(x, name="x")
    if not xv.shape:
        raise InvalidArgument(
            f"{name} splits x along its first dimension, but x has none (a 0-d array): pass x.reshape(1)"
        )
    return xv


def lent(view: ArrayView, array: Any) -> ArrayView:
    """A record's detached host ``view`` over this call's host ``array`` (``host_of``); GPU views as
    they are (their pointer is in the key)."""
    if view.device is not None:
        return view
    return view.with_host(host_of(view, array))


def lent_pair(record: Record, x: Any, out: Any) -> tuple[ArrayView, ArrayView | None]:
    """A remembered record's views of x and ``out`` (None: the call makes its output) over this call's arrays."""
    return lent(record.x, x), None if out is None else lent(record.out, out)  # type: ignore[arg-type]


class _ReduceScatter(Family):
    """reduce_scatter(x, op, out, backend): this rank's rows of x's reduction, into ``out`` or a new array."""

    name = "reduce_scatter"

    def key(self, x: Any, op: Any, out: Any, backend: Any) -> tuple[Any, ...] | None:
        return family_key("reduce_scatter", x, out, op, backend)

    def validate(self, ctx: Context, x: Any, op: Any, out: Any, backend: Any) -> tuple[Record, Any]:
        op_ = op_of(op)
        xv = rows_view(x, backend, "reduce_scatter")
        ctx.require_own_gpu(xv)
        rows = scatter_rows(xv.shape[0], ctx.size)
        outv = None
        if out is not None:
            outv = as_view(out, name="out")
            check_rows_out(outv, xv, rows[ctx.rank], "reduce_scatter")
        choice = scatter_choice(ctx, xv, op_, backend)
        sig = signature("reduce_scatter", xv, op_, choice.backend, placement=int(xv.on_device))
        record = Record(ctx, self, detach(xv), None if outv is None else detach(outv), op_, choice, sig, sig.packed(),
                        extra=rows)  # fmt: skip
        return record, (xv, outv)

    def execute(self, record: Record, args: tuple[Any, ...], stream: StreamRef | None, ranks: Any, live: Any) -> Any:
        ctx, rows = record.ctx, record.extra
        x, _, out, _ = args
        xv, outv = lent_pair(record, x, out) if live is None else live
        finish = None
        if out is None:
            out, outv, finish = new_array(xv, (rows[ctx.rank], *xv.shape[1:]), x)
        if xv.device is not None:
            ctx.activate_gpu()
        if ctx.size == 1:  # every op's result is x itself
            copy_bytes(outv, xv, stream)
        elif xv.size:
            launch = record.launch
            if launch is None:
                launch = record.launch = _bind_scatter(record)
            launch(xv, outv, stream)
        return finished(ctx, out, finish, stream)


def _bind_scatter(record: Record) -> Any:
    """The backend's reduce_scatter with the op and rows fixed: ``launch(x, out, stream)`` (the
    backend is created here on its first use: collective, after the check)."""
    backend = record.ctx.backend(record.choice.backend)
    binder = getattr(backend, "bind_reduce_scatter", None)
    if binder is not None:
        return binder(record.x, record.op, record.extra)
    method, op, rows = backend.reduce_scatter, record.op, record.extra  # type: ignore[attr-defined]
    return lambda xv, outv, stream: method(xv, outv, op, rows, stream)


def scatter_choice(ctx: Context, xv: ArrayView, op: Op, backend: str) -> Choice:
    """The named backend; under ``auto`` the reduce_scatter rules on GPUs, on host arrays the backend
    allreduce's auto picks for x (module docstring)."""
    if backend != "auto" or xv.on_device:
        return choose_cached(ctx, xv, op, backend, "reduce_scatter")
    picked = choose_cached(ctx, xv, op, "auto", "allreduce")
    return Choice(picked.backend, f"allreduce's choice, so the rows are allreduce's bits: {picked.reason}")


REDUCE_SCATTER = _ReduceScatter()


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
    return call(REDUCE_SCATTER, comm, stream, (x, op, out, backend))


def reduce_scatter_async(
    x: Any, op: str | Op = "avg", *, out: Any = None, comm: Any = None, backend: str = "auto", stream: Any = None
) -> Handle:
    """Start ``reduce_scatter(x, op, out=..., ...)`` and return its Handle; ``wait()`` returns the
    array. Runs as ``allreduce_async`` runs (see mpigpu.calls.handles): do not modify ``x`` (or read
    ``out``) until then. Invalid arguments raise here, on every rank; a cross-rank mismatch on a
    background-thread backend is raised by ``wait()``."""
    return call_async(REDUCE_SCATTER, comm, stream, (x, op, out, backend))
