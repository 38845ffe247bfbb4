"""``broadcast`` and ``allgather``: data movement with allreduce's conventions (array types, ``comm``,
``backend``, ``stream``, the one-thread rule, the cross-rank check with MismatchError on every rank,
inputs untouched on error).

Backends: cpu (MPI_Bcast / MPI_Allgatherv), nccl (ncclBroadcast / ncclAllGather; unequal first
dimensions: one ncclBroadcast per rank in an NCCL group), cuda-aware (MPI on device pointers after
synchronising the stream), host (GPU arrays staged through a private pinned buffer, not the
node-shared segment yet). ipc does not implement them: ``auto`` passes over it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpigpu.backends import backend_code
from mpigpu.core._cuda import StreamRef, resolve_stream
from mpigpu.core.arrays import ArrayView, as_view, require_c_order, scalar_fix
from mpigpu.core.errors import InvalidArgument
from mpigpu.core.ops import Op
from mpigpu.job.check import COLLECTIVES, Signature, check_rows, check_signature
from mpigpu.multi.call import refuse_if_bound
from mpigpu.runtime.context import Context, announce_rejection
from mpigpu.runtime.plan import Choice, choose_cached

__all__ = ["allgather", "broadcast", "check_root"]

_BROADCAST, _ALLGATHER = COLLECTIVES.index("broadcast"), COLLECTIVES.index("allgather")


def check_root(root: Any, size: int) -> int:
    """``root`` as a rank of a communicator of ``size``, or InvalidArgument."""
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise InvalidArgument(f"root must be an integer rank, not {type(root).__name__}")
    if not 0 <= int(root) < size:
        raise InvalidArgument(f"root={int(root)} is not a rank of this communicator (0 to {size - 1})")
    return int(root)


# ctx.plan_cache keys of the last call's memo (choose_cached's keys have 6 items)
_LAST = {"broadcast": ("collectives: the last broadcast",), "allgather": ("collectives: the last allgather",)}


def _validate(
    ctx: Context, x: Any, backend: Any, collective: str, root: int = 0
) -> tuple[ArrayView, Choice, Signature]:
    """This rank's array, backend and signature (local): placement on the rank's GPU, a usable
    backend, an array the collective can take.

    All but reading the array is a function of the values in the memo's key (and the context's
    fixed state): a call repeating the last call's values skips it (allreduce keeps a record per
    signature instead: mpigpu.records).
    Values, not objects: the memo holds no reference to the caller's array. It lives in the plan
    cache, so whatever forgets the remembered choices (a new tuning table) forgets it too."""
    if not isinstance(backend, str):
        raise InvalidArgument(f"backend must be a string such as 'auto' or 'nccl', not {type(backend).__name__}")
    xv = as_view(x, name="x")
    key = (xv.shape, xv.dtype, xv.device, xv.order, xv.readonly, xv.framework, backend, root)
    memo = ctx.plan_cache.get(_LAST[collective])
    if memo is not None and memo[0] == key:
        return xv, memo[1], memo[2]
    ctx.require_own_gpu(xv)
    if collective == "broadcast" and xv.readonly and xv.framework != "jax":
        raise InvalidArgument(
            scalar_fix(xv) or "x is read-only, so it cannot receive the broadcast in place: pass a writable array"
        )
    if collective == "allgather":
        require_c_order(xv, "allgather")
    if collective == "allgather" and not xv.shape:
        raise InvalidArgument(
            "allgather concatenates along the first dimension, but x has none (a 0-d array): pass x.reshape(1)"
        )
    choice = choose_cached(ctx, xv, Op.SUM, backend, collective)
    if collective == "broadcast":
        signature = Signature(
            count=xv.size, dtype=xv.dtype.code, op=0, backend=backend_code(choice.backend),
            placement=xv.placement, shape=xv.shape, collective=_BROADCAST, root=root,
        )  # fmt: skip
    else:  # the first dimension may differ between ranks: it rides in root, which check_rows lets differ
        trailing = xv.shape[1:]
        signature = Signature(
            count=math.prod(trailing), dtype=xv.dtype.code, op=0, backend=backend_code(choice.backend),
            placement=int(xv.on_device), shape=trailing, collective=_ALLGATHER, root=xv.shape[0],
        )  # fmt: skip
    ctx.plan_cache[_LAST[collective]] = (key, choice, signature)
    return xv, choice, signature


def _check(ctx: Context, signature: Signature, backend: str, label: Any) -> None:
    """The cross-rank check of a broadcast (collective): MismatchError on every rank unless all agree.
    ``label()`` names the call for the watchdog (made only when one is set)."""
    if not ctx.settings.check:
        return
    if ctx.watchdog.on:  # a rank that never arrives would leave the others waiting here
        with ctx.watchdog.watch(f"{label()} (cross-rank argument check)"):
            check_signature(ctx.comm, signature, "broadcast", backend_name=backend)
    else:
        check_signature(ctx.comm, signature, "broadcast", backend_name=backend)


def _rows(ctx: Context, signature: Signature, backend: str, label: Any) -> list[int]:
    """The cross-rank check of an allgather and every rank's first dimension (collective): one
    exchange when the first dimensions are equal or the ranks share a node, else one more
    MPI_Allgather; MismatchError on every rank unless all agree."""
    if not ctx.settings.check:
        return _gather_rows(ctx, signature.root)
    if ctx.watchdog.on:
        with ctx.watchdog.watch(f"{label()} (cross-rank argument check)"):
            rows = check_rows(ctx.comm, signature, "allgather", backend_name=backend)
    else:
        rows = check_rows(ctx.comm, signature, "allgather", backend_name=backend)
    return rows if rows is not None else _gather_rows(ctx, signature.root)


def _new_array(like: ArrayView, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """An uninitialised array of ``shape`` in ``like``'s dtype, place and framework: (array, finish),
    where ``finish`` turns it into the caller's type (JAX) or is None."""
    if like.framework == "torch":
        import torch

        return torch.empty(shape, dtype=like.obj.dtype, device=like.obj.device), None
    if like.on_device:
        from mpigpu.core._cuda import cupy, set_device

        set_device(like.device)  # type: ignore[arg-type]
        holder = cupy().empty(shape, dtype=like.dtype.np)
    else:
        holder = np.empty(shape, dtype=like.dtype.np)
    if like.framework != "jax":
        return holder, None
    import jax.dlpack
    import jax.numpy as jnp

    def finish(arr: Any) -> Any:
        return jax.dlpack.from_dlpack(arr) if like.on_device else jnp.asarray(arr)

    return holder, finish


