"""The raw anchors of ``python -m mpigpu.bench --collective broadcast|allgather|reduce_scatter|alltoall``:
the same collective done the plain way, without mpigpu, beside ``mpigpu.broadcast(x)``,
``mpigpu.allgather(x)``, ``mpigpu.reduce_scatter(x, "sum")`` and ``mpigpu.alltoall(x, splits)``.

nccl-raw    ``NcclCommunicator.bcast`` / ``allGather`` / ``reduceScatter`` (unequal shares: one
            ``reduce`` per rank in an NCCL group) / ``send`` and ``recv`` in one group (cupy.cuda.nccl)
            on the benchmark's stream, the communicator of ``anchors.NcclRaw`` (pairs with nccl)
mpi-device  ``comm.Bcast`` / ``Allgather`` / ``Reduce_scatter`` / ``Alltoallv`` on device buffers after
            synchronising the stream, where the MPI library is CUDA-aware (pairs with cuda-aware)
mpi-host    the same on NumPy arrays (pairs with cpu and host on host arrays)
torch-nccl  ``torch.distributed.broadcast`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
            (unequal shares: ``reduce_scatter``) / ``all_to_all_single`` (no sizes where the split is
            even), NCCL backend, on CUDA tensors of the buffers' dtype made once per pair of buffers
            (as a torch user makes them: never a conversion inside the timed calls)
torch-gloo  the same with the gloo backend on CPU tensors (gloo has no reduce-scatter)

Data movement does not look at the values, so the MPI anchors move bytes (``uint8``, ``MPI.BYTE``;
any dtype, the same cost as the typed call); the torch anchors call on tensors of the buffers' dtype
where the backend takes it (uint8 tensors over the same bytes otherwise); raw NCCL uses the dtype's
NCCL type where there is one (bytes otherwise; alltoall's send/recv move bytes). Reduce-scatter sums
in the dtype (MPI has no 16-bit float types: no MPI anchor for them). The root is rank 0.
Allgather's output holds every rank's input in rank order (``n x`` the input); reduce-scatter and
alltoall split as ``scatter_rows(count, n)``. The host backend on GPU buffers has no anchor here
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
    """What every anchor of these collectives adds: ``broadcast(x, root)``, ``allgather(x, out)``,
    ``reduce_scatter(x, out, shares)`` (a sum) and ``alltoall(x, out, splits)`` (every rank sends
    ``splits`` and so receives its own share from every rank)."""

    @classmethod
    def supports(cls, dtype: DType, op: Op) -> str | None:
        return None  # bytes

    @classmethod
    def refuses(cls, collective: str, dtype: DType) -> str | None:
        """Why this anchor cannot time ``collective`` on ``dtype``, or None."""
        return None

    @abc.abstractmethod
    def broadcast(self, x: ArrayView, root: int) -> None:
        """Copy rank ``root``'s ``x`` into ``x`` on every rank."""

    @abc.abstractmethod
    def allgather(self, x: ArrayView, out: ArrayView) -> None:
        """Every rank's ``x``, in rank order, into ``out``."""

    @abc.abstractmethod
    def reduce_scatter(self, x: ArrayView, out: ArrayView, shares: list[int]) -> None:
        """This rank's share (``shares[rank]`` elements, in rank order) of the sum of every rank's ``x``."""

    @abc.abstractmethod
    def alltoall(self, x: ArrayView, out: ArrayView, splits: list[int]) -> None:
        """``splits[j]`` elements of ``x`` to rank j; ``splits[rank]`` from every rank into ``out``."""


