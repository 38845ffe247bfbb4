"""How a call over several devices per process moves its data, once its devices have met.

- ``nccl``: one NCCL communicator per (rank, GPU) pair, created in one NCCL group per process; a call is
  one ncclAllReduce per local GPU, issued in a group on each device's stream (NCCL divides avg by every
  participant). Float min/max and integer avg, whose exact forms need passes of their own, are not taken.
- ``host`` (GPU arrays) and ``cpu`` (host arrays): every participant's rows, gathered on every rank
  (each process copies its devices' rows in, MPI_Allgatherv moves them across ranks) and reduced in
  participant order with mpigpu's NumPy semantics. The order is the participants', whatever the layout,
  so 1 process x 2 devices and 2 processes x 1 device give the same bits.
- ``cuda-aware``: the same rows gathered in GPU memory: each GPU's array copied into its row on the
  process's first GPU (on that GPU's stream), MPI_Allgatherv on the device buffer (a CUDA-aware MPI), and
  the host backend's kernel (kernels/host.cu) reduces the rows in participant order there; the result
  is copied back on each GPU's stream.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from mpigpu.backends.device_scratch import needs_keys_or_parts
from mpigpu.backends.host_reduce import CPU_BLOCK, reduce_rows
from mpigpu.core.arrays import copy_single
from mpigpu.core.errors import BackendUnavailable, InvalidArgument
from mpigpu.core.ops import Op
from mpigpu.job.check import fail_together
from mpigpu.runtime.plan import Choice

if TYPE_CHECKING:
    from mpigpu.core.arrays import ArrayView
    from mpigpu.multi.group import Group

__all__ = ["BUILT", "DeviceComms", "bind", "choose", "device_comms"]

BUILT = ("auto", "nccl", "host", "cuda-aware", "cpu")  # the backends a call over several devices per process takes


def _nccl_problem(group: Group, x: ArrayView, op: Op) -> str | None:
    ctx = group.ctx
    availability = ctx.availability.get("nccl")
    if availability is None or not availability.ok:
        return f"NCCL is unavailable ({availability.reason if availability else 'not probed'})"
    if x.dtype.nccl is None:
        return f"NCCL has no {x.dtype.name} type"
    if needs_keys_or_parts(x.dtype, op):
        return f"{op.value} of {x.dtype.name} over several devices per process runs on the host path"
    return None


def choose(group: Group, x: ArrayView, op: Op, backend: str) -> Choice:
    """The path of a call (the same on every rank: it depends on agreed state, dtype, op and backend)."""
    if backend not in BUILT:
        raise InvalidArgument(
            f"backend {backend!r} does not take calls over several devices per process: use one of {', '.join(BUILT)}"
        )
    if not x.on_device:
        if backend not in ("auto", "cpu"):
            raise InvalidArgument(f"backend {backend!r} takes GPU arrays; host arrays take 'cpu' or 'auto'")
        return Choice(
            "cpu", "host arrays over several devices per process: rows gathered, reduced in participant order"
        )
    if backend == "cpu":
        raise InvalidArgument("backend 'cpu' takes host arrays; GPU arrays take 'nccl', 'host' or 'auto'")
    problem = _nccl_problem(group, x, op)
    if backend == "nccl":
        if problem:
            raise BackendUnavailable(f"backend 'nccl' over several devices per process: {problem}")
        return Choice("nccl", "requested")
    if backend == "host":
        return Choice("host", "requested")
    if backend == "cuda-aware":
        availability = group.ctx.availability.get("cuda-aware")
        if availability is None or not availability.ok:
            reason = availability.reason if availability else "not probed"
            raise BackendUnavailable(f"backend 'cuda-aware' over several devices per process: {reason}")
        return Choice("cuda-aware", "requested")
    if problem:
        return Choice("host", f"{problem}: host staging")
    return Choice("nccl", "GPU arrays over several devices per process: one NCCL communicator per GPU")


def bind(group: Group, choice: Choice, x: ArrayView, op: Op) -> Callable[[list[Any]], None]:
    """The data movement of calls like ``x``'s on ``choice``'s path, all but the devices' entries fixed:
    called with the entries of a call whose devices have met and whose ranks agreed. Collective on first
    use of a path (the per-GPU NCCL communicators are created here)."""
    if x.size == 0:
        return _nothing
    if group.total == 1:
        return _copy_own
    if choice.backend == "nccl":
        return partial(device_comms(group).allreduce, op=op)
    if choice.backend == "cuda-aware":
        return partial(_gather_fold_on_gpu, group, op=op)
    return partial(_gather_fold, group, op=op)


def _nothing(entries: list[Any]) -> None:
    return None


def _copy_own(entries: list[Any]) -> None:
    """One participant in the job: the result is the input (api's one-rank copy, on the entry's GPU)."""
    entry = entries[0]
    x = entry.x
    if x.device is None:
        copy_single(x, entry.out, None, entry.x_host, entry.out_host)
        return
    from mpigpu.core._cuda import cupy

    with cupy().cuda.Device(x.device):  # whichever thread leads the call
        copy_single(x, entry.out, entry.stream)


def device_comms(group: Group, comm: Any = None) -> DeviceComms:
    """The group's NCCL communicators, one per local GPU, created on first use (collective over ``comm``,
    default the context's: mpigpu.jax creates them on its check communicator while lowering)."""
    comms = group.paths.get("nccl")
    if comms is None:
        comms = group.paths["nccl"] = DeviceComms(group, comm)
    return comms


