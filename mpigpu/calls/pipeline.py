"""The one road every collective call takes: allreduce, reduce_scatter, alltoall, broadcast and
allgather, blocking and async, from one thread or (through mpigpu.multi) one thread per device.

A call is its family's key, read from the arguments by a few attribute reads (``mpigpu.calls.keys``).
A key seen before finds its record: the validated views, the backend's choice, the packed cross-rank
signature and the bound launch. A new call is validated once by its family (a rank that rejects its
own arguments joins the check with its error, so every rank raises for that call and the next call
pairs), chosen, recorded and remembered. Then, on every call alike:

1. the cross-rank check: every field of the signature, on every rank, before any buffer is read or
   written (one post on the node's check board; MPI across nodes). ``MPIGPU_CHECK=0`` skips it. A
   record whose launch makes the check itself (``fused``: a tiny host allreduce) makes it there;
2. the family's launch on this call's stream and arrays (its output, if the call returns a new one);
3. the choice logged once per (backend, reason) under ``MPIGPU_LOG``.

Both steps are watched (``MPIGPU_TIMEOUT``, ``MPIGPU_STALL``): a rank that never arrives is named by
the stall report. A family is a small class: its name, its key, its validation, its launch; a
collective adds those, not a road of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from threading import get_ident
from typing import TYPE_CHECKING, Any

import numpy as np

from mpigpu.backends import backend_code
from mpigpu.calls.handles import Handle, reject, start
from mpigpu.calls.keys import in_place_key
from mpigpu.core import timeline
from mpigpu.core._cuda import StreamRef, resolve_stream
from mpigpu.core.arrays import ArrayView, as_view, torch_cpu_array
from mpigpu.core.errors import InvalidArgument
from mpigpu.job.check import COLLECTIVES, Signature, check_rows, check_signature, raise_mismatch
from mpigpu.multi.binding import thread_binding
from mpigpu.multi.call import refuse_if_bound
from mpigpu.runtime.context import Context, announce_rejection
from mpigpu.runtime.plan import log_choice as plan_log
from mpigpu.runtime.plan import remember

if TYPE_CHECKING:
    from collections.abc import Callable

    from mpigpu.core.ops import Op
    from mpigpu.runtime.plan import Choice

__all__ = [
    "Family",
    "Record",
    "call",
    "call_async",
    "call_remembered_in_place",
    "check_root",
    "copy_bytes",
    "detach",
    "find",
    "finished",
    "host_of",
    "hosts_of",
    "log_choice",
    "new_array",
    "signature",
    "values_key",
]


@dataclass(slots=True, eq=False)
class Record:
    """A validated call, shared by every call (and request) with its key.

    ``x`` and ``out`` are views without the caller's array (``detach``), except in a record made
    for one call only (``keep`` False: JAX, whose output is a new array each call). ``out is x`` in
    place; ``out`` None where the call returns a new array. ``launch`` is bound at the first run
    (creating a backend is collective: it happens after the check). ``fused``: a launch that makes the
    cross-rank check itself, in the same post as its data (a tiny host allreduce through the check
    board, mpigpu.backends.cpu_board); ``go`` then makes no check of its own."""

    ctx: Context
    family: Family
    x: ArrayView
    out: ArrayView | None
    op: Op
    choice: Choice
    signature: Signature
    packed: bytes  # the signature as the check board posts it (``Signature.packed``)
    launch: Callable[..., Any] | None = None
    extra: Any = None  # the family's own: a reduce_scatter's rows, an alltoall's splits, a broadcast's root
    keep: bool = True  # False: made for one call; never remembered
    fused: Callable[..., Any] | None = None

    def watch_label(self, phase: str) -> str:
        """What the watchdog calls a call of this record in ``phase`` ("check" or "data")."""
        return self.family.label(self, phase)


def detach(view: ArrayView) -> ArrayView:
    """``view`` without the caller's array (nor anything keeping it alive): what a record keeps."""
    return ArrayView(
        None, view.ptr, view.shape, view.dtype, view.device, view.readonly, view.framework, order=view.order
    )


