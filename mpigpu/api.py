"""``allreduce``: the one call every path goes through."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from threading import get_ident
from typing import Any

import numpy as np

from mpigpu.backends import backend_code
from mpigpu.core import timeline
from mpigpu.core._cuda import StreamRef, resolve_stream
from mpigpu.core.arrays import ArrayView, as_view, check_out, copy_single, scalar_fix
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op, parse_op
from mpigpu.job.check import Signature, check_packed, check_signature, raise_mismatch
from mpigpu.job.device import GpuInfo
from mpigpu.multi.binding import thread_binding
from mpigpu.records import Launch, Record, call_key, detach, values_key
from mpigpu.runtime.context import Context, announce_rejection
from mpigpu.runtime.plan import Choice, choose, choose_cached, remember

__all__ = [
    "Prepared",
    "allreduce",
    "bind",
    "bound",
    "check_call",
    "copy_single",
    "explain",
    "prepare",
    "run",
    "select_device",
    "validate",
]


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a setattr call per field, on every call
class Prepared:
    """A validated call: views, the chosen backend and the stream, ready to run (treat as read-only)."""

    ctx: Context
    x: ArrayView
    out: ArrayView
    op: Op
    choice: Choice
    stream: StreamRef | None
    result: Any  # what allreduce returns (out, x, or a new array for immutable inputs)
    finish: Any = None  # callable(out_view) -> result object, for immutable inputs (JAX)
    # what every call with these arguments shares (signature, bound launch); None for JAX inputs,
    # whose output is a new array each call
    record: Record | None = None
    # the (x, op, choice) the record was found for: check_call and run use the record only for those
    # very objects (a Prepared copied with another x, op or choice is checked and run as it stands)
    signed: tuple[Any, ...] = ()

    def watch_label(self, phase: str) -> str:
        """What the watchdog calls this call's ``phase`` ("check" or "data") when it reports it."""
        x = self.x
        if phase == "check":
            return f"allreduce of {x.size} {x.dtype.name} (cross-rank argument check)"
        return f"allreduce({self.choice.backend}, {x.dtype.name} x {x.size}, op={self.op.value})"

    def recorded(self) -> Record | None:
        """The record, where this Prepared is the call it was found for."""
        record, signed = self.record, self.signed
        if record is None or signed[0] is not self.x or signed[1] is not self.op or signed[2] is not self.choice:
            return None
        return record


def _output_for(x: ArrayView) -> tuple[ArrayView, Any, Any]:
    """A fresh output array for an input that cannot be written (JAX): (view, holder, finish)."""
    if x.on_device:
        from mpigpu.core._cuda import cupy, set_device

        set_device(x.device)  # type: ignore[arg-type]
        holder = cupy().empty(x.shape, dtype=x.dtype.np)
    else:
        holder = np.empty(x.shape, dtype=x.dtype.np)
    finish = None
    if x.framework == "jax":
        import jax.dlpack
        import jax.numpy as jnp

        def finish(arr: Any) -> Any:
            return jax.dlpack.from_dlpack(arr) if x.on_device else jnp.asarray(arr)

    return as_view(holder, name="out"), holder, finish


_OPS: dict[str, Op] = {o.value: o for o in Op}  # "sum" -> Op.SUM; Op.SUM itself hashes as "sum"


