"""The host backend's pipeline engines: what one chunk position does in each step (copy out, reduce
across the node's slots, copy back), for NumPy arrays (``HostEngine``) and GPU arrays
(``DeviceEngine``, with ``GpuStaging``'s copy streams and events). ``HostBackend._pipeline``
(mpigpu.backends.host) drives them; the segment, the barriers and the latency route stay there.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from mpigpu.backends.host_layout import PAGE, ChunkPlan, SegmentLayout, split_even
from mpigpu.backends.host_reduce import finish, internode, partial_type, reduce_rows
from mpigpu.core.ops import Op

if TYPE_CHECKING:
    from mpigpu.backends.base import CommContext
    from mpigpu.core.arrays import ArrayView
    from mpigpu.job.shm import SharedSegment

__all__ = ["DeviceEngine", "Engine", "GpuStaging", "HostEngine", "StagingBackend"]


class StagingBackend(Protocol):
    """What an engine reads of the backend that drives it (mpigpu.backends.host.HostBackend): the
    node's shape, the shared segment and its layout, the GPU's copy streams, scratch and phase times."""

    ctx: CommContext
    _n: int  # ranks on this node
    _local: int  # this rank's place on it
    _nodes: int
    _across: int  # ranks per node that exchange slices across nodes: the smallest node's
    _inter: Any  # the communicator across nodes (None on one node)
    _inter_size: int
    _depth: int  # chunks a GPU copy out runs ahead
    _block: Any  # a reused float32 block for NumPy reductions
    _segment: SharedSegment | None
    _layout: SegmentLayout | None
    _gpu: GpuStaging | None

    def _add_phase(self, name: str, seconds: float) -> None: ...

    def _scratch(self, name: str, nbytes: int) -> Any: ...


# -- the GPU side ---------------------------------------------------------------------------------
class GpuStaging:
    """Streams, events and kernels of one rank's GPU (created on the first GPU call)."""

    def __init__(self, ctx: CommContext) -> None:
        from mpigpu.core._cuda import core_stream, cupy
        from mpigpu.kernels.compile import load_module

        assert ctx.gpu is not None
        self.rt = cupy().cuda.runtime
        rt = self.rt
        self.streams: list[int] = []
        self.events: list[int] = []
        self.put = self._stream()  # device -> host copies
        self.reduce = self._stream()  # the reduction kernels
        self.get = self._stream()  # host -> device copies
        self.start = self._event(timing=False)  # the caller's work, before the call
        self.end = self._event(timing=False)  # the call's last copy back
        self.small_done = [self._event(timing=False), self._event(timing=False)]  # latency route, per parity
        self.small_pending = [False, False]
        self._spare: list[int] = []  # timing events not in use
        self.pending: list[tuple[str, int, int]] = []  # (phase, start event, end event) of the last call
        cc = ctx.gpu.compute_capability
        self.module = load_module("host.cu", f"{cc[0]}{cc[1]}")
        self.memcpy_d2h, self.memcpy_h2d = rt.memcpyDeviceToHost, rt.memcpyHostToDevice
        self.reduce_core = core_stream(self.reduce)  # cuda.core's view of it, for kernel launches
        self.device = ctx.gpu.index

    def _stream(self) -> int:
        handle = int(self.rt.streamCreateWithFlags(self.rt.streamNonBlocking))
        self.streams.append(handle)
        return handle

    def _event(self, *, timing: bool) -> int:
        flags = self.rt.eventDefault if timing else self.rt.eventDisableTiming
        handle = int(self.rt.eventCreateWithFlags(flags))
        self.events.append(handle)
        return handle

    def record(self, stream: int) -> int:
        """A timing event recorded on ``stream``."""
        event = self._spare.pop() if self._spare else self._event(timing=True)
        self.rt.eventRecord(event, stream)
        return event

    def timed(self, phase: str, stream: int, enqueue: Callable[[], None]) -> int:
        """Enqueue work between two timing events on ``stream``; return the end event."""
        start = self.record(stream)
        enqueue()
        end = self.record(stream)
        self.pending.append((phase, start, end))
        return end

    def fold(self) -> dict[str, float]:
        """Wait for the last call's timed work; its busy time per phase (s); recycle the events."""
        totals: dict[str, float] = {}
        for phase, start, end in self.pending:
            self.rt.eventSynchronize(end)
            totals[phase] = totals.get(phase, 0.0) + self.rt.eventElapsedTime(start, end) * 1e-3
            self._spare += (start, end)
        self.pending.clear()
        return totals

    def settle_small(self, parity: int) -> None:
        if self.small_pending[parity]:
            self.rt.eventSynchronize(self.small_done[parity])
            self.small_pending[parity] = False

    def close(self) -> None:
        with contextlib.suppress(Exception):  # at exit the CUDA context may already be gone
            self.rt.setDevice(self.device)
            for stream in self.streams:
                self.rt.streamSynchronize(stream)
        for event in self.events:
            with contextlib.suppress(Exception):
                self.rt.eventDestroy(event)
        for stream in self.streams:
            with contextlib.suppress(Exception):
                self.rt.streamDestroy(stream)
        self.events.clear()
        self.streams.clear()
        self.pending.clear()


