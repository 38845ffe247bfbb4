"""The device side of mpigpu's semantics for transports that reduce whole buffers (nccl, cuda-aware):
float min/max as order-preserving integer keys, integer avg as 64-bit parts summed exactly
(kernels/arith.cu; the same algebra as mpigpu.core.ops). The caller's input is never written: keys and
parts live in ``out`` where they fit (float32/float64 keys) or in a reused scratch buffer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpigpu.core.ops import Op

if TYPE_CHECKING:
    from mpigpu.core._cuda import StreamRef
    from mpigpu.core.arrays import ArrayView
    from mpigpu.core.dtypes import DType

__all__ = ["DeviceScratch", "by_keys_or_parts", "needs_keys_or_parts", "reduce_scatter_by_allreduce"]


class DeviceScratch:
    """A device buffer reused across calls, safe across streams: a call's stream first waits for the
    event the last user recorded, and growth waits for it on the host before the old buffer goes."""

    def __init__(self) -> None:
        self._buf: Any = None
        self._free: Any = None  # event: the last call is done with the buffer

    def take(self, nbytes: int, stream: int) -> int:
        from mpigpu.core._cuda import cupy

        rt = cupy().cuda.runtime
        if self._free is None:
            self._free = rt.eventCreateWithFlags(rt.eventDisableTiming)
        else:
            rt.streamWaitEvent(stream, self._free, 0)
        if self._buf is None or self._buf.nbytes < nbytes:
            rt.eventSynchronize(self._free)  # the old buffer may still be read by an earlier call
            self._buf = None
            self._buf = cupy().empty(max(nbytes, 256), dtype="uint8")
        return int(self._buf.data.ptr)

    def give_back(self, stream: int) -> None:
        from mpigpu.core._cuda import cupy

        cupy().cuda.runtime.eventRecord(self._free, stream)

    def close(self) -> None:
        if self._free is not None:
            from mpigpu.core._cuda import cupy

            cupy().cuda.runtime.eventDestroy(self._free)
            self._free = None
        self._buf = None


def reduce_scatter_by_allreduce(
    allreduce: Callable[[ArrayView, ArrayView, Op, StreamRef], None],
    scratch: DeviceScratch,
    x: ArrayView,
    out: ArrayView,
    op: Op,
    rows: list[int],
    rank: int,
    stream: StreamRef | None,
) -> None:
    """reduce_scatter as the backend's ``allreduce`` into a scratch buffer, then ``rank``'s rows into
    ``out``, on the stream: the rows are allreduce's bits."""
    from mpigpu.backends.mpi_moves import byte_counts, row_bytes
    from mpigpu.core._cuda import StreamRef, cupy
    from mpigpu.core.arrays import ArrayView

    stream = stream or StreamRef(0)
    rt = cupy().cuda.runtime
    full = scratch.take(x.nbytes, stream.handle)
    allreduce(x, ArrayView(None, full, x.shape, x.dtype, x.device, False, "cupy"), op, stream)
    counts, displs = byte_counts(rows, row_bytes(x.shape, x.dtype.itemsize))
    if counts[rank]:
        rt.memcpyAsync(out.ptr, full + displs[rank], counts[rank], rt.memcpyDeviceToDevice, stream.handle)
    scratch.give_back(stream.handle)


def needs_keys_or_parts(dtype: DType, op: Op) -> bool:
    """Whether a call must go through keys (float min/max) or parts (integer avg) rather than
    straight to the transport's own reduction."""
    return (dtype.is_float and op in (Op.MIN, Op.MAX)) or (op is Op.AVG and not dtype.is_float)


def by_keys_or_parts(
    module: Callable[[], Any],
    scratch: DeviceScratch,
    x: ArrayView,
    out: ArrayView,
    op: Op,
    nranks: int,
    stream: StreamRef,
    reduce: Callable[[int, int, str, Op], None],
) -> bool:
    """Float min/max and integer avg through keys or parts; False (nothing done) for the other calls.
    ``module()`` gives the compiled arith.cu (called only when needed).

    ``reduce(ptr, count, kind, op)`` reduces ``count`` unsigned integers of ``kind`` ("uint32" or
    "uint64") in place at ``ptr`` across ranks, in stream order, with MIN, MAX or SUM (``op``)."""
    from mpigpu.kernels.compile import i32, i64, launch

    dtype, count = x.dtype, x.size
    if not needs_keys_or_parts(dtype, op):
        return False
    if dtype.is_float:
        kernels = module()
        key_bytes = 8 if dtype.itemsize == 8 else 4
        in_out = dtype.itemsize == key_bytes  # float32/float64: the keys fit in out itself
        keys = out.ptr if in_out else scratch.take(count * key_bytes, stream.handle)
        launch(stream, kernels.kernel(f"to_key_{dtype.name}"), count, x.ptr, keys, i64(count), i32(op.index))
        reduce(keys, count, f"uint{8 * key_bytes}", op)
        launch(stream, kernels.kernel(f"from_key_{dtype.name}"), count, keys, out.ptr, i64(count))
        if not in_out:
            scratch.give_back(stream.handle)
        return True
    kernels = module()
    parts = scratch.take(2 * count * 8, stream.handle)
    launch(stream, kernels.kernel(f"iavg_parts_{dtype.name}"), count, x.ptr, parts, i64(count), i32(nranks))
    reduce(parts, 2 * count, "uint64", Op.SUM)
    launch(stream, kernels.kernel(f"iavg_join_{dtype.name}"), count, parts, out.ptr, i64(count), i32(nranks))
    scratch.give_back(stream.handle)
    return True
