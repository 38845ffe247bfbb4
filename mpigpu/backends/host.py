"""Host staging: reduce through node-shared host memory; MPI only between nodes.

The ranks of a node share one pinned segment (``mpigpu.job.shm``). Each rank copies its data into its
own slot; each rank then reduces its own slice of the message across every slot (fixed rank order
0..n-1) into a shared result area; every rank copies the whole result back. Every element is
computed once, so the result is bitwise identical on every rank by construction.

Two routes:

- pipeline: the message streams through a ring of chunk positions, one barrier per chunk. For GPU
  arrays the copy engines move chunk k+1 out (device -> pinned host) while the GPU reduces chunk k
  by reading every slot directly from mapped host memory (``kernels/host.cu``) and chunk k-1 is
  copied back, each on its own stream, ordered by CUDA events. For NumPy arrays the same schedule
  runs with host copies and a NumPy reduction.
- latency (messages up to ``MPIGPU_HOST_SMALL``): copy in, one barrier, every rank reduces the whole
  message itself, copy out; slots alternate between two sets by call parity, so one barrier per
  call is enough.

Several nodes (real, or virtual through ``MPIGPU_NODE_SIZE``), of any sizes: the node's partial
result (unfinished: float32 for float16/bfloat16, the exact average's 64-bit parts for integer avg)
crosses nodes over MPI between ranks of equal local rank, each on its own slice of the chunk. The
chunk is split into as many slices as the smallest node has ranks, so every member of an exchange
holds the same slice; on a node of that size each rank exchanges the slice it reduced, on a larger
one the first ranks exchange after a barrier. Every node cuts the same chunks (the pool cap is the
smallest node's). The exchange folds the node partials in node order (host_reduce.internode), never
through a plain MPI_Allreduce: a float sum is rank order within each node, then node order, and
every element is again computed once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from mpigpu.backends.base import Availability, Backend, CommContext
from mpigpu.backends.host_engine import DeviceEngine, Engine, GpuStaging, HostEngine
from mpigpu.backends.host_layout import ALIGN, PAGE, ChunkPlan, SegmentLayout, round_up, split_even
from mpigpu.backends.host_reduce import (
    CPU_BLOCK,
    Stacked,
    finish,
    internode,
    partial_type,
    reduce_stacked,
    stacked_reducer,
)
from mpigpu.backends.mpi_moves import allgather_bytes, alltoall_bytes, broadcast_bytes, byte_counts, row_bytes
from mpigpu.core.config import size_label
from mpigpu.core.errors import BackendUnavailable, ConfigError, InvalidArgument, MpigpuError
from mpigpu.core.ops import Op
from mpigpu.core.typed import allreduce_int

if TYPE_CHECKING:
    from mpigpu.core._cuda import StreamRef
    from mpigpu.core.arrays import ArrayView
    from mpigpu.core.dtypes import DType
    from mpigpu.job.shm import SharedSegment

__all__ = ["AUTO_HOST_MIN_BYTES", "AUTO_HOST_WINDOWS", "HostBackend"]

GPU_CHUNK = 4 << 20  # default pipeline chunk for GPU arrays
GPU_MIN_CHUNK = 1 << 20  # mid-size GPU messages split into chunks no smaller than this ...
GPU_MIN_CHUNKS = 4  # ... and into at least this many, so copies and reduction overlap
CPU_CHUNK = 16 << 20  # default pipeline chunk for NumPy arrays (measured: docs/host.md)


@dataclass(frozen=True)
class _SmallViews:
    """The latency route's slots of one parity, for one dtype and count."""

    rows: np.ndarray  # every rank's input slot: ranks x count, strided over the segment
    mine: np.ndarray  # this rank's input slot
    result: np.ndarray  # this rank's output slot
    shared: np.ndarray  # the node leader's output slot
    mine_ptr: int  # addresses of this rank's input slot, its output slot, the leader's output slot
    result_ptr: int
    shared_ptr: int