class Engine(abc.ABC):
    """The steps of the pipeline for one call; subclasses move host or device data. ``out`` receives
    elements ``window`` (lo, hi) of the result (all of them for allreduce, this rank's rows for
    reduce_scatter)."""

    def __init__(
        self, backend: StagingBackend, x: ArrayView, out: ArrayView, op: Op, plan: ChunkPlan, window: tuple[int, int]
    ) -> None:
        self.backend, self.x, self.out, self.op, self.plan, self.window = backend, x, out, op, plan, window
        self.dtype = x.dtype
        self.segment = backend._segment
        self.layout = backend._layout
        assert self.segment is not None and self.layout is not None
        self.final = backend._nodes == 1
        self.acc_np, self.words = partial_type(self.dtype, op)  # the node partial's type, per element
        self.ring = self.ring_for(backend)
        self.position_bytes = self.layout.stride // self.ring // PAGE * PAGE
        assert plan.chunk * self.dtype.itemsize <= self.position_bytes
        assert self.final or plan.chunk * self.words * self.acc_np.itemsize <= 2 * self.position_bytes

    @staticmethod
    @abc.abstractmethod
    def ring_for(backend: StagingBackend) -> int:
        """Ring positions this engine uses (>= 2: see HostBackend._pipeline)."""

    def at(self, k: int) -> int:
        """Byte offset of chunk k's ring position in a slot."""
        return k % self.ring * self.position_bytes

    def wanted(self, k: int) -> tuple[int, int]:
        """The part of chunk k that ``out`` receives, relative to the chunk (empty: lo >= hi)."""
        e0, e1 = self.plan.span(k)
        return max(e0, self.window[0]) - e0, min(e1, self.window[1]) - e0

    def my_slice(self, k: int) -> tuple[int, int]:
        return self.plan.slices(k)[self.backend._local]

    def across_slice(self, k: int) -> tuple[int, int]:
        """This rank's slice of chunk k in the exchange across nodes (empty where its local rank is
        not below ``_across``): chunk k split as the smallest node splits it, so that every member
        of an exchange holds the same slice whatever the size of its node."""
        backend = self.backend
        if backend._local >= backend._across:
            return 0, 0
        e0, e1 = self.plan.span(k)
        return split_even(e1 - e0, backend._across, self.plan.align)[backend._local]

    def slot_view(self, rank: int, k: int, lo: int, hi: int) -> np.ndarray:
        offset = self.layout.slot(rank, self.at(k)) + lo * self.dtype.itemsize
        return self.segment.view(offset, hi - lo, self.dtype.np)

    def partial_view(self, k: int, lo: int, hi: int) -> np.ndarray:
        width = self.words * self.acc_np.itemsize
        return self.segment.view(self.layout.partial_at(self.at(k)) + lo * width, (hi - lo) * self.words, self.acc_np)

    def result_view(self, k: int, lo: int, hi: int) -> np.ndarray:
        offset = self.layout.result(self.at(k)) + lo * self.dtype.itemsize
        return self.segment.view(offset, hi - lo, self.dtype.np)

    def internode(self, k: int, lo: int, hi: int) -> None:
        """Reduce [lo, hi) of chunk k's partial across nodes, then finish it into the result area."""
        if hi <= lo:
            return
        backend = self.backend
        partial = self.partial_view(k, lo, hi)
        t0 = time.perf_counter()
        internode(backend._inter, partial, self.op, backend._scratch("gather", backend._inter_size * partial.nbytes))
        finish(partial, self.op, self.dtype, backend.ctx.size, self.result_view(k, lo, hi))
        backend._add_phase("internode", time.perf_counter() - t0)

    @abc.abstractmethod
    def put(self, k: int) -> None:
        """Start copying chunk k of x into this rank's slot."""

    @abc.abstractmethod
    def wait_put(self, k: int) -> None:
        """Return once chunk k is in this rank's slot."""

    @abc.abstractmethod
    def reduce(self, k: int) -> None:
        """Start reducing this rank's slice of chunk k over every slot."""

    @abc.abstractmethod
    def wait_reduce(self, k: int) -> None:
        """Return once this rank's slice of chunk k is reduced."""

    @abc.abstractmethod
    def get(self, k: int) -> None:
        """Start copying chunk k's result into out."""

    @abc.abstractmethod
    def wait_get(self, k: int) -> None:
        """Return once chunk k's result has been read (no-op for chunks < 0)."""

    def finish_call(self) -> None:  # noqa: B027 - optional hook
        """Called after the last step of the call."""