def validate(ctx: Context, x: Any, op: Any, out: Any, backend: str, stream: Any) -> Prepared:
    """Check this rank's arguments and choose the backend (local: no communication)."""
    op_ = _OPS.get(op) if type(op) is str or type(op) is Op else None  # the common spellings: a lookup
    if op_ is None:
        op_ = parse_op(op)
    if not isinstance(backend, str):
        raise InvalidArgument(f"backend must be a string such as 'auto' or 'nccl', not {type(backend).__name__}")
    xv = as_view(x, name="x")
    finish = None
    if out is None:
        if xv.readonly and xv.framework != "jax":
            raise InvalidArgument(
                scalar_fix(xv) or "x is read-only, so it cannot be reduced in place: pass out=<writable array>"
            )
        if xv.framework == "jax":
            outv, result, finish = _output_for(xv)
        else:
            outv, result = xv, x
    else:
        outv, result = as_view(out, name="out"), out
    # check_out, require_own_gpu, the backend's choice and the check's signature are functions of the
    # values in the key alone (and of the context's fixed state): a call with the values of an earlier
    # one takes its record instead. A JAX input's output is a new array every call: no record.
    record = None
    if finish is None:
        key = values_key(xv, None if out is None else outv, op_, backend)
        record = ctx.plan_cache.get(key)
    if record is None:
        if out is not None:
            check_out(xv, outv)
        ctx.require_own_gpu(xv)
        choice = choose_cached(ctx, xv, op_, backend)
        if finish is None:
            record = _record(ctx, xv, outv, op_, choice)
            remember(ctx, key, record)
    else:
        choice = record.choice
    ref = resolve_stream(stream, xv.framework, xv.device) if xv.on_device else None
    return Prepared(ctx, xv, outv, op_, choice, ref, result, finish, record, (xv, op_, choice))


def _record(ctx: Context, xv: ArrayView, outv: ArrayView, op: Op, choice: Choice) -> Record:
    """A new record of a validated call (in place: its out is its x)."""
    x = detach(xv)
    signature = _signature(xv, op, choice.backend)
    return Record(ctx, x, x if outv is xv else detach(outv), op, choice, signature, signature.packed())


def _signature(xv: ArrayView, op: Op, backend: str) -> Signature:
    """What this rank asks for, as the cross-rank check compares it."""
    return Signature(
        count=xv.size,
        dtype=xv.dtype.code,
        op=op.code,
        backend=backend_code(backend),
        placement=xv.placement,
        shape=xv.shape,
    )


def prepare(
    x: Any,
    op: str | Op = "avg",
    *,
    out: Any = None,
    comm: Any = None,
    backend: str = "auto",
    stream: Any = None,
) -> Prepared:
    """Validate a call on every rank and check that all ranks agree (collective).

    A rank whose own arguments are wrong raises its error; the other ranks raise MismatchError
    naming that rank, so no rank is left waiting."""
    ctx = Context.get(comm)
    ctx.enter("prepare")  # the one-thread rule
    try:
        return _prepare(ctx, x, op, out, backend, stream)
    finally:
        ctx.leave()


def _prepare(ctx: Context, x: Any, op: Any, out: Any, backend: str, stream: Any) -> Prepared:
    ctx.wait_async()  # calls queued by allreduce_async on this communicator reach MPI first
    try:
        prepared = validate(ctx, x, op, out, backend, stream)
    except Exception as exc:  # not only MpigpuError: any failure here must reach the other ranks
        announce_rejection(ctx, exc)
        raise
    check_call(prepared)
    return prepared


def check_call(prepared: Prepared) -> None:
    """The cross-rank check of a validated call: MismatchError on every rank unless all agree
    (collective; nothing to compare with one rank)."""
    ctx = prepared.ctx
    if not ctx.settings.check or ctx.size == 1:
        return
    record = prepared.recorded()
    if record is not None:
        _check(ctx, record, record.signature, record.packed)
    else:
        _check(ctx, prepared, _signature(prepared.x, prepared.op, prepared.choice.backend), None)


def _check(ctx: Context, call: Any, signature: Signature, packed: bytes | None) -> None:
    """check_packed (check_signature where nothing was packed), watched: a rank that never arrives
    would leave the others waiting here."""
    name = call.choice.backend
    if ctx.watchdog.on:
        previous = ctx.watchdog.enter(call, "check")
        try:
            if packed is None:
                check_signature(ctx.comm, signature, backend_name=name)
            else:
                check_packed(ctx.comm, ctx.check_board, signature, packed, name)
        finally:
            ctx.watchdog.leave(previous)
    elif packed is None:
        check_signature(ctx.comm, signature, backend_name=name)
    else:
        check_packed(ctx.comm, ctx.check_board, signature, packed, name)


