"""The raw anchors of ``python -m mpigpu.bench --collective broadcast|allgather``: the same data
movement done the plain way, without mpigpu, beside ``mpigpu.broadcast(x)`` and ``mpigpu.allgather(x)``.

nccl-raw    ``NcclCommunicator.bcast`` / ``allGather`` (cupy.cuda.nccl) on the benchmark's stream,
            the communicator of ``anchors.NcclRaw`` (pairs with the nccl backend)
mpi-device  ``comm.Bcast`` / ``comm.Allgather`` on device buffers after synchronising the stream,
            where the MPI library is CUDA-aware (pairs with the cuda-aware backend)
mpi-host    ``comm.Bcast`` / ``comm.Allgather`` on NumPy arrays (pairs with cpu and host on host arrays)
torch-nccl  ``torch.distributed.broadcast`` / ``all_gather_into_tensor``, NCCL backend, on CUDA tensors
torch-gloo  the same with the gloo backend on CPU tensors

Data movement does not look at the values, so the MPI and torch anchors move bytes (``uint8``,
``MPI.BYTE``; any dtype, the same cost as the typed call); raw NCCL uses the dtype's NCCL type where
there is one (bytes otherwise). The root is rank 0. Allgather's output holds every
rank's input in rank order (``n x`` the input). The host backend on GPU buffers has no anchor here
(the seed sample only reduced).
"""

from __future__ import annotations

import abc
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mpigpu.bench.anchors import MpiDevice, MpiHost, NcclRaw, TorchGloo, TorchNccl, device_bytes

if TYPE_CHECKING:
    from mpigpu.core.arrays import ArrayView
    from mpigpu.core.dtypes import DType
    from mpigpu.core.ops import Op

__all__ = ["COLLECTIVE_ANCHORS"]


class _Moves(abc.ABC):
    """What every data-movement anchor adds: ``broadcast(x, root)`` and ``allgather(x, out)``; any dtype."""

    @classmethod
    def supports(cls, dtype: DType, op: Op) -> str | None:
        return None  # bytes

    @abc.abstractmethod
    def broadcast(self, x: ArrayView, root: int) -> None:
        """Copy rank ``root``'s ``x`` into ``x`` on every rank."""

    @abc.abstractmethod
    def allgather(self, x: ArrayView, out: ArrayView) -> None:
        """Every rank's ``x``, in rank order, into ``out``."""


def _host_bytes(view: ArrayView) -> np.ndarray:
    assert view.host is not None
    return view.host.reshape(-1).view(np.uint8)


class NcclRawMoves(_Moves, NcclRaw):
    description: ClassVar[str] = "NCCL bcast / allGather called directly through cupy.cuda.nccl"

    def broadcast(self, x: ArrayView, root: int) -> None:
        self._comm.bcast(x.ptr, *_nccl_count(x), root, self.stream.ptr)

    def allgather(self, x: ArrayView, out: ArrayView) -> None:
        self._comm.allGather(x.ptr, out.ptr, *_nccl_count(x), self.stream.ptr)


def _nccl_count(x: ArrayView) -> tuple[int, int]:
    """(count, NCCL type): x's own type where NCCL has it (cupy's bcast takes a C int count, so
    elements reach further than bytes), else bytes."""
    from cupy.cuda import nccl

    return (x.size, x.dtype.nccl) if x.dtype.nccl is not None else (x.nbytes, nccl.NCCL_UINT8)


class MpiHostMoves(_Moves, MpiHost):
    description: ClassVar[str] = "comm.Bcast / comm.Allgather on NumPy arrays"

    def broadcast(self, x: ArrayView, root: int) -> None:
        from mpigpu.core._mpi import MPI

        self.ctx.comm.Bcast([_host_bytes(x), MPI().BYTE], root=root)

    def allgather(self, x: ArrayView, out: ArrayView) -> None:
        from mpigpu.core._mpi import MPI

        byte = MPI().BYTE
        self.ctx.comm.Allgather([_host_bytes(x), byte], [_host_bytes(out), byte])


class MpiDeviceMoves(_Moves, MpiDevice):
    description: ClassVar[str] = "comm.Bcast / comm.Allgather on device buffers (CUDA-aware MPI)"

    def broadcast(self, x: ArrayView, root: int) -> None:
        from mpigpu.core._mpi import MPI

        self.stream.synchronize()  # MPI must not read x before the work that wrote it is done
        self.ctx.comm.Bcast([device_bytes(x), MPI().BYTE], root=root)

    def allgather(self, x: ArrayView, out: ArrayView) -> None:
        from mpigpu.core._mpi import MPI

        byte = MPI().BYTE
        self.stream.synchronize()
        self.ctx.comm.Allgather([device_bytes(x), byte], [device_bytes(out), byte])


class _TorchMoves(_Moves):
    """torch.distributed on uint8 tensors over the benchmark's buffers, made once per pair of buffers."""

    _group: Any
    _key: Any
    _tensors: tuple[Any, Any]

    def byte_tensors(self, x: ArrayView, out: ArrayView) -> tuple[Any, Any]:
        key = (x.ptr, out.ptr, x.nbytes, out.nbytes)
        if key != self._key:
            self._tensors = (_byte_tensor(x), _byte_tensor(out))
            self._key = key
        return self._tensors

    def broadcast(self, x: ArrayView, root: int) -> None:
        import torch.distributed as dist

        xt, _ = self.byte_tensors(x, x)
        dist.broadcast(xt, src=root, group=self._group)  # ordered on torch's current stream

    def allgather(self, x: ArrayView, out: ArrayView) -> None:
        import torch.distributed as dist

        xt, outt = self.byte_tensors(x, out)
        dist.all_gather_into_tensor(outt, xt, group=self._group)


def _byte_tensor(view: ArrayView) -> Any:
    import torch

    if view.on_device:
        return torch.from_dlpack(device_bytes(view))
    return torch.from_numpy(_host_bytes(view))


def _quiet_torch() -> None:
    """torch 2.13 marks all_gather_into_tensor deprecated (for all_gather_single); the anchor is the
    documented call of the torch versions users have, so its warning is not repeated on every rank."""
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*deprecated", category=FutureWarning)


class TorchNcclMoves(_TorchMoves, TorchNccl):
    description: ClassVar[str] = "torch.distributed.broadcast / all_gather_into_tensor, NCCL backend, CUDA tensors"

    def __init__(self, ctx: Any, stream: Any) -> None:
        super().__init__(ctx, stream)
        _quiet_torch()


class TorchGlooMoves(_TorchMoves, TorchGloo):
    description: ClassVar[str] = "torch.distributed.broadcast / all_gather_into_tensor, gloo backend, CPU tensors"

    def __init__(self, ctx: Any, stream: Any) -> None:
        super().__init__(ctx, stream)
        _quiet_torch()


COLLECTIVE_ANCHORS: dict[str, type[Any]] = {
    cls.name: cls for cls in (NcclRawMoves, TorchNcclMoves, MpiDeviceMoves, MpiHostMoves, TorchGlooMoves)
}
