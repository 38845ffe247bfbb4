"""NCCL through CuPy's bindings: one communicator per MPI communicator, bootstrapped over MPI (rank 0
broadcasts the unique id), created once and reused. Calls are enqueued on the caller's stream, so
they are stream-ordered with no host synchronisation; avg is NCCL's own ncclAvg."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from mpigpu.backends.base import Availability, Backend
from mpigpu.errors import BackendUnavailable

if TYPE_CHECKING:
    from mpigpu._cuda import StreamRef
    from mpigpu.arrays import ArrayView
    from mpigpu.context import Context
    from mpigpu.dtypes import DType
    from mpigpu.ops import Op

__all__ = ["NcclBackend", "distinct_gpus"]


def distinct_gpus(ctx: Context) -> str | None:
    """None if every rank has its own GPU, else why not (NCCL and ipc need one GPU per rank)."""
    if not ctx.all_have_gpus:
        return "not every rank has a GPU"
    assert ctx.gpu is not None
    owners = ctx.comm.allgather((ctx.layout.hostnames[ctx.rank], ctx.gpu.pci_bus_id))
    if len(set(owners)) != len(owners):
        return "several ranks share a GPU (MPIGPU_ALLOW_SHARED_GPU=1); NCCL needs one GPU per rank"
    return None


class NcclBackend(Backend):
    """ncclAllReduce on the caller's stream."""

    name: ClassVar[str] = "nccl"
    code: ClassVar[int] = 4
    host_arrays: ClassVar[bool] = False
    device_arrays: ClassVar[bool] = True

    @classmethod
    def probe(cls, ctx: Context) -> Availability:
        problem = distinct_gpus(ctx)  # collective: runs on every rank whatever the outcome
        if problem:
            return Availability(False, problem)
        if not ctx.nccl.available:
            return Availability(False, ctx.nccl.reason)
        return Availability(True, f"NCCL {ctx.nccl.version} via cupy.cuda.nccl")

    @classmethod
    def supports(cls, dtype: DType, op: Op) -> str | None:
        if dtype.nccl is None:
            return f"NCCL has no {dtype.name} type"
        return None

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        from cupy.cuda import nccl

        ctx.activate_gpu()
        uid = nccl.get_unique_id() if ctx.rank == 0 else None
        uid = ctx.comm.bcast(uid, root=0)
        try:
            self._comm: Any = nccl.NcclCommunicator(ctx.size, uid, ctx.rank)
        except nccl.NcclError as exc:
            raise BackendUnavailable(f"NCCL could not create a communicator of {ctx.size} ranks: {exc}") from exc

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None) -> None:
        assert x.dtype.nccl is not None
        handle = stream.handle if stream is not None else 0
        self._comm.allReduce(x.ptr, out.ptr, x.size, x.dtype.nccl, op.nccl, handle)

    def bind(self, x: ArrayView, out: ArrayView, op: Op) -> Callable[[StreamRef | None], None]:
        """The communicator, pointers, count, datatype and op fixed: a call is the NCCL launch."""
        assert x.dtype.nccl is not None
        launch, args = self._comm.allReduce, (x.ptr, out.ptr, x.size, x.dtype.nccl, op.nccl)

        def call(stream: StreamRef | None) -> None:
            launch(*args, 0 if stream is None else stream.handle)

        return call

    # -- CUDA graphs (mpigpu.persistent.Graph) --------------------------------------------------------
    def build_graph(self, x: ArrayView, out: ArrayView, op: Op) -> Any:
        """A cuda.core Graph of this call (local): the NCCL launch captured on a private stream."""
        from mpigpu._cuda import require_cuda_core  # noqa: F401 - a clear error without cuda.core

        device = self.ctx.activate_gpu()
        builder = device.create_graph_builder().begin_building()
        try:
            self._comm.allReduce(x.ptr, out.ptr, x.size, x.dtype.nccl, op.nccl, int(builder.stream.handle))
            builder.end_building()
            return builder.complete()
        finally:
            builder.close()

    def launch_graph(self, graph: Any, stream: StreamRef | None) -> None:
        """Replay a graph from ``build_graph`` on ``stream`` (stream order is NCCL's order)."""
        from mpigpu._cuda import core_stream

        graph.launch(core_stream(0 if stream is None else stream.handle))

    def close(self) -> None:
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is not None:
            comm.destroy()

    def describe(self) -> dict[str, Any]:
        return {"nccl": self.ctx.nccl.version}