def values_key(xv: ArrayView, outv: ArrayView | None, op: Op, backend: str) -> tuple[Any, ...]:
    """The key of a call from its views (``outv`` None: in place): what validation depends on. Host
    arrays in place without their pointer; pointers wherever the memory itself matters."""
    if outv is None:
        return ("values", None if xv.device is None else xv.ptr, xv.shape, xv.dtype, xv.device, xv.order,
                xv.readonly, xv.framework, op, backend)  # fmt: skip
    return ("values", xv.ptr, xv.shape, xv.dtype, xv.device, xv.order, xv.readonly, xv.framework, op, backend,
            outv.ptr, outv.shape, outv.dtype, outv.device, outv.order, outv.readonly, outv.framework)  # fmt: skip


class Family:
    """One collective's part of the road. Subclasses set ``name`` and implement ``key``, ``validate``
    and ``execute``; ``per_rank`` families (allgather, alltoall) carry a value that may differ
    between ranks in the signature's ``root`` field (their first dimension), which the check then
    returns for every rank instead of requiring it equal."""

    name: str = ""
    per_rank: bool = False

    def key(self, *args: Any) -> tuple[Any, ...] | None:
        """The record's key for these arguments, or None where the call has no cheap key."""
        return None

    def validate(self, ctx: Context, *args: Any) -> tuple[Record, Any]:
        """Check this rank's arguments and choose the backend (local: no communication). Returns the
        record and what this one call needs besides it (live views for arrays without a key), or
        raises with the reason."""
        raise NotImplementedError

    def execute(self, record: Record, args: tuple[Any, ...], stream: StreamRef | None, ranks: list[int] | None,
                live: Any) -> Any:  # fmt: skip
        """The data part of one call (after the check): its output and the launch; returns the
        call's result. ``ranks``: every rank's ``root`` field, for ``per_rank`` families (None where
        the check did not learn them: it was off)."""
        raise NotImplementedError

    def log(self, ctx: Context, record: Record) -> None:
        """MPIGPU_LOG: this call's choice, in the one choice log."""
        log_choice(ctx, record.x, record.choice, self.name)

    def label(self, record: Record, phase: str) -> str:
        x = record.x
        if phase == "check":
            return f"{self.name} of {list(x.shape)} {x.dtype.name} (cross-rank argument check)"
        return f"{self.name}({record.choice.backend}, {x.dtype.name} x {x.size}, op={record.op.value})"


# -- finding a call's record ---------------------------------------------------------------------------
def find(ctx: Context, family: Family, args: tuple[Any, ...], on_error: Any = announce_rejection) -> tuple[Record, Any]:
    """The record of ``family``'s call with ``args``: remembered, or validated now and remembered.
    A rank whose validation fails tells the others (``on_error``: the check, or its place in the
    async queue) before raising, so no rank is left waiting."""
    try:
        key = family.key(*args)
        record = None if key is None else ctx.plan_cache.get(key)
    except Exception:  # an unhashable argument, say: validation refuses it on every rank
        key = record = None
    if record is not None:
        return record, None
    try:
        record, live = family.validate(ctx, *args)
    except Exception as exc:  # not only MpigpuError: any failure here must reach the other ranks
        on_error(ctx, exc)
        raise
    if key is not None and record.keep:
        remember(ctx, key, record)
    return record, live


def stream_of(ctx: Context, record: Record, stream: Any, on_error: Any = announce_rejection) -> StreamRef | None:
    """This call's stream for a GPU record (None for host arrays); a bad one is announced first."""
    x = record.x
    if x.device is None:
        return None
    try:
        return resolve_stream(stream, x.framework, x.device)
    except Exception as exc:  # a bad stream: every other rank must hear of it
        on_error(ctx, exc)
        raise


# -- the check and the launch ------------------------------------------------------------------------------
def check(ctx: Context, record: Record) -> list[int] | None:
    """The cross-rank check of ``record`` (collective): MismatchError on every rank unless all agree.
    Returns every rank's ``root`` field for ``per_rank`` families (None when they differ and must
    be gathered), else None."""
    board = ctx.check_board
    if board is not None and board.agree_packed(record.packed):
        return [record.signature.root] * ctx.size if record.family.per_rank else None
    family, name, shape = record.family, record.choice.backend, record.x.shape
    if family.per_rank:
        if board is not None:
            return _rows_posted(ctx, record)
        return check_rows(ctx.comm, record.signature, family.name, backend_name=name, shape=shape)
    if board is None:
        check_signature(ctx.comm, record.signature, family.name, backend_name=name, shape=shape)
        return None
    raise_mismatch(ctx.comm, record.signature, name, family.name, shape)