class HostEngine(Engine):
    """NumPy arrays: every step is a host copy or a NumPy reduction, complete when it returns."""

    @staticmethod
    def ring_for(backend: StagingBackend) -> int:
        return 2  # nothing overlaps on one thread: two positions let the schedule run

    def __init__(
        self, backend: StagingBackend, x: ArrayView, out: ArrayView, op: Op, plan: ChunkPlan, window: tuple[int, int]
    ) -> None:
        super().__init__(backend, x, out, op, plan, window)
        assert x.host is not None and out.host is not None
        self.src = x.host.reshape(-1)
        self.dst = out.host.reshape(-1)
        self.scratch = backend._block

    def put(self, k: int) -> None:
        """Only the other ranks' slices: they are all anyone reads from this rank's slot."""
        t0 = time.perf_counter()
        e0, e1 = self.plan.span(k)
        lo, hi = self.my_slice(k)
        for start, stop in ((0, lo), (hi, e1 - e0)):
            if stop > start:
                np.copyto(self.slot_view(self.backend._local, k, start, stop), self.src[e0 + start : e0 + stop])
        self.backend._add_phase("copy_out", time.perf_counter() - t0)

    def reduce(self, k: int) -> None:
        lo, hi = self.my_slice(k)
        if hi <= lo:
            return
        t0 = time.perf_counter()
        e0 = self.plan.span(k)[0]
        rows = [self.slot_view(r, k, lo, hi) for r in range(self.backend._n)]
        rows[self.backend._local] = self.src[e0 + lo : e0 + hi]  # this rank's own slice, read in place
        dst = self.result_view(k, lo, hi) if self.final else self.partial_view(k, lo, hi)
        reduce_rows(rows, self.op, self.dtype, self.backend.ctx.size, dst, final=self.final, scratch=self.scratch)
        self.backend._add_phase("reduce", time.perf_counter() - t0)

    def get(self, k: int) -> None:
        lo, hi = self.wanted(k)
        if hi <= lo:
            return
        t0 = time.perf_counter()
        at = self.plan.span(k)[0] + lo - self.window[0]
        np.copyto(self.dst[at : at + hi - lo], self.result_view(k, lo, hi))
        self.backend._add_phase("copy_in", time.perf_counter() - t0)

    def wait_put(self, k: int) -> None:
        """Host copies are complete when put() returns."""

    def wait_reduce(self, k: int) -> None:
        """The NumPy reduction is complete when reduce() returns."""

    def wait_get(self, k: int) -> None:
        """Host copies are complete when get() returns."""


