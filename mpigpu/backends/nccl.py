"""NCCL through CuPy's bindings: one communicator per MPI communicator, bootstrapped over MPI (rank 0
broadcasts the unique id), created once and reused. Calls are enqueued on the caller's stream, so
they are stream-ordered with no host synchronisation; float avg is NCCL's own ncclAvg.

Float min/max and integer avg do not go to NCCL as they are (its float max drops NaN, its integer
avg wraps): they travel as order-preserving integer keys (ncclMin/ncclMax on uint32/uint64) or as
64-bit parts summed exactly (device_scratch.py), so they follow mpigpu's semantics (mpigpu.core.ops)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from mpigpu.backends.base import Availability, Backend, CommContext
from mpigpu.backends.device_scratch import DeviceScratch, by_keys_or_parts, needs_keys_or_parts
from mpigpu.backends.mpi_moves import byte_counts, row_bytes
from mpigpu.core.errors import BackendUnavailable, InvalidArgument
from mpigpu.core.typed import allgather_text
from mpigpu.job.check import fail_together

if TYPE_CHECKING:
    from mpigpu.core._cuda import StreamRef
    from mpigpu.core.arrays import ArrayView
    from mpigpu.core.dtypes import DType
    from mpigpu.core.ops import Op

__all__ = ["NcclBackend", "distinct_gpus"]


def distinct_gpus(ctx: CommContext) -> str | None:
    """None if every rank has its own GPU, else why not (NCCL and ipc need one GPU per rank)."""
    if not ctx.all_have_gpus:
        return "not every rank has a GPU"
    assert ctx.gpu is not None
    owners = allgather_text(ctx.comm, f"{ctx.layout.hostnames[ctx.rank]} {ctx.gpu.pci_bus_id}")
    if len(set(owners)) != len(owners):
        return "several ranks share a GPU (MPIGPU_ALLOW_SHARED_GPU=1); NCCL needs one GPU per rank"
    return None


_NCCL_UINT = {"uint32": 3, "uint64": 5}  # ncclDataType_t
_NCCL_UINT8 = 1  # ncclUint8: broadcast and allgather move bytes, whatever the dtype
_BROADCAST_PIECE = 1 << 30  # bytes per NCCL call where CuPy takes the count as a C int


def _unavailable(ctx: CommContext, doing: str, exc: BaseException) -> BackendUnavailable:
    error = BackendUnavailable(f"NCCL {doing} a communicator of {ctx.size} ranks: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class NcclBackend(Backend):
    """ncclAllReduce on the caller's stream."""

    name: ClassVar[str] = "nccl"
    host_arrays: ClassVar[bool] = False
    device_arrays: ClassVar[bool] = True
    enqueues: ClassVar[bool] = True
    graphs: ClassVar[bool] = True
    anchors: ClassVar[Mapping[str, str]] = {"device": "nccl-raw"}
    collectives: ClassVar[frozenset[str]] = frozenset(
        {"allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"}
    )

    @classmethod
    def probe(cls, ctx: CommContext) -> Availability:
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

    def __init__(self, ctx: CommContext) -> None:
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
        fail_together(ctx.comm, error, "nccl backend: preparing the NCCL communicator")
        uid = ctx.comm.bcast(uid, root=0)
        self._scratch = DeviceScratch()  # keys of the half types, parts of integer averages
        self._rows = DeviceScratch()  # reduce_scatter: its padded input and output, or its whole result
        try:
            self._comm = nccl.NcclCommunicator(ctx.size, uid, ctx.rank)
        except Exception as exc:
            error = _unavailable(ctx, "could not create", exc)
        try:
            fail_together(ctx.comm, error, "nccl backend: creating the NCCL communicator")
        except BaseException:
            self.close()  # the ranks whose init succeeded: no communicator the others lack
            raise

    def native_comm(self) -> int:
        """The ncclComm_t, for compiled code that calls NCCL itself (mpigpu.jax's compiled handler)."""
        return int(self._comm.comm)

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None) -> None:
        from mpigpu.core._cuda import StreamRef

        assert x.dtype.nccl is not None
        stream = stream or StreamRef(0)
        handle = stream.handle

        def reduce(ptr: int, count: int, kind: str, how: Op) -> None:
            self._comm.allReduce(ptr, ptr, count, _NCCL_UINT[kind], how.nccl, handle)

        if by_keys_or_parts(self._kernels, self._scratch, x, out, op, self.ctx.size, stream, reduce):
            return
        self._comm.allReduce(x.ptr, out.ptr, x.size, x.dtype.nccl, op.nccl, handle)

    def bind_allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> Callable[..., None]:
        """The communicator, pointers, count, datatype and op fixed: a call is the NCCL launch.
        Float min/max and integer avg keep their key/part passes (the full ``allreduce``). GPU arrays:
        no host arrays are ever lent."""
        assert x.dtype.nccl is not None
        if needs_keys_or_parts(x.dtype, op):
            return super().bind_allreduce(x, out, op)
        launch, args = self._comm.allReduce, (x.ptr, out.ptr, x.size, x.dtype.nccl, op.nccl)

        def call(stream: StreamRef | None, x_host: Any = None, out_host: Any = None) -> None:
            launch(*args, 0 if stream is None else stream.handle)

        return call

    def broadcast(self, x: ArrayView, root: int, stream: StreamRef | None) -> None:
        """ncclBroadcast of x's bytes from ``root``, in place, on the caller's stream."""
        from cupy.cuda import nccl

        nccl.groupStart()
        try:
            self._broadcast_bytes(x.ptr, x.ptr, x.nbytes, root, 0 if stream is None else stream.handle)
        finally:
            nccl.groupEnd()

    def _broadcast_bytes(self, send: int, recv: int, nbytes: int, root: int, handle: int) -> None:
        """ncclBroadcast in pieces of at most 1 GiB: CuPy's binding takes the count as a C int."""
        for offset in range(0, nbytes, _BROADCAST_PIECE):
            piece = min(_BROADCAST_PIECE, nbytes - offset)
            self._comm.broadcast(send + offset, recv + offset, piece, _NCCL_UINT8, root, handle)

    def allgather(self, x: ArrayView, out: ArrayView, rows: list[int], stream: StreamRef | None) -> None:
        """ncclAllGather when every rank has the same number of rows; otherwise (ncclAllGather needs
        equal counts) one ncclBroadcast per rank with rows, from its input into its place in ``out``,
        all in one NCCL group. Both on the caller's stream."""
        from cupy.cuda import nccl

        handle = 0 if stream is None else stream.handle
        row_bytes = out.nbytes // sum(rows)
        if len(set(rows)) == 1:
            self._comm.allGather(x.ptr, out.ptr, x.nbytes, _NCCL_UINT8, handle)
            return
        nccl.groupStart()
        try:
            offset = 0
            for rank, count in enumerate(rows):
                nbytes = count * row_bytes
                if nbytes:  # every rank knows rows: all skip the same ranks
                    send = x.ptr if rank == self.ctx.rank else out.ptr + offset
                    self._broadcast_bytes(send, out.ptr + offset, nbytes, rank, handle)
                offset += nbytes
        finally:
            nccl.groupEnd()

    def reduce_scatter(self, x: ArrayView, out: ArrayView, op: Op, rows: list[int], stream: StreamRef | None) -> None:
        """ncclReduceScatter on the caller's stream. It needs equal counts: when the rows do not
        divide evenly, the ranks with one row fewer get an uninitialised pad row, in a padded copy
        of x (two copies on the stream), and receive into a scratch block first. Float min/max and
        integer avg (keys and parts around NCCL) take this backend's allreduce into a scratch
        buffer, then this rank's rows: the same bits, at an allreduce's cost."""
        from mpigpu.core._cuda import StreamRef, cupy
        from mpigpu.core.arrays import ArrayView

        assert x.dtype.nccl is not None
        stream = stream or StreamRef(0)
        handle, rt = stream.handle, cupy().cuda.runtime
        d2d, me = rt.memcpyDeviceToDevice, self.ctx.rank
        counts, displs = byte_counts(rows, row_bytes(x.shape, x.dtype.itemsize))
        if needs_keys_or_parts(x.dtype, op):
            full = self._rows.take(x.nbytes, handle)
            self.allreduce(x, ArrayView(None, full, x.shape, x.dtype, x.device, False, "cupy"), op, stream)
            if out.nbytes:
                rt.memcpyAsync(out.ptr, full + displs[me], out.nbytes, d2d, handle)
            self._rows.give_back(handle)
            return
        per_row = x.size // sum(rows)
        if len(set(rows)) == 1:
            self._comm.reduceScatter(x.ptr, out.ptr, out.size, x.dtype.nccl, op.nccl, handle)
            return
        block, short = counts[0], counts[-1]  # bytes of the longer and of the shorter share
        longer = rows.count(rows[0])  # the first ranks hold the longer shares
        base = self._rows.take(block * (len(rows) + 1), handle)  # padded input, then one block of output
        rt.memcpyAsync(base, x.ptr, block * longer, d2d, handle)  # the longer shares are in place already
        if short:
            rt.memcpy2DAsync(base + block * longer, block, x.ptr + block * longer, short, short, len(rows) - longer,
                             d2d, handle)  # fmt: skip
        recv = out.ptr if counts[me] == block else base + block * len(rows)
        self._comm.reduceScatter(base, recv, rows[0] * per_row, x.dtype.nccl, op.nccl, handle)
        if recv != out.ptr and out.nbytes:
            rt.memcpyAsync(out.ptr, recv, out.nbytes, d2d, handle)
        self._rows.give_back(handle)

    def bind_reduce_scatter(self, x: ArrayView, op: Op, rows: list[int]) -> Callable[..., None]:
        """``reduce_scatter`` with the op and rows fixed, for a call record: ``launch(x, out, stream)``.
        Equal rows without key or part passes (the usual case): one ncclReduceScatter, nothing else."""
        assert x.dtype.nccl is not None
        method = self.reduce_scatter
        if needs_keys_or_parts(x.dtype, op) or len(set(rows)) != 1:
            return lambda xv, outv, stream: method(xv, outv, op, rows, stream)
        launch, count, dtype, how = self._comm.reduceScatter, x.size // len(rows), x.dtype.nccl, op.nccl

        def call(xv: ArrayView, outv: ArrayView, stream: StreamRef | None) -> None:
            launch(xv.ptr, outv.ptr, count, dtype, how, 0 if stream is None else stream.handle)

        return call

    def alltoall(
        self, x: ArrayView, out: ArrayView, send_rows: list[int], recv_rows: list[int], stream: StreamRef | None
    ) -> None:
        """ncclSend/ncclRecv to and from every rank, this one included (NCCL copies a rank's own rows
        inside the same launch), in one NCCL group on the caller's stream."""
        from cupy.cuda import nccl

        handle = 0 if stream is None else stream.handle
        size = row_bytes(x.shape, x.dtype.itemsize)
        (send_counts, send_at), (recv_counts, recv_at) = byte_counts(send_rows, size), byte_counts(recv_rows, size)
        comm, xp, op = self._comm, x.ptr, out.ptr
        nccl.groupStart()
        try:
            for peer in range(len(send_rows)):
                for offset in range(0, send_counts[peer], _BROADCAST_PIECE):  # C int counts: 1 GiB pieces
                    piece = min(_BROADCAST_PIECE, send_counts[peer] - offset)
                    comm.send(xp + send_at[peer] + offset, piece, _NCCL_UINT8, peer, handle)
                for offset in range(0, recv_counts[peer], _BROADCAST_PIECE):
                    piece = min(_BROADCAST_PIECE, recv_counts[peer] - offset)
                    comm.recv(op + recv_at[peer] + offset, piece, _NCCL_UINT8, peer, handle)
        finally:
            nccl.groupEnd()

    # -- CUDA graphs (mpigpu.calls.persistent.Graph) --------------------------------------------------------
    def graph_allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> Any:
        """A cuda.core Graph of this call (local): the NCCL launch captured on a private stream."""
        if needs_keys_or_parts(x.dtype, op):  # their scratch buffer's events cannot be captured
            raise InvalidArgument(
                f"a CUDA graph of nccl {op.value} on {x.dtype.name} is not supported (it needs mpigpu's "
                "key/part passes around NCCL): use start()/wait(), or the ipc backend"
            )
        from mpigpu.core._cuda import require_cuda_core  # noqa: F401 - a clear error without cuda.core

        device = self.ctx.activate_gpu()
        builder = device.create_graph_builder().begin_building()
        try:
            self._comm.allReduce(x.ptr, out.ptr, x.size, x.dtype.nccl, op.nccl, int(builder.stream.handle))
            builder.end_building()
            return builder.complete()
        finally:
            builder.close()

    def launch_graph(self, graph: Any, stream: StreamRef | None) -> None:
        """Replay a graph from ``graph_allreduce`` on ``stream`` (stream order is NCCL's order)."""
        from mpigpu.core._cuda import core_stream

        graph.launch(core_stream(0 if stream is None else stream.handle))

    def _kernels(self) -> Any:
        from mpigpu.kernels.compile import load_module

        assert self.ctx.gpu is not None
        major, minor = self.ctx.gpu.compute_capability
        return load_module("arith.cu", f"{major}{minor}")

    def close(self) -> None:
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is not None:
            comm.destroy()
        for name in ("_scratch", "_rows"):
            scratch = getattr(self, name, None)
            if scratch is not None:
                scratch.close()

    def describe(self) -> dict[str, Any]:
        return {"nccl": self.ctx.nccl.version}
