"""The raw anchors the benchmark sets beside every mpigpu backend: the same reduction done the
plain way a user would write it without mpigpu, so each backend's figure comes with the figure it
has to beat.

nccl-raw      NCCL through cupy.cuda.nccl: one communicator from a unique id broadcast by rank 0,
              ``allReduce`` on the benchmark's stream (pairs with the nccl and ipc backends)
seed-staging  the seed sample's host staging: ``.get()`` (pageable), ``comm.Allreduce`` on the NumPy
              copy, ``cupy.asarray`` back (pairs with the host backend on GPU buffers)
mpi-device    ``comm.Allreduce`` on device buffers after synchronising the stream, only where the MPI
              library is CUDA-aware (pairs with the cuda-aware backend)
mpi-host      ``comm.Allreduce`` on NumPy arrays (pairs with the cpu and host backends on host arrays)

The MPI anchors reduce with the MPI library's own types and ops; ``avg`` is a sum followed by the
division mpigpu defines (IEEE for floats, truncating for integers). MPI has no 16-bit float type,
so float16 and bfloat16 have no MPI anchor.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

from mpigpu.ops import Op, finish_avg

if TYPE_CHECKING:
    from mpigpu.arrays import ArrayView
    from mpigpu.context import Context
    from mpigpu.dtypes import DType

__all__ = ["ANCHORS", "Anchor", "anchor_for"]

# (placement, mpigpu backend) -> the anchor it is reported beside
_PAIRS: dict[tuple[str, str], str] = {
    ("device", "nccl"): "nccl-raw",
    ("device", "ipc"): "nccl-raw",
    ("device", "cuda-aware"): "mpi-device",
    ("device", "host"): "seed-staging",
    ("host", "cpu"): "mpi-host",
    ("host", "host"): "mpi-host",
}


def anchor_for(placement: str, backend: str) -> str | None:
    """The anchor a backend is compared with on ``placement`` ("device" or "host")."""
    return _PAIRS.get((placement, backend))


class Anchor(abc.ABC):
    """One raw reduction. Created collectively once per run; ``allreduce`` is called by every rank."""

    name: ClassVar[str]
    placement: ClassVar[str]  # "device" (GPU buffers) or "host" (NumPy arrays)
    description: ClassVar[str]

    def __init__(self, ctx: Context, stream: Any) -> None:
        self.ctx = ctx
        self.stream = stream  # a CuPy stream for device anchors, None for host ones

    @classmethod
    @abc.abstractmethod
    def unavailable(cls, ctx: Context) -> str | None:
        """None if this anchor can run on this communicator, else why not (the same on every rank)."""

    @classmethod
    def supports(cls, dtype: DType, op: Op) -> str | None:
        """None if the anchor reduces ``dtype`` with ``op``, else why not."""
        if dtype.is_half:
            return f"MPI has no {dtype.name} datatype"
        return None

    @abc.abstractmethod
    def allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> None:
        """Reduce ``x`` over all ranks into ``out`` (``out`` may be ``x``)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the anchor holds (idempotent)."""


def _mpi_args(x: ArrayView, out: ArrayView, op: Op, xbuf: Any, outbuf: Any) -> tuple[Any, Any, Any]:
    """(sendbuf, recvbuf, op) for comm.Allreduce, in place when ``out`` is ``x``."""
    from mpigpu._mpi import MPI
    from mpigpu.backends.cpu import mpi_datatype, mpi_op

    kind = mpi_datatype(x.dtype.name)
    send = MPI().IN_PLACE if x.same_memory(out) else [xbuf, kind]
    return send, [outbuf, kind], mpi_op(op)


def _device_bytes(view: ArrayView) -> Any:
    """A CuPy uint8 array over the view's bytes (the benchmark's buffers are CuPy allocations)."""
    from mpigpu._cuda import cupy

    cp = cupy()
    memory = cp.cuda.UnownedMemory(view.ptr, view.nbytes, view.obj, view.device)
    return cp.ndarray((view.nbytes,), cp.uint8, cp.cuda.MemoryPointer(memory, 0))


class MpiHost(Anchor):
    name: ClassVar[str] = "mpi-host"
    placement: ClassVar[str] = "host"
    description: ClassVar[str] = "comm.Allreduce on NumPy arrays"

    @classmethod
    def unavailable(cls, ctx: Context) -> str | None:
        return None

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> None:
        assert x.host is not None and out.host is not None
        send, recv, mop = _mpi_args(x, out, op, x.host, out.host)
        self.ctx.comm.Allreduce(send, recv, mop)
        if op is Op.AVG:
            finish_avg(out.host, self.ctx.size, out.dtype, out.host)


class SeedStaging(Anchor):
    name: ClassVar[str] = "seed-staging"
    placement: ClassVar[str] = "device"
    description: ClassVar[str] = "the seed sample: cupy .get() -> comm.Allreduce -> cupy.asarray"

    @classmethod
    def unavailable(cls, ctx: Context) -> str | None:
        return None if ctx.all_have_gpus else "needs a GPU on every rank"

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> None:
        from mpigpu._cuda import cupy

        cp = cupy()
        with self.stream:
            host = _device_bytes(x).get()  # pageable copy; waits for the stream
            values = host.view(x.dtype.np)
            send, recv, mop = _mpi_args(x, x, op, values, values)  # in place on the host copy
            self.ctx.comm.Allreduce(send, recv, mop)
            if op is Op.AVG:
                finish_avg(values, self.ctx.size, x.dtype, values)
            result = cp.asarray(host)
            cp.cuda.runtime.memcpyAsync(
                out.ptr, int(result.data.ptr), out.nbytes, cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr
            )


class MpiDevice(Anchor):
    name: ClassVar[str] = "mpi-device"
    placement: ClassVar[str] = "device"
    description: ClassVar[str] = "comm.Allreduce on device buffers (CUDA-aware MPI)"

    @classmethod
    def unavailable(cls, ctx: Context) -> str | None:
        if not ctx.all_have_gpus:
            return "needs a GPU on every rank"
        if not ctx.cuda_aware.aware:
            return f"the MPI library is not CUDA-aware ({ctx.cuda_aware.rule})"
        return None

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> None:
        from mpigpu._cuda import cupy

        cp = cupy()
        self.stream.synchronize()  # MPI must not read x before the work that wrote it is done
        xbuf, outbuf = _device_bytes(x), _device_bytes(out)
        send, recv, mop = _mpi_args(x, out, op, xbuf, outbuf)
        self.ctx.comm.Allreduce(send, recv, mop)
        if op is Op.AVG:
            values = outbuf.view(out.dtype.np)
            n = self.ctx.size
            with self.stream:
                if out.dtype.is_float:
                    values /= out.dtype.np.type(n)
                else:  # C division truncates toward zero: an exact multiple of n, then floor-divide
                    values[...] = (values - cp.fmod(values, n)) // n


class NcclRaw(Anchor):
    name: ClassVar[str] = "nccl-raw"
    placement: ClassVar[str] = "device"
    description: ClassVar[str] = "NCCL called directly through cupy.cuda.nccl"

    def __init__(self, ctx: Context, stream: Any) -> None:
        super().__init__(ctx, stream)
        from cupy.cuda import nccl

        ctx.activate_gpu()
        unique_id = nccl.get_unique_id() if ctx.rank == 0 else None
        unique_id = ctx.comm.bcast(unique_id, root=0)
        self._comm: Any = nccl.NcclCommunicator(ctx.size, unique_id, ctx.rank)

    @classmethod
    def unavailable(cls, ctx: Context) -> str | None:
        if not ctx.all_have_gpus:
            return "needs a GPU on every rank"
        if not ctx.nccl.available:
            return f"NCCL is not available: {ctx.nccl.reason}"
        return None

    @classmethod
    def supports(cls, dtype: DType, op: Op) -> str | None:
        return None if dtype.nccl is not None else f"NCCL has no {dtype.name} type"

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> None:
        assert x.dtype.nccl is not None
        self._comm.allReduce(x.ptr, out.ptr, x.size, x.dtype.nccl, op.nccl, self.stream.ptr)

    def close(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None


ANCHORS: dict[str, type[Anchor]] = {cls.name: cls for cls in (NcclRaw, MpiDevice, SeedStaging, MpiHost)}
