"""``ipc``: one-shot and two-shot all-reduce over NVLink for the ranks of one node, with CUDA IPC.

Every rank registers one device allocation (signal flags and two staging buffers) and maps every
peer's into its own address space, once per communicator. A call is one kernel launch (per piece
of at most one staging buffer) on the caller's stream, with no host synchronisation: the kernel
copies the input into the staging buffer (unless it already lives in memory from
``mpigpu.ipc_buffer``), meets the same block of every peer at a flag barrier, and reads the peers'
buffers directly, reducing in rank order so that every rank gets the same bits. The protocol and
its memory-ordering argument are written down at the top of ``kernels/ipc.cu``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mpigpu.backends.base import Availability, Backend, CommContext
from mpigpu.backends.device_scratch import DeviceScratch, reduce_scatter_by_allreduce
from mpigpu.backends.ipc_memory import SharedAllocation, collective_step
from mpigpu.backends.ipc_plan import (
    DEFAULT_MAX_BLOCKS,
    FLAG_TEMP_RESULT,
    MAX_RANKS,
    MAX_THREADS,
    STAGE_BYTES,
    TABLE_OFFSET,
    allocation_bytes,
    default_two_shot_min,
    plan_launches,
)
from mpigpu.core._cuda import core_stream, cupy, require_cuda_core
from mpigpu.core._mpi import MPI
from mpigpu.core.errors import BackendUnavailable, CollectiveTimeout, DeviceError, MismatchError
from mpigpu.core.typed import allgather_ints, allgather_text, allreduce_int

if TYPE_CHECKING:
    from mpigpu.core._cuda import StreamRef
    from mpigpu.core.arrays import ArrayView
    from mpigpu.core.ops import Op

__all__ = ["IpcBackend"]

_PROBE_BYTES = 1  # rounded up to one 2 MiB page
_HOST_ALLOC_PORTABLE_MAPPED = 3  # cudaHostAllocPortable | cudaHostAllocMapped
_EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming
_H2D = 1  # cudaMemcpyHostToDevice
_BARRIERS = ("start", "mid", "end")
_CACHE_LIMIT = 1024


@dataclass
class _Region:
    """Registered memory handed out by ``mpigpu.ipc_buffer``: the block and its address table."""

    alloc: SharedAllocation
    table: int  # device u64[MAX_RANKS]: this rank's block in each rank's address space


def _peer_problem(ctx: CommContext, buses: Sequence[str]) -> str | None:
    """Why this rank's GPU cannot reach the others' (None if it may: the IPC trial decides)."""
    gpu = ctx.gpu
    assert gpu is not None
    if gpu.compute_capability < (7, 0):
        major, minor = gpu.compute_capability
        return f"{gpu.describe()} has compute capability {major}.{minor}; the ipc kernel needs 7.0 or newer"
    try:
        rt = cupy().cuda.runtime
        for bus in buses:
            if bus == gpu.pci_bus_id:
                continue
            try:
                other = rt.deviceGetByPCIBusId(bus)
            except Exception:
                continue  # not visible to this process (CUDA_VISIBLE_DEVICES): the IPC trial decides
            if not rt.deviceCanAccessPeer(gpu.index, other):
                return f"{gpu.describe()} cannot access the GPU at {bus} directly (no NVLink or PCIe peer-to-peer)"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _release(comm: Any, allocations: Sequence[SharedAllocation]) -> list[str]:
    """Free shared blocks (collective): wait for this GPU's work, unmap the peers' blocks, wait
    until every rank has done so (so no kernel still reads ours), then free. Returns the errors."""
    errors = []
    try:
        cupy().cuda.runtime.deviceSynchronize()
    except Exception as exc:
        errors.append(f"synchronising the GPU: {exc}")
    for alloc in allocations:
        try:
            alloc.unmap_peers()
        except Exception as exc:
            errors.append(str(exc))
    if not MPI().Is_finalized():
        comm.Barrier()
    for alloc in allocations:
        try:
            alloc.free()
        except Exception as exc:
            errors.append(f"freeing {alloc.nbytes} B: {exc}")
    return errors


# auto's limit: ipc was as fast as NCCL or faster through 4 MiB on 2 and 4 x H200 (bench/results, 2026-11-21)
AUTO_MAX_BYTES = 4 << 20


class IpcBackend(Backend):
    """Peer-to-peer all-reduce kernel over CUDA IPC mappings (one node, one GPU per rank)."""

    name: ClassVar[str] = "ipc"
    host_arrays: ClassVar[bool] = False
    device_arrays: ClassVar[bool] = True
    enqueues: ClassVar[bool] = True
    graphs: ClassVar[bool] = True
    anchors: ClassVar[Mapping[str, str]] = {"device": "nccl-raw"}
    # reduce_scatter: the allreduce kernel into a scratch buffer, then this rank's rows (allreduce's bits;
    # auto tries nccl's reduceScatter first: mpigpu.backends._FIRST)
    collectives: ClassVar[frozenset[str]] = frozenset({"allreduce", "reduce_scatter"})

    @classmethod
    def auto_declines(cls, on_device: bool, nbytes: int, collective: str = "allreduce") -> str | None:
        return f"message above {AUTO_MAX_BYTES >> 20} MiB" if nbytes > AUTO_MAX_BYTES else None

    # -- availability -------------------------------------------------------------------------------
    @classmethod
    def probe(cls, ctx: CommContext) -> Availability:
        """Collective on every rank: the same collectives run whatever the local outcome."""
        layout = ctx.layout
        if not ctx.all_have_gpus:
            return Availability(False, "needs a GPU on every rank")
        if layout.num_nodes > 1:
            where = "virtual nodes (MPIGPU_NODE_SIZE)" if layout.virtual else "nodes"
            return Availability(
                False, f"the ranks span {layout.num_nodes} {where}; CUDA IPC connects the GPUs of one node only"
            )
        if ctx.size > MAX_RANKS:
            return Availability(False, f"{ctx.size} ranks; the ipc kernel combines at most {MAX_RANKS} GPUs")
        comm = layout.node_comm
        assert ctx.gpu is not None
        buses = allgather_text(comm, ctx.gpu.pci_bus_id)
        if len(set(buses)) < len(buses):
            return Availability(False, "ranks share GPUs (MPIGPU_ALLOW_SHARED_GPU=1); ipc needs one GPU per rank")
        problems = allgather_text(comm, _peer_problem(ctx, buses) or "")  # "": none
        for rank, problem in enumerate(problems):
            if problem:
                return Availability(False, f"node rank {rank}: {problem}")
        try:
            collective_step(comm, "selecting the GPU", ctx.activate_gpu)
            trial = SharedAllocation.create(comm, _PROBE_BYTES, "a probe buffer")
        except BackendUnavailable as exc:
            return Availability(False, f"CUDA IPC between the ranks' GPUs does not work here: {exc}")
        errors = _release(comm, [trial])
        if errors:
            return Availability(False, "releasing the CUDA IPC probe buffer failed: " + "; ".join(errors))
        return Availability(True, f"CUDA IPC between the {ctx.size} GPUs of one node (handles opened on every rank)")

    # -- set-up (collective: every rank creates the backend in the same call) -----------------------
    def __init__(self, ctx: CommContext) -> None:
        super().__init__(ctx)
        layout = ctx.layout
        self._comm = layout.node_comm
        self._rank = layout.local_rank
        self._nranks = layout.local_size
        self._closed = False
        self._regions: list[_Region] = []
        self._calls: dict[tuple[Any, ...], list[tuple[Any, Any, tuple[Any, ...]]]] = {}
        self._last_stream: int | None = None
        self._event = 0
        self._record_host = 0
        self._stage_bytes = STAGE_BYTES
        self.two_shot_min_bytes: int | None = default_two_shot_min(self._nranks)
        self._timeout_ns = int(ctx.settings.timeout * 1e9)
        self._rows = DeviceScratch()  # reduce_scatter's whole result
        gpu = ctx.gpu
        assert gpu is not None
        arch = f"{gpu.compute_capability[0]}{gpu.compute_capability[1]}"
        rt = cupy().cuda.runtime

        def local_setup() -> tuple[Any, int]:
            from mpigpu.kernels.compile import load_module

            ctx.activate_gpu()
            sms = rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, gpu.index)
            return load_module("ipc.cu", arch), int(sms)

        self._module, sms = collective_step(self._comm, "setting up the ipc kernels", local_setup)
        # Launch shapes must be identical on every rank: agree on the smallest GPU.
        self.max_blocks = allreduce_int(self._comm, min(DEFAULT_MAX_BLOCKS, sms), "min")
        self._main = SharedAllocation.create(self._comm, allocation_bytes(self._stage_bytes), "the ipc buffers")
        try:
            collective_step(self._comm, "initialising the ipc buffers", self._local_init)
        except BackendUnavailable:
            self._free_host_side()
            _release(self._comm, [self._main])
            raise

    def _local_init(self) -> None:
        """Write the address table into this rank's signals; pinned timeout record; ordering event."""
        rt = cupy().cuda.runtime
        table = np.zeros(MAX_RANKS, np.uint64)
        table[: self._nranks] = self._main.peers
        rt.memcpy(self._main.base + TABLE_OFFSET, table.ctypes.data, table.nbytes, _H2D)
        self._record_host = rt.hostAlloc(8 * 8, _HOST_ALLOC_PORTABLE_MAPPED)
        self._record = np.ctypeslib.as_array((ctypes.c_uint64 * 8).from_address(self._record_host))
        self._record[:] = 0
        self._record_device = rt.pointerGetAttributes(self._record_host).devicePointer
        self._event = rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING)
        rt.deviceSynchronize()  # the table is on the GPU before any kernel reads it

    def _free_host_side(self) -> None:
        rt = cupy().cuda.runtime
        if self._event:
            event, self._event = self._event, 0
            rt.eventDestroy(event)
        if self._record_host:
            host, self._record_host = self._record_host, 0
            rt.freeHost(host)

    # -- registered memory (mpigpu.ipc_buffer) ------------------------------------------------------
    def register(self, nbytes: int) -> SharedAllocation:
        """``nbytes`` of device memory that every peer has mapped, valid until ``close`` (collective:
        every rank registers the same sizes in the same order). allreduce reads arrays that lie in
        it directly, without the copy into the staging buffer."""
        self._check_open()
        sizes = [size for (size,) in allgather_ints(self._comm, [int(nbytes)])]
        if len(set(sizes)) > 1:
            shown = ", ".join(f"{size} B on rank {rank}" for rank, size in enumerate(sizes))
            raise MismatchError(
                f"ipc_buffer: the ranks asked for different sizes ({shown}). Every rank must allocate the same "
                "buffers in the same order."
            )
        alloc = SharedAllocation.create(self._comm, int(nbytes), "an ipc_buffer")

        def upload() -> int:
            rt = cupy().cuda.runtime
            table = np.zeros(MAX_RANKS, np.uint64)
            table[: self._nranks] = alloc.seen_by
            ptr = rt.malloc(table.nbytes)
            try:
                rt.memcpy(ptr, table.ctypes.data, table.nbytes, _H2D)
                rt.deviceSynchronize()
            except Exception:
                rt.free(ptr)
                raise
            return ptr

        try:
            table_ptr = collective_step(
                self._comm, "writing the ipc_buffer's address table", upload, cupy().cuda.runtime.free
            )
        except BackendUnavailable:
            _release(self._comm, [alloc])
            raise
        self._regions.append(_Region(alloc, table_ptr))
        self._calls.clear()
        return alloc

    def _region_of(self, view: ArrayView) -> tuple[int, int] | None:
        """(address table, byte offset) when ``view`` lies in registered memory."""
        for region in self._regions:
            if region.alloc.contains(view.ptr, view.nbytes):
                return region.table, view.ptr - region.alloc.base
        return None

    # -- calls --------------------------------------------------------------------------------------
    def allreduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None) -> None:
        self._check_open()
        self._enqueue(self._prepared(x, out, op), 0 if stream is None else stream.handle, graph=None)

    def reduce_scatter(self, x: ArrayView, out: ArrayView, op: Op, rows: list[int], stream: StreamRef | None) -> None:
        """The allreduce kernel into a scratch buffer, then this rank's rows, on the stream."""
        reduce_scatter_by_allreduce(self.allreduce, self._rows, x, out, op, rows, self.ctx.rank, stream)

    def bind_allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> Callable[..., None]:
        """The launches built once (rebuilt only if ``two_shot_min_bytes`` changes): a call is the
        ordering check and the kernel launches. (GPU arrays: no host arrays are ever lent.)"""
        bound = [self.two_shot_min_bytes, self._build_calls(x, out, op)]

        def call(stream: StreamRef | None, x_host: Any = None, out_host: Any = None) -> None:
            self._check_open()
            if bound[0] != self.two_shot_min_bytes:
                bound[:] = [self.two_shot_min_bytes, self._build_calls(x, out, op)]
            self._enqueue(bound[1], 0 if stream is None else stream.handle, graph=None)

        return call

    def _prepared(self, x: ArrayView, out: ArrayView, op: Op) -> list[tuple[Any, Any, tuple[Any, ...]]]:
        """(launch config, kernel, arguments) per launch, cached per (buffers, size, dtype, op)."""
        key = (x.ptr, out.ptr, x.size, x.dtype.name, op, self.two_shot_min_bytes)
        calls = self._calls.get(key)
        if calls is None:
            if len(self._calls) >= _CACHE_LIMIT:
                self._calls.clear()
            calls = self._calls[key] = self._build_calls(x, out, op)
        return calls

    def _build_calls(self, x: ArrayView, out: ArrayView, op: Op) -> list[tuple[Any, Any, tuple[Any, ...]]]:
        from mpigpu.kernels.compile import i32, i64

        core = require_cuda_core()
        kernel = self._module.kernel(f"ipc_allreduce_{x.dtype.name}")
        itemsize = x.dtype.itemsize
        region = self._region_of(x)
        flags = FLAG_TEMP_RESULT if region is not None and x.same_memory(out) else 0
        launches = plan_launches(
            x.size,
            itemsize,
            self._nranks,
            stage_bytes=self._stage_bytes,
            two_shot_min_bytes=self.two_shot_min_bytes,
            max_blocks=self.max_blocks,
        )
        calls = []
        for launch in launches:
            offset = launch.first * itemsize
            x_table, x_offset = (region[0], region[1] + offset) if region is not None else (0, 0)
            args = (
                self._main.base, x_table, i64(x_offset), x.ptr + offset, out.ptr + offset,
                i64(launch.count), i64(launch.slice), i64(self._stage_bytes), i32(op.index),
                i32(self._rank), i32(self._nranks), i32(flags), np.uint64(self._timeout_ns), self._record_device,
            )  # fmt: skip
            config = core.LaunchConfig(grid=launch.blocks, block=launch.threads)
            calls.append((config, kernel, args))
        return calls

    def _enqueue(self, calls: list[tuple[Any, Any, tuple[Any, ...]]], handle: int, graph: Any) -> None:
        """Launch ``calls`` (or replay ``graph``) on stream ``handle``, after the previous call.

        Calls must run one after the other on this GPU (each starts from the call number the
        previous one left). On one stream that is stream order; when the stream changes, the new
        stream first waits for the event recorded after the previous call. Work enqueued into a
        stream capture is ordered by its graph, not here."""
        self._check_timeout()
        rt = cupy().cuda.runtime
        capturing = handle != 0 and rt.streamIsCapturing(handle)
        if not capturing and self._last_stream is not None and self._last_stream != handle:
            rt.streamWaitEvent(handle, self._event, 0)
        stream = core_stream(handle)
        try:
            if graph is not None:
                graph.launch(stream)
            else:
                core = require_cuda_core()
                for config, kernel, args in calls:
                    core.launch(stream, config, kernel, *args)
        except Exception as exc:
            self._check_timeout()
            raise DeviceError(f"ipc: launching the allreduce kernel on node rank {self._rank} failed: {exc}") from exc
        if not capturing:
            rt.eventRecord(self._event, handle)
            self._last_stream = handle

    # -- CUDA graphs (mpigpu.ipc_graph) ---------------------------------------------------------------
    def graph_allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> Any:
        """A cuda.core Graph of this call's launches for fixed ``x`` and ``out`` (local)."""
        self._check_open()
        calls = self._prepared(x, out, op)
        device = self.ctx.activate_gpu()
        core = require_cuda_core()
        builder = device.create_graph_builder().begin_building()
        try:
            for config, kernel, args in calls:
                core.launch(builder, config, kernel, *args)
            builder.end_building()
            return builder.complete()
        finally:
            builder.close()

    def launch_graph(self, graph: Any, stream: StreamRef | None) -> None:
        """Replay a graph from ``graph_allreduce`` on ``stream``, ordered after the previous call."""
        self._check_open()
        self._enqueue([], 0 if stream is None else stream.handle, graph=graph)

    # -- errors and clean-up ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable("the ipc backend of this communicator was closed (mpigpu.finalize())")

    def _check_timeout(self) -> None:
        """Raise the message the kernel left when a barrier timed out (MPIGPU_TIMEOUT)."""
        if not self._record_host or not self._record[0]:
            return
        _, barrier, rank, peer, block, target, seen, waited = (int(v) for v in self._record)
        if barrier == 0:  # start flags hold 2 x call + direct
            target, seen = target // 2, seen // 2
        raise CollectiveTimeout(
            f"ipc: node rank {rank} (block {block}) waited {waited / 1e9:.1f} s at the {_BARRIERS[barrier]} "
            f"barrier of call {target} for node rank {peer}, which had reached call {seen} only "
            f"(MPIGPU_TIMEOUT={self.ctx.settings.timeout:g}). The ranks did not make the same allreduce calls, "
            "or one stopped. The kernel trapped, so this process's CUDA context is unusable: end the job."
        )

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (collective: called from CommContext.close)."""
        if self._closed:
            return
        self._closed = True
        self._calls.clear()
        errors = []
        rt = cupy().cuda.runtime
        try:
            self.ctx.activate_gpu()
        except Exception as exc:
            errors.append(f"selecting the GPU: {exc}")
        errors += _release(self._comm, [self._main, *(r.alloc for r in self._regions)])
        for region in self._regions:
            try:
                rt.free(region.table)
            except Exception as exc:
                errors.append(f"freeing an address table: {exc}")
        self._regions.clear()
        self._rows.close()
        try:
            self._free_host_side()
        except Exception as exc:
            errors.append(f"freeing the event and timeout record: {exc}")
        if errors:
            raise DeviceError("ipc: clean-up failed: " + "; ".join(errors))

    def describe(self) -> dict[str, Any]:
        return {
            "ranks": self._nranks,
            "staging_bytes": self._stage_bytes,
            "two_shot_min_bytes": self.two_shot_min_bytes,
            "max_blocks": self.max_blocks,
            "threads": MAX_THREADS,
            "registered_buffers": len(self._regions),
            "barrier_timeout_s": self._timeout_ns / 1e9,
        }
