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

from mpigpu._cuda import StreamRef, resolve_stream
from mpigpu.arrays import ArrayView, as_view
from mpigpu.backends import backend_code
from mpigpu.check import COLLECTIVES, Signature, announce_rejection, check_signature
from mpigpu.context import Context
from mpigpu.errors import InvalidArgument
from mpigpu.ops import Op
from mpigpu.plan import Choice, choose_cached

__all__ = ["allgather", "broadcast", "check_root"]

_BROADCAST, _ALLGATHER = COLLECTIVES.index("broadcast"), COLLECTIVES.index("allgather")


def check_root(root: Any, size: int) -> int:
    """``root`` as a rank of a communicator of ``size``, or InvalidArgument."""
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise InvalidArgument(f"root must be an integer rank, not {type(root).__name__}")
    if not 0 <= int(root) < size:
        raise InvalidArgument(f"root={int(root)} is not a rank of this communicator (0 to {size - 1})")
    return int(root)


def _validate(ctx: Context, x: Any, backend: Any, collective: str) -> tuple[ArrayView, Choice]:
    """This rank's array and backend (local): placement on the rank's GPU, a usable backend."""
    if not isinstance(backend, str):
        raise InvalidArgument(f"backend must be a string such as 'auto' or 'nccl', not {type(backend).__name__}")
    xv = as_view(x, name="x")
    ctx.require_own_gpu(xv)
    return xv, choose_cached(ctx, xv, Op.SUM, backend, collective)


def _check(ctx: Context, collective: str, signature: Signature, backend: str, label: str) -> None:
    """The cross-rank check (collective): MismatchError on every rank unless all agree."""
    if ctx.settings.check:
        with ctx.watchdog.watch(f"{label} (cross-rank argument check)"):  # a rank that never arrives
            check_signature(ctx.comm, signature, collective, backend_name=backend)


def _new_array(like: ArrayView, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """An uninitialised array of ``shape`` in ``like``'s dtype, place and framework: (array, finish),
    where ``finish`` turns it into the caller's type (JAX) or is None."""
    if like.framework == "torch":
        import torch

        return torch.empty(shape, dtype=like.obj.dtype, device=like.obj.device), None
    if like.on_device:
        from mpigpu._cuda import cupy, set_device

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
    from mpigpu._cuda import cupy

    runtime = cupy().cuda.runtime
    handle = 0 if stream is None else stream.handle
    runtime.memcpyAsync(dst.ptr, src.ptr, src.nbytes, runtime.memcpyDeviceToDevice, handle)


def _watched(ctx: Context, label: str, action: Any) -> None:
    with ctx.watchdog.watch(label):  # creating the backend (first call) is collective too: watch it
        action()


def broadcast(x: Any, root: int = 0, *, comm: Any = None, backend: str = "auto", stream: Any = None) -> Any:
    """Copy rank ``root``'s ``x`` into ``x`` on every rank of ``comm`` (in place) and return ``x``.

    JAX arrays are immutable: a new JAX array is returned. backend and stream as for ``allreduce``
    ("auto", "nccl", "cuda-aware", "host" or "cpu"; ipc does not broadcast).

    Collective: every rank passes the same shape, dtype, placement, root and backend; a mismatch
    raises MismatchError on every rank, and no array is changed.
    """
    ctx = Context.get(comm)
    ctx.enter("broadcast")  # the one-thread rule
    try:
        ctx.wait_async()  # calls queued by allreduce_async on this communicator reach MPI first
        try:
            root_ = check_root(root, ctx.size)
            xv, choice = _validate(ctx, x, backend, "broadcast")
            if xv.readonly and xv.framework != "jax":
                raise InvalidArgument(
                    "x is read-only, so it cannot receive the broadcast in place: pass a writable array"
                )
            ref = resolve_stream(stream, xv.framework, xv.device) if xv.on_device else None
        except Exception as exc:  # any failure here must reach the other ranks
            announce_rejection(ctx, exc)
            raise
        signature = Signature(
            count=xv.size, dtype=xv.dtype.code, op=0, backend=backend_code(choice.backend),
            placement=int(xv.on_device), shape=xv.shape, collective=_BROADCAST, root=root_,
        )  # fmt: skip
        label = f"broadcast of {xv.size} {xv.dtype.name} from rank {root_}"
        _check(ctx, "broadcast", signature, choice.backend, label)
        result, finish, target = x, None, xv
        if xv.readonly:  # JAX: broadcast into a new array
            result, finish = _new_array(xv, xv.shape)
            target = as_view(result, name="out")
            if xv.on_device:
                ctx.activate_gpu()
            _copy(target, xv, ref)
        if xv.size and ctx.size > 1:

            def run() -> None:
                instance = ctx.backend(choice.backend)
                if xv.on_device:
                    ctx.activate_gpu()
                instance.broadcast(target, root_, ref)  # type: ignore[attr-defined]

            _watched(ctx, f"broadcast({choice.backend}, {xv.dtype.name} x {xv.size}, root={root_})", run)
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
    ctx = Context.get(comm)
    ctx.enter("allgather")  # the one-thread rule
    try:
        ctx.wait_async()
        try:
            xv, choice = _validate(ctx, x, backend, "allgather")
            if not xv.shape:
                raise InvalidArgument(
                    "allgather concatenates along the first dimension, but x has none (a 0-d array): pass x.reshape(1)"
                )
            ref = resolve_stream(stream, xv.framework, xv.device) if xv.on_device else None
        except Exception as exc:
            announce_rejection(ctx, exc)
            raise
        trailing = xv.shape[1:]
        signature = Signature(
            count=math.prod(trailing), dtype=xv.dtype.code, op=0, backend=backend_code(choice.backend),
            placement=int(xv.on_device), shape=trailing, collective=_ALLGATHER,
        )  # fmt: skip
        label = f"allgather of {xv.shape[0]} x {list(trailing)} {xv.dtype.name}"
        _check(ctx, "allgather", signature, choice.backend, label)
        rows = _gather_rows(ctx, xv.shape[0])
        result, finish = _new_array(xv, (sum(rows), *trailing))
        out = as_view(result, name="out")
        if xv.on_device:
            ctx.activate_gpu()
        if ctx.size == 1:
            _copy(out, xv, ref)
        elif out.nbytes:

            def run() -> None:
                instance = ctx.backend(choice.backend)
                if xv.on_device:
                    ctx.activate_gpu()
                instance.allgather(xv, out, rows, ref)  # type: ignore[attr-defined]

            _watched(ctx, f"allgather({choice.backend}, {xv.dtype.name}, rows {rows})", run)
        return finish(result) if finish is not None else result
    finally:
        ctx.leave()


def _gather_rows(ctx: Context, mine: int) -> list[int]:
    """Every rank's first dimension (collective; one MPI_Allgather of an int64)."""
    from mpigpu._mpi import MPI

    everyone = np.empty(ctx.size, np.int64)
    ctx.comm.Allgather([np.array([mine], np.int64), MPI().INT64_T], [everyone, MPI().INT64_T])
    return [int(r) for r in everyone]