class DeviceComms:
    """One NCCL communicator per local GPU, each a participant of the job's (collective to create)."""

    def __init__(self, group: Group, comm: Any = None) -> None:
        """``comm``: where the ranks exchange NCCL's id and their failures (default: the context's)."""
        ctx = group.ctx
        comm = ctx.comm if comm is None else comm
        self.gpus = list(group.gpus or [])
        error: BaseException | None = None
        nccl: Any = None
        uid = None
        try:
            from cupy.cuda import nccl

            if ctx.rank == 0:
                uid = nccl.get_unique_id()
        except Exception as exc:
            error = BackendUnavailable(f"NCCL could not prepare per-GPU communicators: {type(exc).__name__}: {exc}")
        fail_together(comm, error, "nccl over several devices per process: preparing")
        uid = comm.bcast(uid, root=0)
        self.comms: list[Any] = []
        try:
            import cupy

            nccl.groupStart()
            try:
                for k, gpu in enumerate(self.gpus):
                    with cupy.cuda.Device(gpu):
                        self.comms.append(nccl.NcclCommunicator(group.total, uid, group.first + k))
            finally:
                nccl.groupEnd()
        except Exception as exc:
            error = BackendUnavailable(f"NCCL could not create per-GPU communicators: {type(exc).__name__}: {exc}")
        fail_together(comm, error, "nccl over several devices per process: creating the communicators")

    def handles(self) -> list[int]:
        """Each GPU's ncclComm_t, in the group's device order (for mpigpu.jax's compiled handler)."""
        return [int(c.comm) for c in self.comms]

    def allreduce(self, entries: list[Any], op: Op) -> None:
        """ncclAllReduce on every local GPU, one NCCL group (one thread drives them all)."""
        from cupy.cuda import nccl

        x = entries[0].x
        count, dtype, how, comms = x.size, x.dtype.nccl, op.nccl, self.comms
        nccl.groupStart()  # each communicator knows its GPU: no device switch between the calls
        try:
            for k, entry in enumerate(entries):
                comms[k].allReduce(entry.x.ptr, entry.out.ptr, count, dtype, how, entry.stream.handle)
        finally:
            nccl.groupEnd()

    def close(self) -> None:
        comms, self.comms = self.comms, []
        for comm in comms:
            comm.destroy()