def _rows_posted(ctx: Context, record: Record) -> list[int] | None:
    """After the board found that the ranks' packed signatures differ: every rank's ``root`` field
    when nothing else differs, else MismatchError on every rank (each reads the same posts)."""
    board = ctx.check_board
    assert board is not None
    posted = board.posted()
    root = len(posted[0]) - 1  # the root field is the signature's last
    if posted[0][0] == 0 and all(v[:root] == posted[0][:root] for v in posted):
        return [v[root] for v in posted]
    sig = record.signature._replace(root=0)  # the message names what must agree, not the first dimension
    raise_mismatch(ctx.comm, sig, record.choice.backend, record.family.name, record.x.shape)


def go(ctx: Context, record: Record, args: tuple[Any, ...], stream: StreamRef | None, live: Any) -> Any:
    """The check (where on: more than one rank, MPIGPU_CHECK) and the family's launch, watched as one
    stay in the watchdog's ``active`` whose phase moves from "check" to "data" (a fused launch, whose
    wait is its check, stays in "check"); the choice logged."""
    if timeline.on:  # MPIGPU_TIMELINE: the same steps, each recorded (mpigpu/core/timeline.py)
        return _recorded_go(ctx, record, args, stream, live)
    fused = record.fused
    checked = fused is None and ctx.size > 1 and ctx.settings.check
    family = record.family
    watchdog = ctx.watchdog
    if watchdog.on:
        active = watchdog.active
        ident = get_ident()
        previous = active.get(ident)
        try:
            ranks = None
            if checked:
                active[ident] = (record, "check")
                ranks = check(ctx, record)
            active[ident] = (record, "data" if fused is None else "check")  # a fused launch waits in its check
            result = family.execute(record, args, stream, ranks, live)
        finally:
            if previous is None:
                active.pop(ident, None)
            else:
                active[ident] = previous
    else:
        result = family.execute(record, args, stream, check(ctx, record) if checked else None, live)
    if ctx.settings.log:
        family.log(ctx, record)
    return result


def _recorded_go(ctx: Context, record: Record, args: tuple[Any, ...], stream: StreamRef | None, live: Any) -> Any:
    """``go`` with MPIGPU_TIMELINE on: the call's start, the end of its check, the end of its launch
    and, for GPU arrays, its completion on the stream, on the timeline."""
    x, family, watchdog = record.x, record.family, ctx.watchdog
    event = timeline.begin(family.name, x.nbytes, record.choice.backend, ctx.serial)
    ranks = None
    if ctx.size > 1 and ctx.settings.check and record.fused is None:
        with watchdog.watch(family.label(record, "check")):
            ranks = check(ctx, record)
        event.mark("checked")
    with watchdog.watch(family.label(record, "data" if record.fused is None else "check")):
        result = family.execute(record, args, stream, ranks, live)
    if record.fused is not None:
        event.mark("checked")  # a fused launch's one post is its check: it ends with the data
    timeline.end(event, None if x.device is None or stream is None else stream.handle)
    if ctx.settings.log:
        family.log(ctx, record)
    return result


