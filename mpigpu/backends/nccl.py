"""NCCL through CuPy's bindings: one communicator per MPI communicator, bootstrapped over MPI (rank 0
broadcasts the unique id), created once and reused. Calls are enqueued on the caller's stream, so
they are stream-ordered with no host synchronisation; avg is NCCL's own ncclAvg."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from mpigpu.backends.base import Availability, Backend
from mpigpu.check import agree
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


def _unavailable(ctx: Context, doing: str, exc: BaseException) -> BackendUnavailable:
    error = BackendUnavailable(f"NCCL {doing} a communicator of {ctx.size} ranks: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


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
        """Create the NCCL communicator (collective). ncclCommInitRank waits for every rank, so a rank
        that fails before it (NCCL does not load, no GPU, no unique id on rank 0) must not leave the
        others there: the ranks agree on these local steps first and all raise if one failed. A rank
        whose init then fails tells the others after it, so no rank goes on with a communicator the
        others lack. (An init that hangs in NCCL itself is bounded only by MPIGPU_TIMEOUT.)"""
        super().__init__(ctx)
        self._comm: Any = None
        nccl: Any = None
        uid = None
        error: BaseException | None = None
        try:
            from cupy.cuda import nccl

            ctx.activate_gpu()
            if ctx.rank == 0:
                uid = nccl.get_unique_id()
        except Exception as exc:
            error = _unavailable(ctx, "could not prepare", exc)
        agree(ctx.comm, error, "nccl backend: preparing the NCCL communicator")
        uid = ctx.comm.bcast(uid, root=0)
        try:
            self._comm = nccl.NcclCommunicator(ctx.size, uid, ctx.rank)
        except Exception as exc:
            error = _unavailable(ctx, "could not create", exc)
        try:
            agree(ctx.comm, error, "nccl backend: creating the NCCL communicator")
        except BaseException:
            self.close()  # the ranks whose init succeeded: no communicator the others lack
            raise

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None) -> None:
        assert x.dtype.nccl is not None
        handle = stream.handle if stream is not None else 0
        self._comm.allReduce(x.ptr, out.ptr, x.size, x.dtype.nccl, op.nccl, handle)

    def close(self) -> None:
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is not None:
            comm.destroy()

    def describe(self) -> dict[str, Any]:
        return {"nccl": self.ctx.nccl.version}