def _gather_fold(group: Group, entries: list[Any], op: Op) -> None:
    """Every participant's rows on every rank, reduced in participant order (module docstring)."""
    ctx = group.ctx
    x = entries[0].x
    dtype, count = x.dtype, x.size
    rows = np.empty((group.total, count), dtype.np)
    for k, entry in enumerate(entries):
        _to_row(entry, rows[group.first + k])
    if ctx.size > 1:
        from mpigpu.core._mpi import MPI

        row = _row_type(group, count * dtype.itemsize)
        ctx.comm.Allgatherv(MPI().IN_PLACE, [rows, (group.counts, group.offsets), row])
    result = np.empty(count, dtype.np)
    scratch = np.empty(max(1, min(count, CPU_BLOCK // dtype.itemsize)), np.float32)
    reduce_rows(list(rows), op, dtype, group.total, result, final=True, scratch=scratch)
    for entry in entries:
        _from_result(entry, result)


def stream_event(device: int, stream: int) -> int:
    """A new event recorded on ``stream`` of GPU ``device`` (destroy it with ``drop_event``)."""
    from mpigpu.core._cuda import cupy

    cp = cupy()
    rt = cp.cuda.runtime
    with cp.cuda.Device(device):
        event = rt.eventCreateWithFlags(rt.eventDisableTiming)
        rt.eventRecord(event, stream)
    return event


def wait_event(device: int, stream: int, event: int) -> None:
    """``stream`` of GPU ``device`` waits for ``event`` (recorded on any GPU)."""
    from mpigpu.core._cuda import cupy

    cp = cupy()
    with cp.cuda.Device(device):
        cp.cuda.runtime.streamWaitEvent(stream, event, 0)


def drop_event(event: int) -> None:
    from mpigpu.core._cuda import cupy

    cupy().cuda.runtime.eventDestroy(event)


class RowTypes:
    """MPI datatypes of one participant's row (``nbytes`` contiguous bytes), made once per size and freed
    with the communicator's per-device state (Group.close)."""

    LIMIT = 64  # a job of ever-new sizes frees the old ones

    def __init__(self) -> None:
        self._types: dict[int, Any] = {}

    def get(self, nbytes: int) -> Any:
        row = self._types.get(nbytes)
        if row is None:
            if len(self._types) >= self.LIMIT:
                self.close()
            from mpigpu.core._mpi import MPI

            row = self._types[nbytes] = MPI().BYTE.Create_contiguous(nbytes).Commit()
        return row

    def close(self) -> None:
        from mpigpu.core._mpi import MPI

        types, self._types = self._types, {}
        if not MPI().Is_finalized():
            for row in types.values():
                row.Free()


def _row_type(group: Group, nbytes: int) -> Any:
    rows = group.paths.get("row types")
    if rows is None:
        rows = group.paths["row types"] = RowTypes()
    return rows.get(nbytes)


def _gather_fold_on_gpu(group: Group, entries: list[Any], op: Op) -> None:
    """The rows gathered and reduced on the process's first GPU (module docstring: cuda-aware)."""
    import cupy as cp

    from mpigpu.core._cuda import core_stream
    from mpigpu.core._mpi import MPI
    from mpigpu.kernels.compile import i32, i64, launch, load_module

    ctx, x = group.ctx, entries[0].x
    assert group.gpus is not None and ctx.gpu is not None
    stride = -(-x.nbytes // 16) * 16  # rows 16-byte aligned: the kernel reads 16 bytes at a time
    state = group.paths.setdefault("cuda-aware", {})
    lead = group.gpus[0]
    default = cp.cuda.runtime.memcpyDefault
    with cp.cuda.Device(lead):
        rows = state.get("rows")
        if rows is None or rows.nbytes < group.total * stride + stride:
            rows = state["rows"] = cp.empty(group.total * stride + stride, dtype=cp.uint8)
            state["stream"] = cp.cuda.Stream(non_blocking=True)
        stream = state["stream"]
        base = int(rows.data.ptr)
        result = base + group.total * stride
        for k, entry in enumerate(entries):  # each GPU's array into its row, after that GPU's producer
            with cp.cuda.Device(entry.x.device):
                row = base + (group.first + k) * stride
                cp.cuda.runtime.memcpyAsync(row, entry.x.ptr, x.nbytes, default, entry.stream.handle)
            copied = stream_event(entry.x.device, entry.stream.handle)
            wait_event(lead, stream.ptr, copied)
            drop_event(copied)  # freed once the wait is done with it
        stream.synchronize()  # MPI reads the rows only after every copy into them
        if ctx.size > 1:
            view = rows[: group.total * stride]
            ctx.comm.Allgatherv(MPI().IN_PLACE, [view, (group.counts, group.offsets), _row_type(group, stride)])
        major, minor = ctx.gpu.compute_capability
        kernel = load_module("host.cu", f"{major}{minor}").kernel(f"reduce_final_{x.dtype.name}")
        args = (base, i64(stride), i32(group.total), i64(x.size), i32(op.index), i32(group.total), result)
        launch(core_stream(stream.ptr), kernel, max(1, x.nbytes // 16), *args)
    reduced = stream_event(lead, stream.ptr)
    try:
        for entry in entries:  # the result onto each GPU, in its stream's order; the buffers are free on return
            wait_event(entry.out.device, entry.stream.handle, reduced)
            with cp.cuda.Device(entry.out.device):
                cp.cuda.runtime.memcpyAsync(entry.out.ptr, result, x.nbytes, default, entry.stream.handle)
                cp.cuda.runtime.streamSynchronize(entry.stream.handle)
    finally:
        drop_event(reduced)


def _to_row(entry: Any, row: np.ndarray) -> None:
    if entry.x_host is not None:
        row[...] = entry.x_host.reshape(-1)
        return
    x = entry.x
    from mpigpu.core._cuda import cupy

    cp = cupy()
    rt = cp.cuda.runtime
    with cp.cuda.Device(x.device):  # the device's own stream, from whichever thread leads
        rt.memcpyAsync(row.ctypes.data, x.ptr, x.nbytes, rt.memcpyDeviceToHost, entry.stream.handle)
        rt.streamSynchronize(entry.stream.handle)  # the caller's producer is done, and so is the copy


def _from_result(entry: Any, result: np.ndarray) -> None:
    if entry.out_host is not None:
        entry.out_host[...] = result.reshape(entry.out_host.shape)
        return
    out = entry.out
    from mpigpu.core._cuda import cupy

    cp = cupy()
    rt = cp.cuda.runtime
    with cp.cuda.Device(out.device):
        rt.memcpyAsync(out.ptr, result.ctypes.data, out.nbytes, rt.memcpyHostToDevice, entry.stream.handle)
        rt.streamSynchronize(entry.stream.handle)  # ``result`` is freed on return