class DeviceEngine(Engine):
    """GPU arrays: copies on the copy streams, the reduction kernel on its own stream; each step
    ends with an event that the host waits on before the barrier that publishes it."""

    @staticmethod
    def ring_for(backend: StagingBackend) -> int:
        return backend._depth + 2  # copies out run `depth` chunks ahead; +2 lets copies back drain

    def __init__(
        self,
        backend: StagingBackend,
        x: ArrayView,
        out: ArrayView,
        op: Op,
        plan: ChunkPlan,
        window: tuple[int, int],
        stream: int,
    ) -> None:
        super().__init__(backend, x, out, op, plan, window)
        gpu = backend._gpu
        assert gpu is not None and self.segment.registered
        self.gpu, self.rt = gpu, gpu.rt
        self.dev = self.segment.register()  # the segment's device address (cached)
        kind = "final" if self.final else "partial"
        # integer avg across nodes: the exact parts (host_reduce.partial_type) are summed by NumPy on the
        # host, from the slots (host memory), as HostEngine sums them; the kernels keep the element type
        self.on_host = not self.final and op is Op.AVG and not self.dtype.is_float
        self.kernel = None if self.on_host else gpu.module.kernel(f"reduce_{kind}_{self.dtype.name}")
        self.caller = stream
        self.done: dict[tuple[str, int], int] = {}
        # Copies out of x and into out start after the caller's work already on its stream.
        self.rt.eventRecord(gpu.start, stream)
        self.rt.streamWaitEvent(gpu.put, gpu.start, 0)
        self.rt.streamWaitEvent(gpu.get, gpu.start, 0)

    def put(self, k: int) -> None:
        e0, e1 = self.plan.span(k)
        size = self.dtype.itemsize
        dst = self.segment.ptr + self.layout.slot(self.backend._local, self.at(k))
        src = self.x.ptr + e0 * size

        def enqueue() -> None:
            self.rt.memcpyAsync(dst, src, (e1 - e0) * size, self.gpu.memcpy_d2h, self.gpu.put)

        self.done["put", k] = self.gpu.timed("copy_out", self.gpu.put, enqueue)

    def reduce(self, k: int) -> None:
        from mpigpu.kernels.compile import i32, i64, launch

        lo, hi = self.my_slice(k)
        if hi <= lo:
            return
        if self.on_host:  # the slots were filled before the barrier that precedes this step
            t0 = time.perf_counter()
            rows = [self.slot_view(r, k, lo, hi) for r in range(self.backend._n)]
            nranks, dst = self.backend.ctx.size, self.partial_view(k, lo, hi)
            reduce_rows(rows, self.op, self.dtype, nranks, dst, final=False, scratch=self.backend._block)
            self.backend._add_phase("reduce", time.perf_counter() - t0)
            return
        size = self.dtype.itemsize
        at = self.at(k)
        slots = self.dev + self.layout.slot(0, at) + lo * size
        if self.final:
            dst = self.dev + self.layout.result(at) + lo * size
        else:
            dst = self.dev + self.layout.partial_at(at) + lo * self.acc_np.itemsize
        count = hi - lo
        vectors = max(1, count * size // 16)
        ranks, nranks = self.backend._n, self.backend.ctx.size
        args = (slots, i64(self.layout.stride), i32(ranks), i64(count), i32(self.op.index), i32(nranks), dst)

        def enqueue() -> None:
            launch(self.gpu.reduce_core, self.kernel, vectors, *args)

        self.done["reduce", k] = self.gpu.timed("reduce", self.gpu.reduce, enqueue)

    def get(self, k: int) -> None:
        lo, hi = self.wanted(k)
        if hi <= lo:
            return
        size = self.dtype.itemsize
        src = self.segment.ptr + self.layout.result(self.at(k)) + lo * size
        dst = self.out.ptr + (self.plan.span(k)[0] + lo - self.window[0]) * size

        def enqueue() -> None:
            self.rt.memcpyAsync(dst, src, (hi - lo) * size, self.gpu.memcpy_h2d, self.gpu.get)

        self.done["get", k] = self.gpu.timed("copy_in", self.gpu.get, enqueue)

    def _wait(self, step: str, k: int) -> None:
        event = self.done.get((step, k))
        if event is not None:
            self.rt.eventSynchronize(event)

    def wait_put(self, k: int) -> None:
        self._wait("put", k)

    def wait_reduce(self, k: int) -> None:
        self._wait("reduce", k)

    def wait_get(self, k: int) -> None:
        self._wait("get", k)

    def finish_call(self) -> None:
        """The caller's stream waits for the last copy back: the result is ready in its order."""
        self.rt.eventRecord(self.gpu.end, self.gpu.get)
        self.rt.streamWaitEvent(self.caller, self.gpu.end, 0)