def _nothing(stream: StreamRef | None, x_host: Any = None, out_host: Any = None) -> None:
    return None


def bind(ctx: Context, x: ArrayView, out: ArrayView, op: Op, backend: str) -> Launch:
    """The call with everything but the stream (and the host arrays) fixed: the backend's bound
    launch, made here on its first use (collective: call it where every rank runs the call)."""
    if not x.size:
        return _nothing
    if ctx.size == 1:
        return partial(copy_single, x, out)
    if x.on_device:
        ctx.activate_gpu()
    return ctx.backend(backend).bind_allreduce(x, out, op)


def bound(record: Record) -> Launch:
    """The record's launch, bound on its first use (see ``bind``)."""
    launch = record.launch
    if launch is None:
        launch = record.launch = bind(record.ctx, record.x, record.out, record.op, record.choice.backend)
    return launch


def _go(ctx: Context, record: Record, stream: StreamRef | None, x_host: Any, out_host: Any, check: bool) -> None:
    """With ``check``, the cross-rank check of the record's signature; then the record's launch on this
    call's stream and host arrays. Watched as one stay in ``active`` whose phase moves from "check"
    to "data" (a rank that never arrives; the first launch may create the backend: collective)."""
    if timeline.on:  # timeline hook: the same steps, each recorded (mpigpu/core/timeline.py)
        return _recorded_go(ctx, record, stream, x_host, out_host, check)
    watchdog = ctx.watchdog
    if watchdog.on:
        active = watchdog.active
        ident = get_ident()
        previous = active.get(ident)
        try:
            if check:
                active[ident] = (record, "check")
                _check_record(ctx, record)
            active[ident] = (record, "data")
            if record.x.device is not None:
                ctx.activate_gpu()
            (record.launch or bound(record))(stream, x_host, out_host)
        finally:
            if previous is None:
                active.pop(ident, None)
            else:
                active[ident] = previous
    else:
        if check:
            _check_record(ctx, record)
        if record.x.device is not None:
            ctx.activate_gpu()
        (record.launch or bound(record))(stream, x_host, out_host)
    if ctx.settings.log:
        _log_choice(ctx, record.x, record.choice)


def _recorded_go(  # timeline hook
    ctx: Context, record: Record, stream: StreamRef | None, x_host: Any, out_host: Any, check: bool
) -> None:
    """``_go`` with MPIGPU_TIMELINE on: the call's start, the end of its check, the end of its launch
    and, for GPU arrays, its completion on the stream, on the timeline."""
    x, watchdog = record.x, ctx.watchdog
    event = timeline.begin("allreduce", x.nbytes, record.choice.backend, ctx.serial)
    if check:
        previous = watchdog.enter(record, "check") if watchdog.on else None
        try:
            _check_record(ctx, record)
        finally:
            if watchdog.on:
                watchdog.leave(previous)
        event.mark("checked")
    previous = watchdog.enter(record, "data") if watchdog.on else None
    try:
        if x.device is not None:
            ctx.activate_gpu()
        (record.launch or bound(record))(stream, x_host, out_host)
    finally:
        if watchdog.on:
            watchdog.leave(previous)
    timeline.end(event, None if x.device is None or stream is None else stream.handle)
    if ctx.settings.log:
        _log_choice(ctx, x, record.choice)


def _check_record(ctx: Context, record: Record) -> None:
    """check_packed, with the board's hot path inline."""
    board = ctx.check_board
    if board is None:
        check_packed(ctx.comm, None, record.signature, record.packed, record.choice.backend)
    elif not board.agree_packed(record.packed):
        raise_mismatch(ctx.comm, record.signature, record.choice.backend)


