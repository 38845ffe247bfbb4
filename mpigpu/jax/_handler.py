"""What runs inside XLA when a compiled program reaches an mpigpu collective: the FFI handler.

It runs on one of XLA's threads, never the program's, with the buffers XLA allocated and (on GPUs)
the CUDA stream XLA runs the program on. It calls the backend directly (mpigpu.allreduce's public
path is for the program's own thread): the arguments were validated and agreed across ranks when
the program was lowered, so the call carries no check.

Stream order: GPU backends enqueue on XLA's stream (nccl, ipc) or wait on it before MPI reads the
buffer and return with the result written (host, cuda-aware), as for any caller's stream.
"""

from __future__ import annotations

import threading

from mpigpu.backends import BACKEND_NAMES
from mpigpu.core._cuda import StreamRef
from mpigpu.core.arrays import ArrayView, raw_view
from mpigpu.core.ops import Op
from mpigpu.jax._comms import ready_channel
from mpigpu.jax._devices import DEVICES_ATTRIBUTE
from mpigpu.jax._devices import execute as on_devices
from mpigpu.jax._ffi import Buffer, Call, HandlerError
from mpigpu.runtime.context import Context

__all__ = ["ATTRIBUTE", "COLLECTIVES", "OPS", "encode", "execute"]

OPS: dict[int, Op] = {op.code: op for op in Op}
COLLECTIVES = ("allreduce", "broadcast", "allgather")  # what the call's attribute can name
_lock = threading.Lock()  # XLA may run two programs' calls at once; one collective at a time per process
ATTRIBUTE = "mpigpu"  # the call's one attribute: collective, op, root, backend, placement, communicator


def encode(op: Op, backend: str, gpu: bool, comm: int, collective: str = "allreduce", root: int = 0) -> int:
    """The value of the call's attribute. One attribute, not six: the handler reads each attribute through
    several ctypes calls, on every call of every step. ``root``: broadcast's root (below 2**24)."""
    return (op.code | BACKEND_NAMES.index(backend) << 8 | int(gpu) << 16 | COLLECTIVES.index(collective) << 17
            | root << 19 | comm << 43)  # fmt: skip


def _decode(value: int) -> tuple[Op, str, bool, int, str, int]:
    return (OPS[value & 0xFF], BACKEND_NAMES[value >> 8 & 0xFF], bool(value >> 16 & 1), value >> 43,
            COLLECTIVES[value >> 17 & 3], value >> 19 & 0xFFFFFF)  # fmt: skip


def execute(call: Call) -> None:
    """The EXECUTE stage of an mpigpu call: operands (token, x), results (token, out)."""
    attrs = call.attrs
    try:
        op, backend, on_gpu, key, collective, root = _decode(attrs[ATTRIBUTE])
    except (KeyError, IndexError) as exc:
        raise HandlerError(f"an mpigpu call was compiled with unknown attributes {attrs}: {exc}") from None
    data = [b for b in call.args if b.dtype != "token"]
    outs = [b for b in call.rets if b.dtype != "token"]
    if len(data) != 1 or len(outs) != 1 or data[0].dtype != outs[0].dtype:
        raise HandlerError(f"mpigpu_{collective} expects one array in and one out of its dtype: {data} -> {outs}")
    ctx = ready_channel(key).ctx
    if attrs.get(DEVICES_ATTRIBUTE):  # once per device inside shard_map: the devices meet (never under _lock)
        on_devices(call, ctx, data[0], outs[0], op, backend, on_gpu)
        return
    with _lock:
        _run(ctx, collective, data[0], outs[0], op, root, backend, StreamRef(call.stream()) if on_gpu else None)


def _run(ctx: Context, collective: str, x: Buffer, out: Buffer, op: Op, root: int, backend: str,
         stream: StreamRef | None) -> None:  # fmt: skip
    device = None
    if stream is not None:
        if ctx.gpu is None:
            raise HandlerError("a GPU array reached mpigpu.jax on a rank with no GPU bound")
        device = ctx.gpu.index
        ctx.activate_gpu()  # this XLA thread may not have used the GPU through CuPy or cuda.core yet
        # XLA's buffers are on it: the lowering refused a program placed on another GPU (check_program_device)
    xv = raw_view(x.ptr, x.shape, x.dtype, device, readonly=True)
    ov = raw_view(out.ptr, out.shape, out.dtype, device, readonly=False)
    if xv.size == 0:
        return
    if ctx.size == 1:  # every collective's result is the input (and NCCL 2.28's one-rank ncclAvg misses elements)
        _copy(xv, ov, stream)
        return
    instance = ctx.backend(backend)  # created on first use: collective, in this thread's (token) order
    if collective == "allreduce":
        action, args, what = instance.allreduce, (xv, ov, op, stream), f"op={op.value}"
    elif collective == "broadcast":  # in place, on XLA's output buffer
        _copy(xv, ov, stream)
        action, args, what = instance.broadcast, (ov, root, stream), f"root={root}"
    else:  # allgather: every rank the same rows (static shapes)
        action, args, what = instance.allgather, (xv, ov, [xv.shape[0]] * ctx.size, stream), "equal rows"
    if ctx.watchdog.on:
        with ctx.watchdog.watch(f"mpigpu.jax {collective}({backend}, {xv.dtype.name} x {xv.size}, {what})"):
            action(*args)
    else:
        action(*args)


def _copy(x: ArrayView, out: ArrayView, stream: StreamRef | None) -> None:
    """out = x, in stream order on GPUs."""
    if stream is None:
        assert x.host is not None and out.host is not None
        out.host[...] = x.host
        return
    from mpigpu.core._cuda import cupy

    runtime = cupy().cuda.runtime
    runtime.memcpyAsync(out.ptr, x.ptr, x.nbytes, runtime.memcpyDeviceToDevice, stream.handle)
