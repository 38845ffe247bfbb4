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
torch-nccl    ``torch.distributed.all_reduce`` with the NCCL backend, on torch CUDA tensors over the
              benchmark's GPU buffers (where torch is installed; shown beside nccl-raw)
torch-gloo    ``torch.distributed.all_reduce`` with the gloo backend, on torch CPU tensors over the
              benchmark's host arrays (where torch is installed)

The MPI anchors reduce with the MPI library's own types and ops; ``avg`` is a sum followed by the
division mpigpu defines (IEEE for floats, truncating for integers). MPI has no 16-bit float type,
so float16 and bfloat16 have no MPI anchor. The torch anchors share one ``torch.distributed``
process group (``cpu:gloo,cuda:nccl``), set up from MPI: rank 0 picks a free port and broadcasts
its address over mpi4py. ``all_reduce`` is in place only, so out of place is ``out.copy_(x)``
followed by ``all_reduce(out)``, as a torch user writes it.
"""

from __future__ import annotations

import abc
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from mpigpu.core.ops import Op, finish_avg

if TYPE_CHECKING:
    from mpigpu.core.arrays import ArrayView
    from mpigpu.core.dtypes import DType
    from mpigpu.runtime.context import Context

__all__ = ["ANCHORS", "Anchor", "anchor_for", "device_bytes", "torch_tensor", "use_torch_stream"]


def anchor_for(placement: str, backend: str) -> str | None:
    """The anchor a backend is compared with on ``placement`` ("device" or "host"): the backend says
    (``Backend.anchors``)."""
    from mpigpu.backends import backend_class

    return backend_class(backend).anchors.get(placement)


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
    from mpigpu.core._mpi import MPI

    kind = x.dtype.mpi
    send = MPI().IN_PLACE if x.same_memory(out) else [xbuf, kind]
    return send, [outbuf, kind], op.mpi


def device_bytes(view: ArrayView) -> Any:
    """A CuPy uint8 array over the view's bytes (the benchmark's buffers are CuPy allocations)."""
    from mpigpu.core._cuda import cupy

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
        from mpigpu.core._cuda import cupy

        cp = cupy()
        with self.stream:
            host = device_bytes(x).get()  # pageable copy; waits for the stream
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
        from mpigpu.core._cuda import cupy

        cp = cupy()
        self.stream.synchronize()  # MPI must not read x before the work that wrote it is done
        xbuf, outbuf = device_bytes(x), device_bytes(out)
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


# -- torch.distributed ----------------------------------------------------------------------------
_TORCH_TIMEOUT_S = 120
_torch_users = 0  # torch anchors alive that use the process group this module created
_torch_owned = False  # whether this module initialised torch.distributed (and so destroys it)


def _agreed_problem(ctx: Context, local: str | None) -> str | None:
    """``local`` (None or why not) made the same on every rank: the first rank's problem, named."""
    problems = ctx.comm.allgather(local)
    for rank, problem in enumerate(problems):
        if problem is not None:
            return problem if all(p == problem for p in problems) else f"rank {rank}: {problem}"
    return None


