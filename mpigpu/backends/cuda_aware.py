"""Device pointers straight into a CUDA-aware MPI_Allreduce.

MPI reads device memory outside any stream order, so the caller's stream is synchronised first
(the producer is done before MPI reads). MPI has no 16-bit float types: float16/bfloat16 are widened
to a reused float32 device buffer, reduced, then rounded once on the way back. Averaging divides on
the device afterwards. Float min/max travel as order-preserving integer keys and integer avg as
64-bit parts summed exactly (device_scratch.py), and a float sum or product has its NaNs made the
canonical NaN (MPI's operand order may differ per rank): mpigpu's semantics, the same bits on every
rank. Runs only where CUDA-awareness was detected (mpigpu.job.detect) or forced with
MPIGPU_CUDA_AWARE=1 and not contradicted: a device pointer never reaches an MPI that cannot take it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from mpigpu.backends.base import Availability, Backend, CommContext
from mpigpu.backends.device_scratch import DeviceScratch, by_keys_or_parts, reduce_scatter_by_allreduce
from mpigpu.backends.mpi_moves import allgather_bytes, alltoall_bytes, broadcast_bytes, row_bytes
from mpigpu.core._mpi import MPI
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op

if TYPE_CHECKING:
    from mpigpu.core._cuda import StreamRef
    from mpigpu.core.arrays import ArrayView

__all__ = ["CudaAwareBackend"]


class CudaAwareBackend(Backend):
    """MPI_Allreduce on device buffers."""

    name: ClassVar[str] = "cuda-aware"
    host_arrays: ClassVar[bool] = False
    device_arrays: ClassVar[bool] = True
    anchors: ClassVar[Mapping[str, str]] = {"device": "mpi-device"}
    collectives: ClassVar[frozenset[str]] = frozenset(
        {"allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"}
    )

    @classmethod
    def probe(cls, ctx: CommContext) -> Availability:
        aware = ctx.cuda_aware
        if not ctx.all_have_gpus:
            return Availability(False, "not every rank has a GPU")
        if not aware.aware:
            return Availability(
                False,
                f"{ctx.mpi_lib.version} is not CUDA-aware ({aware.rule}); device pointers passed to it would "
                "crash the process. Use backend 'nccl' or 'host', or run under a CUDA-aware MPI.",
            )
        return Availability(True, f"{ctx.mpi_lib.name}: {aware.rule}")

    def __init__(self, ctx: CommContext) -> None:
        super().__init__(ctx)
        self._wide: Any = None  # reused float32 device buffer for the half types
        self._wide_free: Any = None  # event: the last call's narrowing finished reading _wide
        self._scratch = DeviceScratch()  # keys of the half types, parts of integer averages
        self._rows = DeviceScratch()  # reduce_scatter's whole result

    def _kernels(self) -> Any:
        from mpigpu.kernels.compile import load_module

        assert self.ctx.gpu is not None
        major, minor = self.ctx.gpu.compute_capability
        return load_module("arith.cu", f"{major}{minor}")

    def _wide_buffer(self, count: int) -> Any:
        from mpigpu.core._cuda import cupy

        if self._wide is None or self._wide.size < count:
            self._wide = cupy().empty(count, dtype="float32")
        return self._wide

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None) -> None:
        from mpigpu.core._cuda import StreamRef, cupy
        from mpigpu.kernels.compile import i32, i64, launch

        mpi = MPI()
        stream = stream or StreamRef(0)
        runtime = cupy().cuda.runtime
        n, count = self.ctx.size, x.size

        def reduce(ptr: int, items: int, kind: str, how: Op) -> None:
            runtime.streamSynchronize(stream.handle)  # MPI must not read before the kernel wrote
            buf = mpi.buffer.fromaddress(ptr, items * (8 if kind == "uint64" else 4))
            self.ctx.comm.Allreduce(mpi.IN_PLACE, [buf, items, DTYPES[kind].mpi], how.mpi)

        if by_keys_or_parts(self._kernels, self._scratch, x, out, op, n, stream, reduce):
            return
        if x.dtype.is_half:
            wide = self._wide_buffer(count)
            kernels = self._kernels()
            if self._wide_free is not None:  # the previous call may be on another stream
                runtime.streamWaitEvent(stream.handle, self._wide_free, 0)
            else:
                self._wide_free = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
            launch(stream, kernels.kernel(f"widen_{x.dtype.name}"), count, x.ptr, int(wide.data.ptr), i64(count))
            runtime.streamSynchronize(stream.handle)  # MPI must not read before the widening is done
            buf = mpi.buffer.fromaddress(int(wide.data.ptr), count * 4)
            self.ctx.comm.Allreduce(mpi.IN_PLACE, [buf, count, mpi.FLOAT], op.mpi)
            launch(
                stream, kernels.kernel(f"narrow_{x.dtype.name}"), count,
                int(wide.data.ptr), out.ptr, i64(count), i32(op.index), i32(n),
            )  # fmt: skip
            runtime.eventRecord(self._wide_free, stream.handle)
            return
        kind = x.dtype.mpi
        runtime.streamSynchronize(stream.handle)  # the producer of x is done before MPI reads it
        recv = mpi.buffer.fromaddress(out.ptr, out.nbytes)
        if x.same_memory(out):
            self.ctx.comm.Allreduce(mpi.IN_PLACE, [recv, count, kind], op.mpi)
        else:
            send = mpi.buffer.fromaddress(x.ptr, x.nbytes, readonly=True)
            self.ctx.comm.Allreduce([send, count, kind], [recv, count, kind], op.mpi)
        if x.dtype.is_float:  # avg: divide; every float op: NaN made canonical (the same bits everywhere)
            name = "finish_avg" if op is Op.AVG else "canonical_nan"
            kernel = self._kernels().kernel(f"{name}_{x.dtype.name}")
            launch(stream, kernel, count, out.ptr, i64(count), *((i32(n),) if op is Op.AVG else ()))

    def broadcast(self, x: ArrayView, root: int, stream: StreamRef | None) -> None:
        """MPI_Bcast on the device pointer, after the caller's stream (MPI reads outside stream order)."""
        from mpigpu.core._cuda import cupy

        cupy().cuda.runtime.streamSynchronize(0 if stream is None else stream.handle)
        mpi = MPI()
        broadcast_bytes(self.ctx.comm, mpi.buffer.fromaddress(x.ptr, x.nbytes), x.nbytes, root)

    def allgather(self, x: ArrayView, out: ArrayView, rows: list[int], stream: StreamRef | None) -> None:
        """MPI_Allgatherv on device pointers, after the caller's stream. ``out`` is new, written by MPI
        before this returns: later work on the stream sees it."""
        from mpigpu.core._cuda import cupy

        cupy().cuda.runtime.streamSynchronize(0 if stream is None else stream.handle)
        mpi = MPI()
        send = mpi.buffer.fromaddress(x.ptr, x.nbytes, readonly=True) if x.nbytes else bytearray(0)
        recv = mpi.buffer.fromaddress(out.ptr, out.nbytes)
        allgather_bytes(self.ctx.comm, send, recv, rows, out.nbytes // sum(rows))

    def reduce_scatter(self, x: ArrayView, out: ArrayView, op: Op, rows: list[int], stream: StreamRef | None) -> None:
        """This backend's allreduce into a scratch buffer, then this rank's rows, on the stream: not
        MPI_Reduce_scatter, whose operand order is its own per rank (see the cpu backend)."""
        reduce_scatter_by_allreduce(self.allreduce, self._rows, x, out, op, rows, self.ctx.rank, stream)

    def alltoall(
        self, x: ArrayView, out: ArrayView, send_rows: list[int], recv_rows: list[int], stream: StreamRef | None
    ) -> None:
        """MPI_Alltoallv on device pointers, after the caller's stream; ``out`` is written when it returns."""
        from mpigpu.core._cuda import cupy

        cupy().cuda.runtime.streamSynchronize(0 if stream is None else stream.handle)
        mpi = MPI()
        send = mpi.buffer.fromaddress(x.ptr, x.nbytes, readonly=True) if x.nbytes else bytearray(0)
        recv = mpi.buffer.fromaddress(out.ptr, out.nbytes) if out.nbytes else bytearray(0)
        alltoall_bytes(self.ctx.comm, send, recv, send_rows, recv_rows, row_bytes(x.shape, x.dtype.itemsize))

    def close(self) -> None:
        if self._wide_free is not None:
            from mpigpu.core._cuda import cupy

            cupy().cuda.runtime.eventDestroy(self._wide_free)
            self._wide_free = None
        self._wide = None
        self._scratch.close()
        self._rows.close()

    def describe(self) -> dict[str, Any]:
        return {"mpi": self.ctx.mpi_lib.version, "rule": self.ctx.cuda_aware.rule}