def _call_backend(prepared: Prepared) -> None:
    """A call without a record (JAX's fresh output; a Prepared copied with other views): the backend
    on the views as they stand."""
    ctx, x = prepared.ctx, prepared.x
    if ctx.size == 1:
        if x.on_device:
            ctx.activate_gpu()
        copy_single(x, prepared.out, prepared.stream)
        return
    backend = ctx.backend(prepared.choice.backend)
    if x.on_device:
        ctx.activate_gpu()
    backend.allreduce(x, prepared.out, prepared.op, prepared.stream)


def run(prepared: Prepared) -> Any:
    """Execute a prepared call on its backend; return the result object."""
    record = prepared.recorded()
    ctx = prepared.ctx
    if record is not None:
        _go(ctx, record, prepared.stream, prepared.x.host, prepared.out.host, False)
    elif prepared.x.size:
        if ctx.watchdog.on:  # creating the backend (first call) is collective too: watch it
            previous = ctx.watchdog.enter(prepared, "data")
            try:
                _call_backend(prepared)
            finally:
                ctx.watchdog.leave(previous)
        else:
            _call_backend(prepared)
        if ctx.settings.log:
            _log_choice(ctx, prepared.x, prepared.choice)
    if prepared.finish is not None:
        return prepared.finish(prepared.result)
    return prepared.result


def _again(ctx: Context, record: Record, x: Any, out: Any, stream: Any) -> Any:
    """A call whose key found its record: this call's stream or host arrays, the cross-rank check,
    the record's launch. Nothing else is worked out again."""
    rx = record.x
    if rx.device is not None:
        try:
            ref = resolve_stream(stream, rx.framework, rx.device)
        except Exception as exc:  # a bad stream: every other rank must hear of it
            announce_rejection(ctx, exc)
            raise
        x_host = out_host = None
    else:  # the key holds the layout: a Fortran-order array's elements are its transpose's, in C order
        ref = None
        x_host = x if rx.order == "C" else x.T
        out_host = x_host if out is None or out is x else (out if record.out.order == "C" else out.T)
    _go(ctx, record, ref, x_host, out_host, ctx.size > 1 and ctx.settings.check)
    return x if out is None else out


_logged: set[tuple[str, str]] = set()


def _log_choice(ctx: Context, x: ArrayView, choice: Choice) -> None:
    key = (choice.backend, choice.reason)
    if ctx.rank == 0 and key not in _logged and x.size and ctx.size > 1:
        _logged.add(key)
        import sys

        sys.stderr.write(f"mpigpu: {x.nbytes} B {x.dtype.name} on {x.where} -> {choice.backend} ({choice.reason})\n")


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

    A call with the arguments of an earlier one (mpigpu.records) reuses what that one worked out:
    one lookup, the cross-rank check and the backend's launch, as a persistent request's start.

    Several devices per process (mpigpu.multi): from a thread bound with ``mpigpu.on_device(i)`` the
    call takes part as that device; ``x`` a list (one array per device of this process; ``out`` and
    ``stream`` then lists too, or None) reduces them all from this thread and returns the list. Either
    way every device of every rank is a participant, and avg divides by their number.
    """
    if type(x) is list or type(x) is tuple or thread_binding.__dict__.get("index") is not None:
        from mpigpu.multi.call import allreduce_devices

        return allreduce_devices(x, op, out, comm, backend, stream)
    ctx = Context.get(comm)
    ctx.enter("allreduce")  # the one-thread rule; held to the end, so no refused call lands between check and data
    try:
        if ctx.async_worker is not None:
            ctx.async_worker.drain()  # calls queued by allreduce_async on this communicator reach MPI first
        try:
            key = call_key(x, op, out, backend)
            record = None if key is None else ctx.plan_cache.get(key)
        except Exception:  # an unhashable op or backend, say: the full path refuses it on every rank
            key = record = None
        if record is not None:
            return _again(ctx, record, x, out, stream)
        prepared = _prepare(ctx, x, op, out, backend, stream)
        if key is not None and prepared.record is not None:
            remember(ctx, key, prepared.record)
        return run(prepared)
    finally:
        ctx.leave()


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