def _copy(dst: ArrayView, src: ArrayView, stream: StreamRef | None) -> None:
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


def _watched(ctx: Context, label: Any, action: Any, *args: Any) -> None:
    """``action(*args)``, watched (``label()`` names it) when a watchdog is set: creating the backend
    (first call) is collective too."""
    if ctx.watchdog.on:
        with ctx.watchdog.watch(label()):
            action(*args)
    else:
        action(*args)


def broadcast(x: Any, root: int = 0, *, comm: Any = None, backend: str = "auto", stream: Any = None) -> Any:
    """Copy rank ``root``'s ``x`` into ``x`` on every rank of ``comm`` (in place) and return ``x``.

    JAX arrays are immutable: a new JAX array is returned. backend and stream as for ``allreduce``
    ("auto", "nccl", "cuda-aware", "host" or "cpu"; ipc does not broadcast).

    Collective: every rank passes the same shape, dtype, placement, root and backend; a mismatch
    raises MismatchError on every rank, and no array is changed.
    """
    refuse_if_bound("broadcast", comm)  # no form over several devices per process: refused on every rank
    ctx = Context.get(comm)
    ctx.enter("broadcast")  # the one-thread rule
    try:
        ctx.wait_async()  # calls queued by allreduce_async on this communicator reach MPI first
        try:
            root_ = check_root(root, ctx.size)
            xv, choice, signature = _validate(ctx, x, backend, "broadcast", root_)
            ref = resolve_stream(stream, xv.framework, xv.device) if xv.on_device else None
        except Exception as exc:  # any failure here must reach the other ranks
            announce_rejection(ctx, exc)
            raise
        _check(ctx, signature, choice.backend, lambda: f"broadcast of {xv.size} {xv.dtype.name} from rank {root_}")
        result, finish, target = x, None, xv
        if xv.readonly:  # JAX: broadcast into a new array
            result, finish = _new_array(xv, xv.shape)
            target = as_view(result, name="out")
            if xv.on_device:
                ctx.activate_gpu()
            _copy(target, xv, ref)
        if xv.size and ctx.size > 1:
            label = lambda: f"broadcast({choice.backend}, {xv.dtype.name} x {xv.size}, root={root_})"  # noqa: E731
            _watched(ctx, label, _run, ctx, choice.backend, "broadcast", xv.on_device, target, root_, ref)
        return finish(result) if finish is not None else result
    finally:
        ctx.leave()


def allgather(x: Any, *, comm: Any = None, backend: str = "auto", stream: Any = None) -> Any:
    """Concatenate every rank's ``x`` along the first dimension, in rank order, into a new array of
    ``x``'s framework, dtype and placement (NumPy, CuPy, PyTorch; JAX gets a JAX array).

    The first dimension may differ between ranks (zero rows too); the other dimensions, the dtype,
    the placement and the backend must match: else MismatchError on every rank. backend and stream
    as for ``allreduce`` (ipc does not allgather). The result is ready in the stream's order.
    """
    refuse_if_bound("allgather", comm)  # no form over several devices per process: refused on every rank
    ctx = Context.get(comm)
    ctx.enter("allgather")  # the one-thread rule
    try:
        ctx.wait_async()
        try:
            xv, choice, signature = _validate(ctx, x, backend, "allgather")
            ref = resolve_stream(stream, xv.framework, xv.device) if xv.on_device else None
        except Exception as exc:
            announce_rejection(ctx, exc)
            raise
        trailing = xv.shape[1:]
        rows = _rows(ctx, signature, choice.backend, lambda: f"allgather of {xv.shape[0]} x {list(trailing)} "
                                                             f"{xv.dtype.name}")  # fmt: skip
        result, finish = _new_array(xv, (sum(rows), *trailing))
        out = as_view(result, name="out")
        if xv.on_device:
            ctx.activate_gpu()
        if ctx.size == 1:
            _copy(out, xv, ref)
        elif out.nbytes:
            label = lambda: f"allgather({choice.backend}, {xv.dtype.name}, rows {rows})"  # noqa: E731
            _watched(ctx, label, _run, ctx, choice.backend, "allgather", xv.on_device, xv, out, rows, ref)
        return finish(result) if finish is not None else result
    finally:
        ctx.leave()


def _run(ctx: Context, backend: str, collective: str, on_device: bool, *args: Any) -> None:
    """The backend's ``collective(*args)``; the backend is made on its first call (collective)."""
    instance = ctx.backend(backend)
    if on_device:
        ctx.activate_gpu()
    getattr(instance, collective)(*args)


def _gather_rows(ctx: Context, mine: int) -> list[int]:
    """Every rank's first dimension (collective; one MPI_Allgather of an int64)."""
    from mpigpu.core._mpi import MPI

    everyone = np.empty(ctx.size, np.int64)
    ctx.comm.Allgather([np.array([mine], np.int64), MPI().INT64_T], [everyone, MPI().INT64_T])
    return [int(r) for r in everyone]