def _torch_problem(need_nccl: bool) -> str | None:
    """Why torch.distributed cannot run this anchor on this rank (None if it can)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if need_nccl:
        if not torch.cuda.is_available():
            return "torch sees no CUDA device (a CPU-only torch build?)"
        if not dist.is_nccl_available():
            return "this torch build has no NCCL backend"
    elif not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


def _torch_process_group(ctx: Context, backend: str) -> Any:
    """The torch.distributed group to reduce with ``backend`` (nccl or gloo) over this job's ranks
    (collective). The default group is initialised once here, NCCL for CUDA tensors where every
    rank has a GPU and gloo for CPU tensors, and None (the default group) returned. Where torch.distributed
    was initialised already (a test process) without ``backend``, a new group of it is returned."""
    global _torch_users, _torch_owned
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != ctx.size or dist.get_rank() != ctx.rank:
            raise RuntimeError(
                f"torch.distributed is already initialised with rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"not rank {ctx.rank} of {ctx.size}: run the benchmark in a process of its own"
            )
        _torch_users += 1
        return None if backend in str(dist.get_backend()) else dist.new_group(backend=backend)
    address = None
    if ctx.rank == 0:
        with socket.socket() as probe:  # a port free now on rank 0's host; the TCP store binds it next
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        one_host = len(set(ctx.layout.hostnames)) == 1
        address = ("127.0.0.1" if one_host else socket.gethostname(), port)
    host, port = ctx.comm.bcast(address, root=0)
    gpus = ctx.all_have_gpus and dist.is_nccl_available()
    if gpus:
        import torch

        assert ctx.gpu is not None
        torch.cuda.set_device(ctx.gpu.index)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if gpus else "gloo", init_method=f"tcp://{host}:{port}", rank=ctx.rank,
        world_size=ctx.size, timeout=timedelta(seconds=_TORCH_TIMEOUT_S),
    )  # fmt: skip
    _torch_owned = True
    _torch_users += 1
    return None


def _torch_release(group: Any) -> None:
    """Free ``group`` (a group of our own), and the default group once its last anchor is done
    with it, if this module initialised it (collective)."""
    global _torch_users, _torch_owned
    import torch.distributed as dist

    if group is not None:
        dist.destroy_process_group(group)
    _torch_users -= 1
    if _torch_users == 0 and _torch_owned:
        dist.destroy_process_group()
        _torch_owned = False


def use_torch_stream(ctx: Context, stream: Any) -> Any:
    """Make ``stream`` (a CuPy stream on this rank's GPU) torch's current stream, so that torch
    work (and ``allreduce`` on torch tensors with the default stream) is ordered with the
    benchmark's fills and checks; returns the torch stream (keep it alive)."""
    import torch

    assert ctx.gpu is not None
    torch.cuda.set_device(ctx.gpu.index)
    external = torch.cuda.ExternalStream(int(stream.ptr), device=torch.device("cuda", ctx.gpu.index))
    torch.cuda.set_stream(external)
    return external


def torch_tensor(view: ArrayView) -> Any:
    """A torch tensor over a view's memory (no copy): CUDA through DLPack from CuPy, CPU from NumPy."""
    import numpy as np
    import torch

    dtype = getattr(torch, view.dtype.name)
    if view.on_device:
        return torch.from_dlpack(device_bytes(view)).view(dtype)
    assert view.host is not None
    return torch.from_numpy(view.host.view(np.uint8)).view(dtype)


class _TorchAnchor(Anchor):
    """torch.distributed.all_reduce on tensors over the benchmark's buffers, in place."""

    backend: ClassVar[str]
    dtypes: ClassVar[tuple[str, ...]]

    def __init__(self, ctx: Context, stream: Any) -> None:
        super().__init__(ctx, stream)
        self._torch_stream = use_torch_stream(ctx, stream) if self.placement == "device" else None
        self._group = _torch_process_group(ctx, self.backend)
        self._open = True
        self._key: tuple[int, int, int, str] | None = None
        self._tensors: tuple[Any, Any] = (None, None)

    @classmethod
    def unavailable(cls, ctx: Context) -> str | None:
        local = None
        if cls.placement == "device" and not ctx.all_have_gpus:
            local = "needs a GPU on every rank"
        else:
            local = _torch_problem(cls.placement == "device")
        return _agreed_problem(ctx, local)

    @classmethod
    def supports(cls, dtype: DType, op: Op) -> str | None:
        if dtype.name not in cls.dtypes:
            return f"torch.distributed ({cls.backend}) is not timed on {dtype.name} here"
        return None

    def tensors(self, x: ArrayView, out: ArrayView) -> tuple[Any, Any]:
        """The tensors over ``x`` and ``out``, made once per pair of buffers (not inside the timed calls)."""
        key = (x.ptr, out.ptr, x.size, x.dtype.name)
        if key != self._key:
            xt = torch_tensor(x)
            self._tensors = (xt, xt if x.same_memory(out) else torch_tensor(out))
            self._key = key
        return self._tensors

    def close(self) -> None:
        if self._open:
            self._open = False
            self._tensors = (None, None)
            _torch_release(self._group)


class TorchNccl(_TorchAnchor):
    name: ClassVar[str] = "torch-nccl"
    placement: ClassVar[str] = "device"
    description: ClassVar[str] = "torch.distributed.all_reduce, NCCL backend, on torch CUDA tensors"
    backend: ClassVar[str] = "nccl"
    dtypes: ClassVar[tuple[str, ...]] = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")

    @classmethod
    def supports(cls, dtype: DType, op: Op) -> str | None:
        if op is Op.AVG and not dtype.is_float:
            return "torch.distributed's ReduceOp.AVG takes floating-point tensors only"
        return super().supports(dtype, op)

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> None:
        import torch.distributed as dist

        xt, outt = self.tensors(x, out)
        if outt is not xt:
            outt.copy_(xt)
        dist.all_reduce(outt, op=_torch_op(op), group=self._group)  # ordered on torch's current stream


class TorchGloo(_TorchAnchor):
    name: ClassVar[str] = "torch-gloo"
    placement: ClassVar[str] = "host"
    description: ClassVar[str] = "torch.distributed.all_reduce, gloo backend, on torch CPU tensors"
    backend: ClassVar[str] = "gloo"
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float64", "int8", "uint8", "int32", "int64")

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> None:
        import torch.distributed as dist

        xt, outt = self.tensors(x, out)
        if outt is not xt:
            outt.copy_(xt)
        dist.all_reduce(outt, op=_torch_op(Op.SUM if op is Op.AVG else op), group=self._group)  # gloo: no AVG
        if op is Op.AVG:
            assert out.host is not None
            finish_avg(out.host, self.ctx.size, out.dtype, out.host)


def _torch_op(op: Op) -> Any:
    from torch.distributed import ReduceOp

    return {Op.SUM: ReduceOp.SUM, Op.AVG: ReduceOp.AVG, Op.MIN: ReduceOp.MIN, Op.MAX: ReduceOp.MAX,
            Op.PROD: ReduceOp.PRODUCT}[op]  # fmt: skip


ANCHORS: dict[str, type[Anchor]] = {
    cls.name: cls for cls in (NcclRaw, TorchNccl, MpiDevice, SeedStaging, MpiHost, TorchGloo)
}