# -- the backend ----------------------------------------------------------------------------------
# auto's rules for host arrays: the measured crossovers with the cpu backend (MPICH's MPI_Allreduce plus
# its NaN read) on the 2-core machine with no GPU, user calls interleaved (docs/host.md;
# bench/results/cpu-crossover-2026-11-27.txt). host from 32 MiB (bench/results/cpu-crossover-2026-11-26.txt),
# and in two windows: its latency route from 32 KiB to that route's default limit (64 KiB; MPIGPU_HOST_SMALL),
# and from 2 MiB (its pipeline). At 64 KiB and 2 MiB host beat cpu in both quiet runs and in most loaded
# ones; from 3 to 16 MiB in every run of 2026-11-28 (two to six a size, host / cpu 0.71-0.97: bench/results/
# cpu-allreduce-2026-11-28.txt), at load 1.5-3.1; at 8 B and 256 KiB to 1 MiB cpu wins
AUTO_HOST_MIN_BYTES = 32 << 20
AUTO_HOST_WINDOWS: tuple[tuple[int, int], ...] = ((32 << 10, 64 << 10), (2 << 20, 32 << 20))


class HostBackend(Backend):
    """Host staging through node-shared pinned memory, for NumPy and GPU arrays."""

    name: ClassVar[str] = "host"
    host_arrays: ClassVar[bool] = True
    device_arrays: ClassVar[bool] = True
    anchors: ClassVar[Mapping[str, str]] = {"device": "seed-staging", "host": "mpi-host"}
    collectives: ClassVar[frozenset[str]] = frozenset(
        {"allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall"}
    )

    @classmethod
    def auto_declines(cls, on_device: bool, nbytes: int, collective: str = "allreduce") -> str | None:
        """The windows are the reductions' only: the data-movement collectives move host arrays through
        the same MPI calls on either backend, and allgather's sizes differ between ranks, which a
        window could split."""
        if on_device or nbytes >= AUTO_HOST_MIN_BYTES:
            return None
        if collective not in ("allreduce", "reduce_scatter"):
            return f"message below {size_label(AUTO_HOST_MIN_BYTES)} (MPI is as fast there)"
        if any(lo <= nbytes <= hi for lo, hi in AUTO_HOST_WINDOWS):
            return None
        windows = ", ".join(f"{size_label(lo)}-{size_label(hi)}" for lo, hi in AUTO_HOST_WINDOWS)
        return f"message below {size_label(AUTO_HOST_MIN_BYTES)} and outside {windows} (MPI_Allreduce is faster there)"

    def __init__(self, ctx: CommContext) -> None:
        super().__init__(ctx)
        layout = ctx.layout
        self._n = layout.local_size
        self._local = layout.local_rank
        self._nodes = layout.num_nodes
        self._across = min(layout.node_sizes)  # ranks per node in the exchange across nodes
        self._inter = layout.inter_comm
        self._inter_size = 1 if self._inter is None else self._inter.Get_size()
        s = ctx.settings  # equal on every rank: agreed at start-up (config.Settings.agreed)
        self._pool = s.host_pool_bytes
        self._chunk_setting = s.host_chunk
        self._depth = s.host_depth
        self._small_limit = s.host_small
        self._small = round_up(self._small_limit, PAGE)
        partial = self._nodes > 1
        # The smallest node's cap (a node of fewer ranks has less pool): every node then cuts the same
        # chunks, so their exchanges across nodes pair, and every rank reaches the same verdict below.
        n = min(layout.node_sizes, key=lambda size: SegmentLayout.max_stride(size, self._small, partial, self._pool))
        self._max_stride = SegmentLayout.max_stride(n, self._small, partial, self._pool)
        rings = max(DeviceEngine.ring_for(self), HostEngine.ring_for(self))
        self._min_stride = rings * PAGE
        if self._max_stride < self._min_stride:
            areas = n + 1 + (2 if partial else 0)
            need = -(-(4 * n * self._small + rings * areas * PAGE) // (n << 20))
            small_mb = -(-4 * self._small // (1 << 20))
            ring_mb = -(-rings * areas * PAGE // (n << 20))
            raise ConfigError(
                f"MPIGPU_HOST_POOL_MB={self._pool >> 20} is too small for the host path's shared segment with "
                f"{n} ranks per node: MPIGPU_HOST_SMALL={self._small_limit} takes {small_mb} MiB per rank "
                f"and MPIGPU_HOST_DEPTH={self._depth} (a ring of {rings} chunk slots) {ring_mb} MiB per rank. Give "
                f"MPIGPU_HOST_POOL_MB at least {need}, or lower MPIGPU_HOST_DEPTH or MPIGPU_HOST_SMALL"
            )
        self._segment: SharedSegment | None = None
        self._layout: SegmentLayout | None = None
        self._gpu: GpuStaging | None = None
        self._parity = 0
        self._buffers: dict[str, np.ndarray] = {}
        # float32 scratch for a half type: one reduction block (reduce_rows), a whole latency-route message
        self._block = np.empty(max(CPU_BLOCK, self._small) // 2, np.float32)
        self._small_cache: dict[tuple[int, str, int], _SmallViews] = {}
        self._phases: dict[str, float] = {}  # seconds
        self._pinned: Any = None  # broadcast/allgather of GPU arrays: a private pinned staging buffer
        self._pinned_free = 0  # event: the last copy out of _pinned to the GPU finished
        self._phase_names = ("copy_out", "reduce", "copy_in", "barrier") + (("internode",) if self._nodes > 1 else ())
        self._closed = False

    # -- Backend protocol -----------------------------------------------------------------------
    @classmethod
    def probe(cls, ctx: CommContext) -> Availability:
        from mpigpu.job.shm import SharedSegment

        try:
            SharedSegment(ctx.layout.node_comm, PAGE).close()
        except MpigpuError as exc:
            return Availability(False, str(exc))
        except Exception as exc:  # the MPI library's own error
            return Availability(False, f"MPI-3 shared-memory windows do not work on this node: {exc}")
        layout = ctx.layout
        where = f"{layout.local_size} rank(s) per node" + (
            f", {layout.num_nodes} nodes (MPI between nodes)" if layout.num_nodes > 1 else ""
        )
        return Availability(True, f"node-shared memory (MPI-3 window), {where}")

    def allreduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None) -> None:
        self._reduce(x, out, op, stream, (0, x.size))

    def bind_allreduce(self, x: ArrayView, out: ArrayView, op: Op) -> Callable[..., None]:
        """NumPy arrays on one node that take the latency route: the route run on the arrays each call
        lends, what ``_reduce`` works out per call (support, size, route) worked out here once and no
        view made per call. Every other call as the base class binds it."""
        if x.on_device or self._nodes > 1 or not 0 < x.nbytes <= self._small_limit:
            return super().bind_allreduce(x, out, op)
        if self.supports_on(self.ctx, x.dtype, op):  # raised by every call, as ``_reduce`` raises it
            return super().bind_allreduce(x, out, op)
        dtype, count, own_x, own_out = x.dtype, x.size, x.host, out.host
        reduce = stacked_reducer(op, dtype, self.ctx.size, self._block)

        def call(stream: StreamRef | None, x_host: Any = None, out_host: Any = None) -> None:
            if x_host is None:
                x_host, out_host = own_x, own_out
            self._refuse_closed()
            self._phases = dict.fromkeys(self._phase_names, 0.0)  # the same keys on every rank
            self._ensure_segment(0, False)
            self._latency_numpy(x_host.reshape(-1), out_host.reshape(-1), dtype, count, reduce)

        return call

    def reduce_scatter(self, x: ArrayView, out: ArrayView, op: Op, rows: list[int], stream: StreamRef | None) -> None:
        """The node-shared reduction of allreduce (the same bits), each rank copying back only its
        own rows."""
        counts, displs = byte_counts(rows, row_bytes(x.shape, x.dtype.itemsize))
        mine, item = self.ctx.rank, x.dtype.itemsize
        self._reduce(x, out, op, stream, (displs[mine] // item, (displs[mine] + counts[mine]) // item))

    def _reduce(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None, window: tuple[int, int]) -> None:
        """Reduce x across ranks; elements ``window`` (lo, hi) of the result into ``out``."""
        problem = self.supports_on(self.ctx, x.dtype, op)  # the same verdict on every rank: no collective
        if problem:
            raise InvalidArgument(problem)
        if self._closed:
            raise BackendUnavailable(
                "this host backend was closed by mpigpu.finalize(); mpigpu.allreduce() starts a new one"
            )
        if self._gpu is not None:
            self._gpu.fold()  # the last pipeline's copies back are done: its ring positions are free
        self._phases = dict.fromkeys(self._phase_names, 0.0)  # the same keys on every rank
        nbytes = x.nbytes
        if x.on_device:
            assert stream is not None
            self._ensure_gpu()
        if nbytes <= self._small_limit:
            self._ensure_segment(0, x.on_device)
            self._latency(x, out, op, stream, window)
            return
        ring = (DeviceEngine if x.on_device else HostEngine).ring_for(self)
        acc, words = partial_type(x.dtype, op)
        widen = acc.itemsize * words // x.dtype.itemsize if self._nodes > 1 else 1  # partial bytes per byte
        chunk = self._chunk_bytes(nbytes, x.on_device, ring, widen)
        self._ensure_segment(ring * chunk * max(2, widen) // 2, x.on_device)  # a partial area that holds it
        plan = ChunkPlan(count=x.size, chunk=chunk // x.dtype.itemsize, ranks=self._n, align=ALIGN // x.dtype.itemsize)
        if x.on_device:
            assert stream is not None
            engine: Engine = DeviceEngine(self, x, out, op, plan, window, stream.handle)
        else:
            engine = HostEngine(self, x, out, op, plan, window)
        self._pipeline(engine)
        engine.finish_call()

    @property  # type: ignore[override]
    def last_phases(self) -> dict[str, float]:
        """Per-phase microseconds of the last call. GPU pipeline: busy time of each phase summed
        over chunks, from CUDA events (resolved when read); elsewhere host clocks."""
        if self._gpu is not None and self._gpu.pending:
            for name, seconds in self._gpu.fold().items():
                self._phases[name] += seconds
        return {name: seconds * 1e6 for name, seconds in self._phases.items()}

    @last_phases.setter
    def last_phases(self, value: dict[str, float]) -> None:
        self._phases = {name: us * 1e-6 for name, us in value.items()}

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "transport": "node-shared memory (MPI-3 window)",
            "ranks_per_node": self._n,
            "nodes": self._nodes,
            "internode": "none" if self._nodes == 1 else f"per slice, {self._across} slices per chunk",
            "latency_route_max_bytes": self._small_limit,
            "chunk_bytes": self._chunk_setting or f"default (GPU {GPU_CHUNK}, NumPy {CPU_CHUNK})",
            "depth": self._depth,
            "pool_cap_bytes_per_rank": self._pool,
        }
        if self._layout is not None:
            info["segment_bytes"] = self._layout.total
            info["pinned"] = bool(self._segment is not None and self._segment.registered)
        return info

    # -- broadcast and allgather: MPI on host memory; GPU arrays staged through a private pinned
    # buffer (not the node-shared segment yet: one copy out, MPI, one copy in) -------------------
    def broadcast(self, x: ArrayView, root: int, stream: StreamRef | None) -> None:
        """MPI_Bcast of x's bytes from ``root`` (GPU arrays: through pinned host memory)."""
        self._refuse_closed()
        comm = self.ctx.comm
        if x.host is not None:
            broadcast_bytes(comm, x.host.reshape(-1).view(np.uint8), x.nbytes, root)
            return
        stage = self._pinned_buffer(x.nbytes)
        runtime, handle = self._runtime(), 0 if stream is None else stream.handle
        if self.ctx.rank == root:
            runtime.memcpyAsync(stage.ctypes.data, x.ptr, x.nbytes, runtime.memcpyDeviceToHost, handle)
            runtime.streamSynchronize(handle)
        broadcast_bytes(comm, stage, x.nbytes, root)
        if self.ctx.rank != root:
            self._copy_in(x.ptr, stage, x.nbytes, handle)

    def allgather(self, x: ArrayView, out: ArrayView, rows: list[int], stream: StreamRef | None) -> None:
        """MPI_Allgatherv into ``out`` (GPU arrays: this rank's rows copied into its place in a pinned
        buffer of the whole result, gathered in place, then copied to ``out`` on the stream)."""
        self._refuse_closed()
        comm, row_bytes = self.ctx.comm, out.nbytes // sum(rows)
        if x.host is not None and out.host is not None:
            send, recv = x.host.reshape(-1).view(np.uint8), out.host.reshape(-1).view(np.uint8)
            allgather_bytes(comm, send, recv, rows, row_bytes)
            return
        stage = self._pinned_buffer(out.nbytes)
        runtime, handle = self._runtime(), 0 if stream is None else stream.handle
        counts, displs = byte_counts(rows, row_bytes)
        mine = displs[self.ctx.rank]
        if x.nbytes:
            runtime.memcpyAsync(stage.ctypes.data + mine, x.ptr, x.nbytes, runtime.memcpyDeviceToHost, handle)
        runtime.streamSynchronize(handle)
        from mpigpu.core._mpi import MPI

        byte = MPI().BYTE
        comm.Allgatherv(MPI().IN_PLACE, [stage, (counts, displs), byte])
        self._copy_in(out.ptr, stage, out.nbytes, handle)

    def alltoall(
        self, x: ArrayView, out: ArrayView, send_rows: list[int], recv_rows: list[int], stream: StreamRef | None
    ) -> None:
        """MPI_Alltoallv (GPU arrays: x copied into a pinned buffer, exchanged into another part of
        it, then copied to ``out`` on the stream). Sizes differ between ranks, so the pinned
        buffer's size is agreed first (one MPI_Allreduce): it grows on every rank or on none."""
        self._refuse_closed()
        comm, size = self.ctx.comm, row_bytes(x.shape, x.dtype.itemsize)
        if x.host is not None and out.host is not None:
            send, recv = x.host.reshape(-1).view(np.uint8), out.host.reshape(-1).view(np.uint8)
            alltoall_bytes(comm, send, recv, send_rows, recv_rows, size)
            return
        split = round_up(x.nbytes, PAGE)
        stage = self._pinned_buffer(allreduce_int(comm, split + out.nbytes, "max"))  # typed: releases the GIL
        runtime, handle = self._runtime(), 0 if stream is None else stream.handle
        if x.nbytes:
            runtime.memcpyAsync(stage.ctypes.data, x.ptr, x.nbytes, runtime.memcpyDeviceToHost, handle)
        runtime.streamSynchronize(handle)
        alltoall_bytes(comm, stage[: x.nbytes], stage[split : split + out.nbytes], send_rows, recv_rows, size)
        self._copy_in(out.ptr, stage[split:], out.nbytes, handle)

    def _refuse_closed(self) -> None:
        if self._closed:
            raise BackendUnavailable("this host backend was closed by mpigpu.finalize(); a new call starts a new one")

    @staticmethod
    def _runtime() -> Any:
        from mpigpu.core._cuda import cupy

        return cupy().cuda.runtime

    def _pinned_buffer(self, nbytes: int) -> np.ndarray:
        """The pinned staging buffer (at least ``nbytes``), once the last copy out of it is done.
        Collective when it grows (``nbytes`` is the same on every rank): a rank that cannot pin
        memory raises, the others a MismatchError, instead of waiting in MPI."""
        runtime = self._runtime()
        if self._pinned_free:
            runtime.eventSynchronize(self._pinned_free)  # the previous call's copy in has read it
        if self._pinned is None or self._pinned.nbytes < nbytes:

            def grow() -> None:
                from mpigpu.core._cuda import cupy

                self._pinned = None
                memory = cupy().cuda.alloc_pinned_memory(max(nbytes, PAGE))
                self._pinned = np.frombuffer(memory, np.uint8, max(nbytes, PAGE))
                if not self._pinned_free:
                    self._pinned_free = runtime.eventCreateWithFlags(runtime.eventDisableTiming)

            self._collective_step("pinning a staging buffer for broadcast/allgather", grow)
        assert self._pinned is not None
        return self._pinned[:nbytes]

    def _copy_in(self, ptr: int, stage: np.ndarray, nbytes: int, handle: int) -> None:
        """Copy the staged bytes to the GPU on the caller's stream; the next call waits for it."""
        runtime = self._runtime()
        runtime.memcpyAsync(ptr, stage.ctypes.data, nbytes, runtime.memcpyHostToDevice, handle)
        runtime.eventRecord(self._pinned_free, handle)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pinned_free:
            with contextlib.suppress(Exception):
                self._runtime().eventSynchronize(self._pinned_free)
                self._runtime().eventDestroy(self._pinned_free)
            self._pinned_free = 0
        self._pinned = None
        self._release_segment(at_exit=True)
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        self._buffers.clear()

    # -- phases ---------------------------------------------------------------------------------
    def _add_phase(self, name: str, seconds: float) -> None:
        self._phases[name] += seconds

    def _barrier(self) -> None:
        assert self._segment is not None
        t0 = time.perf_counter()
        self._segment.barrier()
        self._add_phase("barrier", time.perf_counter() - t0)

    # -- resources ------------------------------------------------------------------------------
    def _scratch(self, name: str, nbytes: int) -> np.ndarray:
        """A reused private byte buffer of at least ``nbytes``."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self._buffers[name] = np.empty(max(nbytes, 64), np.uint8)
        return buffer

    def _collective_step(self, what: str, action: Callable[[], None]) -> None:
        """Run ``action`` on every rank (collective): where it failed, that rank raises its error and
        every other rank a MismatchError naming it, so no rank waits in the next barrier."""
        from mpigpu.job.check import fail_together

        error: BaseException | None = None
        try:
            action()
        except (MpigpuError, ImportError, RuntimeError, OSError) as exc:
            error = exc
        fail_together(self.ctx.comm, error, f"host backend: {what}")

    def _ensure_gpu(self) -> None:
        """Streams, events and the kernel module, created collectively on the first GPU call."""
        if self._gpu is not None:
            return

        def create() -> None:
            self._gpu = GpuStaging(self.ctx)

        try:
            self._collective_step("setting up the GPU staging (streams, events, kernels)", create)
        except MpigpuError:
            if self._gpu is not None:
                self._gpu.close()
                self._gpu = None
            raise

    def _chunk_bytes(self, nbytes: int, on_device: bool, ring: int, widen: int) -> int:
        """Pipeline chunk for a message: the setting if given, else the default (GPU: split for mid
        sizes), never above what ``ring`` positions within the pool cap can hold, nor above what the
        partial area (twice a position) holds of a partial ``widen`` times the message's bytes."""
        if self._chunk_setting:
            chunk = self._chunk_setting
        elif on_device:
            chunk = min(GPU_CHUNK, max(GPU_MIN_CHUNK, -(-nbytes // GPU_MIN_CHUNKS)))
        else:
            chunk = CPU_CHUNK
        position = self._max_stride // ring // PAGE * PAGE
        return min(round_up(min(chunk, nbytes), PAGE), position * 2 // max(2, widen))

    def _ensure_segment(self, stride: int, on_device: bool) -> None:
        """A segment whose slots hold at least ``stride`` bytes (collective; grows by reallocating,
        at least doubling, up to the pool cap), pinned for CUDA when GPU arrays use it."""
        current = self._layout
        grow = current is None or current.stride < stride
        if not grow and (not on_device or (self._segment is not None and self._segment.registered)):
            return  # the common case, on every call
        if grow:
            from mpigpu.job.shm import SharedSegment

            old = 0 if current is None else current.stride
            layout = SegmentLayout(
                self._n, max(stride, self._min_stride, min(2 * old, self._max_stride)), self._small, self._nodes > 1
            )
            self._release_segment()

            def create() -> None:
                self._segment = SharedSegment(self.ctx.layout.node_comm, layout.total)
                self._layout = layout
                self._first_touch()

            self._collective_step(f"allocating the {layout.total}-byte node-shared segment", create)
        segment = self._segment
        assert segment is not None
        if grow:
            segment.barrier()  # every rank's first touch is done
        if on_device and not segment.registered:

            def pin() -> None:
                segment.register()

            self._collective_step("pinning the node-shared segment for CUDA", pin)

    def _first_touch(self) -> None:
        """Each rank touches the areas it writes, so their pages sit near it (NUMA)."""
        assert self._segment is not None and self._layout is not None
        layout, me = self._layout, self._local
        for parity in (0, 1):
            self._segment.touch(layout.small_in(parity, me), layout.small)
            self._segment.touch(layout.small_out(parity, me), layout.small)
        self._segment.touch(layout.slot(me, 0), layout.stride)
        lo, hi = split_even(layout.stride, self._n, PAGE)[me]  # a share of the areas every rank writes
        self._segment.touch(layout.result(lo), hi - lo)
        if layout.partial:
            self._segment.touch(layout.partial_at(lo), 2 * (hi - lo))

    def _release_segment(self, *, at_exit: bool = False) -> None:
        """Wait for every copy that still reads or writes the segment, then free it (collective).
        at_exit: the CUDA context may already be gone; the segment is freed regardless."""
        if self._gpu is not None:
            try:
                self._gpu.fold()
                for parity in (0, 1):
                    self._gpu.settle_small(parity)
            except Exception:
                if not at_exit:
                    raise
        self._small_cache.clear()
        if self._segment is not None:
            self._segment.close()
        self._segment = None
        self._layout = None

    # -- the latency route ----------------------------------------------------------------------
    def _small_views(self, parity: int, dtype: DType, count: int) -> _SmallViews:
        """The latency route's slots for one call shape (cached: views cost more than the copy)."""
        key = (parity, dtype.name, count)
        views = self._small_cache.get(key)
        if views is None:
            segment, layout, me = self._segment, self._layout, self._local
            assert segment is not None and layout is not None
            if len(self._small_cache) >= 64:
                self._small_cache.clear()
            span = count + (self._n - 1) * layout.small // dtype.itemsize  # rank 0's slot through the last one's
            first = segment.view(layout.small_in(parity, 0), span, dtype.np)
            rows = np.lib.stride_tricks.as_strided(
                first, shape=(self._n, count), strides=(layout.small, dtype.itemsize), writeable=False
            )
            views = self._small_cache[key] = _SmallViews(
                rows=rows,
                mine=segment.view(layout.small_in(parity, me), count, dtype.np),
                result=segment.view(layout.small_out(parity, me), count, dtype.np),
                shared=segment.view(layout.small_out(parity, 0), count, dtype.np),
                mine_ptr=segment.ptr + layout.small_in(parity, me),
                result_ptr=segment.ptr + layout.small_out(parity, me),
                shared_ptr=segment.ptr + layout.small_out(parity, 0),
            )
        return views

    def _latency(self, x: ArrayView, out: ArrayView, op: Op, stream: StreamRef | None, window: tuple[int, int]) -> None:
        """Copy in, one barrier, every rank reduces the whole message, copy out its ``window``.
        The whole message, not only the window: NumPy's vector loop and its scalar tail may pick a
        different NaN of NaN + NaN, so only the same call gives allreduce's bits. Every step here
        costs microseconds that the 8-byte time is made of: keep it lean."""
        if x.host is not None and self._nodes == 1 and window == (0, x.size):  # the usual NumPy call
            assert out.host is not None
            reduce = stacked_reducer(op, x.dtype, self.ctx.size, self._block)
            self._latency_numpy(x.host.reshape(-1), out.host.reshape(-1), x.dtype, x.size, reduce)
            return
        parity = self._parity
        self._parity ^= 1
        gpu, phases, segment = self._gpu, self._phases, self._segment
        assert segment is not None
        dtype, me = x.dtype, self._local
        nbytes, (lo, hi) = x.nbytes, window
        whole = lo == 0 and hi == x.size
        views = self._small_views(parity, dtype, nbytes // dtype.itemsize)
        t0 = time.perf_counter()
        if gpu is not None and x.on_device:
            assert stream is not None
            gpu.settle_small(parity)  # the copy back of two calls ago has read its slot
            gpu.rt.memcpyAsync(views.mine_ptr, x.ptr, nbytes, gpu.memcpy_d2h, stream.handle)
            gpu.rt.streamSynchronize(stream.handle)
            result, result_ptr = views.result, views.result_ptr  # reduced here, copied back below
        else:
            assert x.host is not None and out.host is not None
            np.copyto(views.mine, x.host.reshape(-1))
            result = out.host.reshape(-1) if whole else self._scratch("window", nbytes)[:nbytes].view(dtype.np)
        t1 = time.perf_counter()
        segment.barrier()
        t2 = time.perf_counter()
        phases["copy_out"] += t1 - t0
        phases["barrier"] += t2 - t1
        if self._nodes == 1:
            reduce_stacked(views.rows, op, dtype, self.ctx.size, result, final=True, scratch=self._block)
            phases["reduce"] += time.perf_counter() - t2
        elif self._n == self._across:  # every rank exchanges the node's partial with its peers on the other nodes
            self._latency_internode(views.rows, op, dtype, result, t2)
        else:  # a larger node: its first ranks exchange, as the smallest node's do; the others (and rank
            # 0, which exchanges into its shared slot) take rank 0's result from that slot
            taker = me == 0 or me >= self._across
            if me < self._across:
                self._latency_internode(views.rows, op, dtype, views.shared if me == 0 else result, t2)
            self._barrier()
            if taker and x.on_device:
                result_ptr = views.shared_ptr
            elif taker:
                np.copyto(result, views.shared)
        t3 = time.perf_counter()
        if gpu is not None and x.on_device:
            assert stream is not None
            size = dtype.itemsize
            gpu.rt.memcpyAsync(out.ptr, result_ptr + lo * size, (hi - lo) * size, gpu.memcpy_h2d, stream.handle)
            gpu.rt.eventRecord(gpu.small_done[parity], stream.handle)
            gpu.small_pending[parity] = True
        elif not whole:
            assert out.host is not None
            np.copyto(out.host.reshape(-1), result[lo:hi])
        phases["copy_in"] += time.perf_counter() - t3

    def _latency_numpy(self, src: np.ndarray, dst: np.ndarray, dtype: DType, count: int, reduce: Stacked) -> None:
        """``_latency`` for NumPy arrays on one node, the whole result into ``dst`` (flat): copy in, one
        barrier, this rank's reduction of every rank's slot (``reduce``: ``stacked_reducer``'s)."""
        parity = self._parity
        self._parity ^= 1
        segment, phases = self._segment, self._phases
        assert segment is not None
        views = self._small_views(parity, dtype, count)
        clock = time.perf_counter
        t0 = clock()
        np.copyto(views.mine, src)
        t1 = clock()
        segment.barrier()
        t2 = clock()
        reduce(views.rows, dst)
        phases["copy_out"] += t1 - t0
        phases["barrier"] += t2 - t1
        phases["reduce"] += clock() - t2

    def _latency_internode(self, rows: np.ndarray, op: Op, dtype: DType, dst: np.ndarray, t0: float) -> None:
        """dst = the node's partial over ``rows``, reduced across nodes, finished."""
        acc_np, words = partial_type(dtype, op)
        nbytes = rows.shape[1] * words * acc_np.itemsize
        acc = self._scratch("partial", nbytes)[:nbytes].view(acc_np)
        reduce_stacked(rows, op, dtype, self.ctx.size, acc, final=False, scratch=self._block)
        t1 = time.perf_counter()
        self._add_phase("reduce", t1 - t0)
        internode(self._inter, acc, op, self._scratch("gather", self._inter_size * nbytes))
        finish(acc, op, dtype, self.ctx.size, dst)
        self._add_phase("internode", time.perf_counter() - t1)

    # -- the pipeline ---------------------------------------------------------------------------
    def _pipeline(self, engine: Engine) -> None:
        """One barrier per chunk. Barrier k certifies, on every rank of the node: chunk k is in
        every slot, chunk k-1 is reduced (and, on several nodes, reduced across nodes), and the
        copy back that last read chunk k's result position has finished. So after it: chunk k-1
        can be copied back, chunk k reduced, and slots up to chunk k+ring-1 refilled."""
        ring = engine.ring
        chunks = engine.plan.chunks
        ahead = min(self._depth, ring - 1)
        staged = 0

        def stage(limit: int) -> None:
            nonlocal staged
            while staged < min(limit, chunks):
                engine.put(staged)
                staged += 1

        # A node of the smallest size exchanges the very slice each rank reduced, right after reducing it;
        # a larger node's slices differ from the exchange's, so its first ranks exchange after a barrier.
        several, by_slice = self._nodes > 1, self._n == self._across
        stage(ahead + 1)  # every slot position is free: the last call ended with a barrier
        for k in range(chunks + 1):
            if k > 0:
                engine.wait_reduce(k - 1)
                if several and by_slice:
                    engine.internode(k - 1, *engine.my_slice(k - 1))
            if k < chunks:
                engine.wait_put(k)
                engine.wait_get(k - ring)
            self._barrier()
            if k > 0 and several and not by_slice:
                engine.internode(k - 1, *engine.across_slice(k - 1))
                self._barrier()
            if k > 0:
                engine.get(k - 1)
            if k < chunks:
                engine.reduce(k)
            stage(k + ahead + 1)