def _offsets(counts: list[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]


def _host_bytes(view: ArrayView) -> np.ndarray:
    assert view.host is not None
    return view.host.reshape(-1).view(np.uint8)


class NcclRawMoves(_Moves, NcclRaw):
    description: ClassVar[str] = (
        "NCCL bcast / allGather / reduceScatter / send+recv called directly through cupy.cuda.nccl"
    )

    def broadcast(self, x: ArrayView, root: int) -> None:
        self._comm.bcast(x.ptr, *_nccl_count(x), root, self.stream.ptr)

    def allgather(self, x: ArrayView, out: ArrayView) -> None:
        self._comm.allGather(x.ptr, out.ptr, *_nccl_count(x), self.stream.ptr)

    def reduce_scatter(self, x: ArrayView, out: ArrayView, shares: list[int]) -> None:
        from cupy.cuda import nccl

        item, kind, me = x.dtype.itemsize, x.dtype.nccl, self.ctx.rank
        if len(set(shares)) == 1:
            self._comm.reduceScatter(x.ptr, out.ptr, shares[0], kind, nccl.NCCL_SUM, self.stream.ptr)
            return
        nccl.groupStart()
        try:
            for root, (share, at) in enumerate(zip(shares, _offsets(shares), strict=True)):
                if share:
                    recv = out.ptr if root == me else x.ptr + at * item  # ignored off the root
                    self._comm.reduce(x.ptr + at * item, recv, share, kind, nccl.NCCL_SUM, root, self.stream.ptr)
        finally:
            nccl.groupEnd()

    def alltoall(self, x: ArrayView, out: ArrayView, splits: list[int]) -> None:
        from cupy.cuda import nccl

        item, share = x.dtype.itemsize, splits[self.ctx.rank]
        nccl.groupStart()
        try:
            for peer, (count, at) in enumerate(zip(splits, _offsets(splits), strict=True)):
                if count:
                    self._comm.send(x.ptr + at * item, count * item, nccl.NCCL_UINT8, peer, self.stream.ptr)
                if share:
                    self._comm.recv(out.ptr + peer * share * item, share * item, nccl.NCCL_UINT8, peer, self.stream.ptr)
        finally:
            nccl.groupEnd()


def _nccl_count(x: ArrayView) -> tuple[int, int]:
    """(count, NCCL type): x's own type where NCCL has it (cupy's bcast takes a C int count, so
    elements reach further than bytes), else bytes."""
    from cupy.cuda import nccl

    return (x.size, x.dtype.nccl) if x.dtype.nccl is not None else (x.nbytes, nccl.NCCL_UINT8)


class _MpiMoves(_Moves):
    """Reduce-scatter and alltoall through MPI, on the buffers ``buffer(view)`` gives."""

    ctx: Any

    @staticmethod
    @abc.abstractmethod
    def buffer(view: ArrayView) -> Any:
        """The view's bytes as MPI reads them."""

    @classmethod
    def refuses(cls, collective: str, dtype: DType) -> str | None:
        if collective == "reduce_scatter" and dtype.is_half:
            return f"MPI has no {dtype.name} type"
        return None

    def reduce_scatter(self, x: ArrayView, out: ArrayView, shares: list[int]) -> None:
        from mpigpu.core._mpi import MPI

        self.ready()
        kind = x.dtype.mpi
        self.ctx.comm.Reduce_scatter(
            [self.buffer(x), x.size, kind], [self.buffer(out), out.size, kind], shares, MPI().SUM
        )

    def alltoall(self, x: ArrayView, out: ArrayView, splits: list[int]) -> None:
        from mpigpu.core._mpi import MPI

        self.ready()
        item, share, byte = x.dtype.itemsize, splits[self.ctx.rank], MPI().BYTE
        send = ([c * item for c in splits], [a * item for a in _offsets(splits)])
        recv = ([share * item] * len(splits), [r * share * item for r in range(len(splits))])
        self.ctx.comm.Alltoallv([self.buffer(x), send, byte], [self.buffer(out), recv, byte])

    def ready(self) -> None:
        """Before MPI reads the buffers (device buffers: once the stream's work is done)."""


class MpiHostMoves(_MpiMoves, MpiHost):
    description: ClassVar[str] = "comm.Bcast / Allgather / Reduce_scatter / Alltoallv on NumPy arrays"

    @staticmethod
    def buffer(view: ArrayView) -> Any:
        return _host_bytes(view)

    def broadcast(self, x: ArrayView, root: int) -> None:
        from mpigpu.core._mpi import MPI

        self.ctx.comm.Bcast([_host_bytes(x), MPI().BYTE], root=root)

    def allgather(self, x: ArrayView, out: ArrayView) -> None:
        from mpigpu.core._mpi import MPI

        byte = MPI().BYTE
        self.ctx.comm.Allgather([_host_bytes(x), byte], [_host_bytes(out), byte])


class MpiDeviceMoves(_MpiMoves, MpiDevice):
    description: ClassVar[str] = (
        "comm.Bcast / Allgather / Reduce_scatter / Alltoallv on device buffers (CUDA-aware MPI)"
    )

    @staticmethod
    def buffer(view: ArrayView) -> Any:
        return device_bytes(view)

    def ready(self) -> None:
        self.stream.synchronize()  # MPI must not read x before the work that wrote it is done

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
    """torch.distributed on tensors over the benchmark's buffers, made once per pair of buffers (in
    the check before a size's timed calls, never inside them), as a torch user makes them: of the
    buffers' dtype where the anchor times it (``dtypes``), else uint8 tensors over the same bytes."""

    ctx: Any
    dtypes: ClassVar[tuple[str, ...]]
    _group: Any
    _moves_key: Any = None
    _moves: tuple[Any, Any] = (None, None)

    def move_tensors(self, x: ArrayView, out: ArrayView) -> tuple[Any, Any]:
        """The tensors over ``x`` and ``out``: typed where torch's backend takes the dtype, else bytes."""
        from mpigpu.bench.anchors import torch_tensor

        typed = x.dtype.name in self.dtypes
        key = (typed, x.ptr, out.ptr, x.nbytes, out.nbytes, x.dtype.name)
        if key != self._moves_key:
            make = torch_tensor if typed else _byte_tensor
            xt = make(x)
            self._moves = (xt, xt if x.same_memory(out) and x.nbytes == out.nbytes else make(out))
            self._moves_key = key
        return self._moves

    def typed_tensors(self, x: ArrayView, out: ArrayView) -> tuple[Any, Any]:
        """Tensors of the views' dtype (reduce-scatter sums values, not bytes), made once per pair of buffers."""
        from mpigpu.bench.anchors import torch_tensor

        key = ("sum", x.ptr, out.ptr, x.nbytes, out.nbytes, x.dtype.name)
        if key != self._moves_key:
            self._moves = (torch_tensor(x), torch_tensor(out))
            self._moves_key = key
        return self._moves

    def broadcast(self, x: ArrayView, root: int) -> None:
        import torch.distributed as dist

        xt, _ = self.move_tensors(x, x)
        dist.broadcast(xt, src=root, group=self._group)  # ordered on torch's current stream

    def allgather(self, x: ArrayView, out: ArrayView) -> None:
        import torch.distributed as dist

        xt, outt = self.move_tensors(x, out)
        dist.all_gather_into_tensor(outt, xt, group=self._group)

    def reduce_scatter(self, x: ArrayView, out: ArrayView, shares: list[int]) -> None:
        import torch.distributed as dist

        xt, outt = self.typed_tensors(x, out)
        if len(set(shares)) == 1:
            dist.reduce_scatter_tensor(outt, xt, group=self._group)
        else:
            dist.reduce_scatter(outt, list(xt.split(shares)), group=self._group)

    def alltoall(self, x: ArrayView, out: ArrayView, splits: list[int]) -> None:
        import torch.distributed as dist

        xt, outt = self.move_tensors(x, out)
        if len(set(splits)) == 1:  # an even split: no sizes, as a torch user calls it
            dist.all_to_all_single(outt, xt, group=self._group)
            return
        scale = 1 if xt.element_size() == x.dtype.itemsize else x.dtype.itemsize  # sizes in the tensors' elements
        share = splits[self.ctx.rank]
        sizes = [c * scale for c in splits]
        dist.all_to_all_single(outt, xt, [share * scale] * len(splits), sizes, group=self._group)


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
    description: ClassVar[str] = (
        "torch.distributed.broadcast / all_gather_into_tensor / reduce_scatter_tensor / all_to_all_single, "
        "NCCL backend, CUDA tensors"
    )

    def __init__(self, ctx: Any, stream: Any) -> None:
        super().__init__(ctx, stream)
        _quiet_torch()


class TorchGlooMoves(_TorchMoves, TorchGloo):
    description: ClassVar[str] = (
        "torch.distributed.broadcast / all_gather_into_tensor / all_to_all_single, gloo backend, CPU tensors"
    )

    @classmethod
    def refuses(cls, collective: str, dtype: DType) -> str | None:
        return "gloo has no reduce-scatter" if collective == "reduce_scatter" else None

    def __init__(self, ctx: Any, stream: Any) -> None:
        super().__init__(ctx, stream)
        _quiet_torch()


COLLECTIVE_ANCHORS: dict[str, type[Any]] = {
    cls.name: cls for cls in (NcclRawMoves, TorchNcclMoves, MpiDeviceMoves, MpiHostMoves, TorchGlooMoves)
}