def call_remembered_in_place(name: str, comm: Any, x: np.ndarray, op: Any, backend: Any) -> bool:
    """One call of family ``name`` on NumPy array ``x`` in place whose remembered record (``in_place_key``)
    has its launch bound (every call after the first): what ``call``, ``find``, ``go`` and the family's
    ``execute`` do for such a record, with nothing between them: the calls queued by the async forms
    first, then the check (none where the launch is fused: a tiny host allreduce's check and data in one
    post on the board), then the launch, both watched as ``go`` watches them. On the GPU machine's cores
    this takes 1-2.5 us off a tiny call of 7-15 (bench/results/cpu-nodes-2026-11-29-lane-probes.txt).
    False, having done nothing, wherever the road has more to do: a thread bound to a device, the
    timeline or the choice log on (tested before the key is read), no such record (then ``call``).

    The watched check and launch are ``go``'s, written out here rather than shared: a shared helper would
    put back a call layer on this path; tests/test_remembered_lane_mpi.py holds the two to the same marks."""
    if thread_binding.__dict__.get("index") is not None or timeline.on:
        return False
    ctx = Context.get(comm)
    if ctx.settings.log:
        return False
    try:
        record = ctx.plan_cache.get(in_place_key(x, op, backend))
    except TypeError:  # an unhashable op or backend: the road refuses it on every rank
        return False
    if record is None or record.x.order != "C":
        return False
    fused = record.fused
    launch = fused or record.launch
    if launch is None:  # bound on the road, at the record's first launch (collective)
        return False
    checked = fused is None and ctx.size > 1 and ctx.settings.check
    ctx.enter(name)
    try:
        worker = ctx.async_worker
        if worker is not None:
            worker.drain()  # calls queued by the *_async forms on this communicator reach MPI first (``call``)
        watchdog = ctx.watchdog
        if not watchdog.on:
            if checked:
                check(ctx, record)
            launch(None, x, x)
            return True
        active = watchdog.active
        ident = get_ident()
        previous = active.get(ident)
        try:
            if checked:
                active[ident] = (record, "check")
                check(ctx, record)
            active[ident] = (record, "data" if fused is None else "check")  # a fused launch waits in its check
            launch(None, x, x)
        finally:
            if previous is None:
                active.pop(ident, None)
            else:
                active[ident] = previous
        return True
    finally:
        ctx.leave()


def call(family: Family, comm: Any, stream: Any, args: tuple[Any, ...]) -> Any:
    """One blocking call of ``family`` on ``comm`` (the road above), under the one-thread rule, after
    the calls queued on the communicator by the async forms."""
    if thread_binding.__dict__.get("index") is not None:  # no form over several devices per process
        refuse_if_bound(family.name, comm)  # raises, on every participant of every rank
    ctx = Context.get(comm)
    ctx.enter(family.name)  # held to the end, so no refused call lands between check and data
    try:
        worker = ctx.async_worker
        if worker is not None:
            worker.drain()  # calls queued by the *_async forms on this communicator reach MPI first
        record, live = find(ctx, family, args)
        return go(ctx, record, args, stream_of(ctx, record, stream), live)
    finally:
        ctx.leave()


def call_async(family: Family, comm: Any, stream: Any, args: tuple[Any, ...],
               around: Callable[[Callable[[], Any]], Any] | None = None) -> Handle:  # fmt: skip
    """Start one call of ``family`` and return its Handle (mpigpu.calls.handles says how each backend
    runs it). Invalid arguments raise here, on every rank, in the queue's order. ``around``: a layer's
    own wrapper of the call's check and launch (``attempt``), run as ``around(attempt)`` where they run
    (this thread, or the worker in the queue's order); its result is the handle's. The Horovod layer
    answers a joined rank's mismatch there with the call's next attempt, before any later call."""
    if thread_binding.__dict__.get("index") is not None:  # no form over several devices per process
        refuse_if_bound(f"{family.name}_async", comm)  # raises, on every participant of every rank
    ctx = Context.get(comm)
    ctx.enter(f"{family.name}_async")  # the one-thread rule: the queue's order is this thread's order
    try:
        record, live = find(ctx, family, args, reject)
        ref = stream_of(ctx, record, stream, reject)
        if around is None:
            return start(ctx, record.choice.backend, ref, lambda s: go(ctx, record, args, s, live))
        return start(ctx, record.choice.backend, ref, lambda s: around(partial(go, ctx, record, args, s, live)))
    finally:
        ctx.leave()


# -- shared by the families -----------------------------------------------------------------------------------
def log_choice(ctx: Context, x: ArrayView, choice: Choice, name: str = "allreduce") -> None:
    """MPIGPU_LOG: the one choice log (mpigpu.runtime.plan.log_choice)."""
    plan_log(ctx.rank, ctx.size, name, f"{x.dtype.name} on {x.where}", x.nbytes, choice)


def check_root(root: Any, size: int) -> int:
    """``root`` as a rank of a communicator of ``size``, or InvalidArgument."""
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise InvalidArgument(f"root must be an integer rank, not {type(root).__name__}")
    if not 0 <= int(root) < size:
        raise InvalidArgument(f"root={int(root)} is not a rank of this communicator (0 to {size - 1})")
    return int(root)


