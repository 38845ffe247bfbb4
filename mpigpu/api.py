"""``allreduce``: the one call every path goes through."""

from __future__ import annotations

from dataclasses import dataclass
from threading import get_ident
from typing import Any

import numpy as np

from mpigpu.backends import backend_code
from mpigpu.core._cuda import StreamRef, resolve_stream
from mpigpu.core.arrays import ArrayView, as_view, check_out, scalar_fix
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op, parse_op
from mpigpu.job.check import Signature, check_signature
from mpigpu.job.device import GpuInfo
from mpigpu.runtime.context import Context, announce_rejection
from mpigpu.runtime.plan import Choice, choose, choose_cached

__all__ = [
    "Prepared",
    "allreduce",
    "check_call",
    "explain",
    "prepare",
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
    # the cross-rank check's signature and the (x, op, choice) it was made for: check_call uses it only
    # for those very objects (a Prepared copied with another x, op or choice gets a new one)
    signature: Signature | None = None
    signed: tuple[Any, ...] = ()

    def watch_label(self, phase: str) -> str:
        """What the watchdog calls this call's ``phase`` ("check" or "data") when it reports it."""
        x = self.x
        if phase == "check":
            return f"allreduce of {x.size} {x.dtype.name} (cross-rank argument check)"
        return f"allreduce({self.choice.backend}, {x.dtype.name} x {x.size}, op={self.op.value})"


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


_LAST_CALL = ("api.validate: the last call",)  # its key in ctx.plan_cache (choose_cached's keys have 6 items)
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
    # check_out, require_own_gpu, the backend's choice and the check's signature are functions of these
    # values alone (and of the context's fixed state): a call repeating the last call's values skips
    # them. Values, not objects: the memo holds no reference to the caller's arrays, and a different
    # array (or the same one moved, resized or made read-only) at other values is validated in full.
    # It lives in the plan cache, so whatever forgets the remembered choices (a new tuning table)
    # forgets it too.
    key = (
        xv.ptr, xv.shape, xv.dtype, xv.device, xv.order, op_, backend,
        None if out is None else (outv.ptr, outv.shape, outv.dtype, outv.device, outv.readonly, outv.order),
    )  # fmt: skip
    memo = ctx.plan_cache.get(_LAST_CALL)
    if memo is not None and memo[0] == key:
        _, choice, signature = memo
    else:
        if out is not None:
            check_out(xv, outv)
        ctx.require_own_gpu(xv)
        choice = choose_cached(ctx, xv, op_, backend)
        signature = _signature(xv, op_, choice.backend)
        ctx.plan_cache[_LAST_CALL] = (key, choice, signature)
    ref = resolve_stream(stream, xv.framework, xv.device) if xv.on_device else None
    return Prepared(ctx, xv, outv, op_, choice, ref, result, finish, signature, (xv, op_, choice))


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


def _watched(ctx: Context, prepared: Prepared, phase: str) -> Any:
    """Show the watchdog that this thread is in ``phase`` of ``prepared`` (Watchdog's protocol: a new
    tuple in ``active``, named only if reported); return what was there, for ``_unwatched``. The
    hot path's ``watch``: a third of its cost, no label formatted."""
    active = ctx.watchdog.active
    key = get_ident()
    previous = active.get(key)
    active[key] = (prepared, phase)
    return previous


def _unwatched(ctx: Context, previous: Any) -> None:
    active = ctx.watchdog.active
    if previous is None:
        active.pop(get_ident(), None)
    else:
        active[get_ident()] = previous


def check_call(prepared: Prepared) -> None:
    """The cross-rank check of a validated call: MismatchError on every rank unless all agree (collective)."""
    ctx, xv = prepared.ctx, prepared.x
    if ctx.settings.check:
        signature = prepared.signature
        signed = prepared.signed
        if signature is None or signed[0] is not xv or signed[1] is not prepared.op or signed[2] is not prepared.choice:
            signature = _signature(xv, prepared.op, prepared.choice.backend)
        name = prepared.choice.backend
        if ctx.watchdog.on:  # a rank that never arrives would leave the others waiting here
            previous = _watched(ctx, prepared, "check")
            try:
                check_signature(ctx.comm, signature, backend_name=name)
            finally:
                _unwatched(ctx, previous)
        else:
            check_signature(ctx.comm, signature, backend_name=name)


def _single_rank(prepared: Prepared) -> None:
    """One rank: every op's result is the input itself, so copy (or, in place, do nothing).

    No backend is called. Besides saving the launch, this avoids NCCL 2.28's single-rank ncclAvg on
    float64, which leaves the last elements of an out-of-place result unwritten."""
    x, out = prepared.x, prepared.out
    if x.same_memory(out):
        return
    if x.host is not None and out.host is not None:
        out.host[...] = x.host
        return
    from mpigpu.core._cuda import cupy

    runtime = cupy().cuda.runtime
    handle = prepared.stream.handle if prepared.stream is not None else 0
    runtime.memcpyAsync(out.ptr, x.ptr, x.nbytes, runtime.memcpyDeviceToDevice, handle)


def _call_backend(prepared: Prepared) -> None:
    ctx, x = prepared.ctx, prepared.x
    backend = ctx.backend(prepared.choice.backend)
    if x.on_device:
        ctx.activate_gpu()
    backend.allreduce(x, prepared.out, prepared.op, prepared.stream)


def run(prepared: Prepared) -> Any:
    """Execute a prepared call on its backend; return the result object."""
    if prepared.x.size and prepared.ctx.size == 1:
        if prepared.x.on_device:
            prepared.ctx.activate_gpu()
        _single_rank(prepared)
    elif prepared.x.size:
        ctx = prepared.ctx
        if ctx.watchdog.on:  # creating the backend (first call) is collective too: watch it
            previous = _watched(ctx, prepared, "data")
            try:
                _call_backend(prepared)
            finally:
                _unwatched(ctx, previous)
        else:
            _call_backend(prepared)
        if ctx.settings.log:
            _log_choice(ctx, prepared)
    if prepared.finish is not None:
        return prepared.finish(prepared.result)
    return prepared.result


_logged: set[tuple[str, str]] = set()


def _log_choice(ctx: Context, prepared: Prepared) -> None:
    key = (prepared.choice.backend, prepared.choice.reason)
    if ctx.rank == 0 and key not in _logged:
        _logged.add(key)
        import sys

        sys.stderr.write(
            f"mpigpu: {prepared.x.nbytes} B {prepared.x.dtype.name} on {prepared.x.where} -> "
            f"{prepared.choice.backend} ({prepared.choice.reason})\n"
        )


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
    """
    ctx = Context.get(comm)
    ctx.enter("allreduce")  # the one-thread rule; held to the end, so no refused call lands between check and data
    try:
        return run(_prepare(ctx, x, op, out, backend, stream))
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