def signature(name: str, x: ArrayView, op: Op | None, backend: str, *, shape: tuple[int, ...] | None = None,
              root: int = 0, placement: int | None = None) -> Signature:  # fmt: skip
    """What this rank asks of collective ``name``, as the cross-rank check compares it: ``shape``
    (default x's) and ``root`` as the family defines them."""
    shape = x.shape if shape is None else shape
    count = x.size if shape is x.shape else int(np.prod(shape, dtype=np.int64))
    return Signature(
        count=count, dtype=x.dtype.code, op=0 if op is None else op.code, backend=backend_code(backend),
        placement=x.placement if placement is None else placement, shape=shape,
        collective=COLLECTIVES.index(name), root=root,
    )  # fmt: skip


def new_array(like: ArrayView, shape: tuple[int, ...], template: Any) -> tuple[Any, ArrayView, Any]:
    """An uninitialised array of ``shape`` in ``like``'s dtype, place and framework (``template``: the
    caller's array, whose framework makes it): (array, its view, finish), where ``finish`` turns it
    into the caller's type (JAX) or is None. GPU views are made directly: the array is ours,
    C-ordered and writable."""
    framework = like.framework
    if framework == "torch":
        import torch

        array = torch.empty(shape, dtype=template.dtype, device=template.device)
        if like.device is None:
            return array, as_view(array, name="out"), None
        return array, ArrayView(array, array.data_ptr(), shape, like.dtype, like.device, False, "torch"), None
    if like.device is not None:
        from mpigpu.core._cuda import cupy, set_device

        set_device(like.device)
        holder = cupy().empty(shape, dtype=like.dtype.np)
        view = ArrayView(holder, holder.data.ptr, shape, like.dtype, like.device, False, "cupy")
    else:
        holder = np.empty(shape, dtype=like.dtype.np)
        view = ArrayView(holder, holder.ctypes.data, shape, like.dtype, None, False, "numpy", holder)
    if framework != "jax":
        return holder, view, None
    import jax.dlpack
    import jax.numpy as jnp

    def finish(arr: Any) -> Any:
        return jax.dlpack.from_dlpack(arr) if like.device is not None else jnp.asarray(arr)

    return holder, view, finish


def finished(ctx: Context, result: Any, finish: Any, stream: StreamRef | None) -> Any:
    """The call's result: ``finish(result)`` where the caller's type is made from ours (JAX), on the
    async worker only after its stream's work is done (JAX reads the array on a stream of its own)."""
    if finish is None:
        return result
    worker = ctx.async_worker
    if stream is not None and worker is not None and worker.runs_here():
        from mpigpu.core._cuda import core_stream

        core_stream(stream.handle).sync()
    return finish(result)


def host_of(view: ArrayView, array: Any) -> Any:
    """This call's NumPy array for a record's host ``view``: a NumPy array itself (a Fortran-order one
    as its transpose, C order), or another host array's (a torch CPU tensor's) zero-copy view."""
    if type(array) is np.ndarray:
        return array if view.order == "C" else array.T
    if type(array).__module__ == "torch":  # a CPU tensor, valid as its record found it: its memory, no checks
        return torch_cpu_array(array)
    return as_view(array, name="x").host


def hosts_of(record: Record, x: Any, out: Any) -> tuple[Any, Any]:
    """This call's host arrays for a remembered host record: x's, and out's (x's when ``out`` is None
    or x itself)."""
    x_host = host_of(record.x, x)
    return x_host, x_host if out is None or out is x else host_of(record.out, out)  # type: ignore[arg-type]


def copy_bytes(dst: ArrayView, src: ArrayView, stream: StreamRef | None) -> None:
    """dst[...] = src (same bytes, same place), in stream order for GPU arrays."""
    if not src.nbytes:
        return
    if src.host is not None and dst.host is not None:
        dst.host.reshape(-1).view(np.uint8)[...] = src.host.reshape(-1).view(np.uint8)
        return
    from mpigpu.core._cuda import cupy

    runtime = cupy().cuda.runtime
    handle = 0 if stream is None else stream.handle
    runtime.memcpyAsync(dst.ptr, src.ptr, src.nbytes, runtime.memcpyDeviceToDevice, handle)
