"""Verified buffers for the commands (average, bench, soak): an input filled with a pattern, a
separate output poisoned before each checked call, optionally a snapshot of the input (an
out-of-place call must leave it unchanged), and a verifier that counts wrong elements. On the
host with NumPy; on the GPU with the NVRTC kernels of ``kernels/patterns.cu`` (fill, verify) so
that gigabyte messages are checked without copying them back.

Memory is allocated once (``Buffers``, at the largest size a command needs); a ``Workload`` is one
call's view of it (count, dtype, op, element offset, in or out of place), and ``sized`` gives
another call's view of the same memory without allocating.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpigpu.core.arrays import ArrayView
from mpigpu.core.dtypes import DType
from mpigpu.core.ops import Op
from mpigpu.core.patterns import check_pattern, fill, pattern_code
from mpigpu.core.verify import count_wrong_host

__all__ = ["POISON_BYTE", "Buffers", "Workload", "count_changed_device", "count_wrong_device", "fill_device"]

POISON_BYTE = 0x7F  # NaN or a huge value in every dtype; never an expected result


class Buffers:
    """Byte arenas of ``nbytes`` each: the input, the output (``output``) and a snapshot of the
    input (``snapshot``), in host memory or on ``gpu`` (a GpuInfo)."""

    def __init__(self, nbytes: int, gpu: Any = None, *, output: bool = True, snapshot: bool = False) -> None:
        self.nbytes, self.gpu = nbytes, gpu
        self.x = self._arena()
        self.out = self._arena() if output else None
        self.snap = self._arena() if snapshot else None

    def _arena(self) -> Any:
        if self.gpu is None:
            return np.empty(self.nbytes, np.uint8)
        from mpigpu.core._cuda import cupy

        cp = cupy()
        with cp.cuda.Device(self.gpu.index):
            return cp.empty(max(self.nbytes, 1), cp.uint8)

    def free(self) -> None:
        """Drop the arenas (views made from them keep their memory alive until they go too)."""
        self.x = self.out = self.snap = None


def _view(arena: Any, gpu: Any, start: int, count: int, dtype: DType) -> ArrayView:
    """``count`` elements of ``dtype`` from byte ``start`` of an arena."""
    if gpu is None:
        arr = arena[start : start + count * dtype.itemsize].view(dtype.np)
        return ArrayView(arr, arr.ctypes.data, (count,), dtype, None, False, "numpy", host=arr)
    return ArrayView(arena, int(arena.data.ptr) + start, (count,), dtype, gpu.index, False, "cupy")


class Workload:
    """Input ``x`` and output ``out`` (``out is x`` when in place) of one call: ``count`` elements of
    ``dtype`` starting ``offset`` elements into ``buffers``. With a snapshot arena, an out-of-place
    call's input is kept by ``fill`` and compared by ``wrong``."""

    def __init__(
        self,
        buffers: Buffers,
        *,
        count: int,
        dtype: DType,
        op: Op,
        pattern: str,
        rank: int,
        nranks: int,
        inplace: bool = True,
        stream: Any = None,  # StreamRef for device work
        offset: int = 0,
    ) -> None:
        check_pattern(pattern, dtype)
        start = offset * dtype.itemsize
        if start + count * dtype.itemsize > buffers.nbytes:
            raise ValueError(f"{count} x {dtype.name} at offset {offset} does not fit in {buffers.nbytes} bytes")
        if not inplace and buffers.out is None:
            raise ValueError("out of place needs Buffers(output=True)")
        self.buffers, self.gpu = buffers, buffers.gpu
        self.count, self.dtype, self.op, self.pattern = count, dtype, op, pattern
        self.rank, self.nranks, self.inplace, self.stream, self.offset = rank, nranks, inplace, stream, offset
        self.x = _view(buffers.x, self.gpu, start, count, dtype)
        self.out = self.x if inplace else _view(buffers.out, self.gpu, start, count, dtype)
        self._snap = None if inplace or buffers.snap is None else _view(buffers.snap, self.gpu, start, count, dtype)
        self.kernel_ms = 0.0

    @classmethod
    def allocate(
        cls,
        *,
        count: int,
        dtype: DType,
        op: Op,
        pattern: str,
        rank: int,
        nranks: int,
        device: Any = None,  # GpuInfo, or None for host memory
        inplace: bool = True,
        stream: Any = None,
    ) -> Workload:
        """Buffers for ``count`` elements (an output only when out of place) and the call on them."""
        check_pattern(pattern, dtype)
        buffers = Buffers(count * dtype.itemsize, device, output=not inplace)
        return cls(
            buffers, count=count, dtype=dtype, op=op, pattern=pattern, rank=rank, nranks=nranks,
            inplace=inplace, stream=stream,
        )  # fmt: skip

    def sized(
        self,
        count: int,
        *,
        dtype: DType | None = None,
        op: Op | None = None,
        inplace: bool | None = None,
        offset: int = 0,
    ) -> Workload:
        """Another call on the same buffers: ``count`` elements (``dtype``, ``op``, ``inplace``: as
        this one unless given) from element ``offset``; nothing is allocated."""
        return Workload(
            self.buffers, count=count, dtype=self.dtype if dtype is None else dtype,
            op=self.op if op is None else op, pattern=self.pattern, rank=self.rank, nranks=self.nranks,
            inplace=self.inplace if inplace is None else inplace, stream=self.stream, offset=offset,
        )  # fmt: skip

    # -- patterns -----------------------------------------------------------------------------------
    def fill(self) -> None:
        """Write this rank's input into ``x`` (records the kernel time on the GPU); keep a copy of it
        where there is a snapshot arena and the call is out of place."""
        if self.gpu is None:
            fill(self.x.host, self.pattern, self.op, self.rank, self.nranks)
            if self._snap is not None:
                self._snap.host[...] = self.x.host
            return
        self.kernel_ms = fill_device(
            self.x.ptr, self.count, self.dtype, self.pattern, self.op, self.rank, self.nranks, self.gpu, self.stream
        )
        if self._snap is not None:
            from mpigpu.core._cuda import cupy

            runtime = cupy().cuda.runtime
            runtime.memcpyAsync(
                self._snap.ptr, self.x.ptr, self.x.nbytes, runtime.memcpyDeviceToDevice, self.stream.handle
            )

    def poison(self) -> None:
        """Overwrite ``out`` (when separate) so that an element the backend never writes is caught."""
        if self.out is self.x:
            return
        self._damage(self.out.nbytes)

    def corrupt(self, elements: int) -> None:
        """Testing aid: damage the first ``elements`` results on this rank (the verifier must see it)."""
        if elements > 0:
            self._damage(min(elements, self.count) * self.dtype.itemsize)

    def _damage(self, nbytes: int) -> None:
        """Write POISON_BYTE over the first ``nbytes`` of ``out``."""
        if self.gpu is None:
            self.out.host.view(np.uint8)[:nbytes] = POISON_BYTE
            return
        from mpigpu.core._cuda import cupy

        cupy().cuda.runtime.memsetAsync(self.out.ptr, POISON_BYTE, nbytes, self.stream.handle)

    def wrong(self) -> int:
        """Wrong elements in ``out`` on this rank, plus the input elements an out-of-place call changed
        (where there is a snapshot)."""
        if self.gpu is None:
            wrong = count_wrong_host(self.out.host, self.pattern, self.op, self.dtype, self.nranks)
            if self._snap is not None:
                bits = f"u{self.dtype.itemsize}"
                wrong += int(np.count_nonzero(self.x.host.view(bits) != self._snap.host.view(bits)))
            return wrong
        wrong = count_wrong_device(
            self.out.ptr, self.count, self.dtype, self.pattern, self.op, self.nranks, self.gpu, self.stream
        )
        if self._snap is not None:
            wrong += self._changed_on_device()
        return wrong

    def _changed_on_device(self) -> int:
        """Input elements that differ from the snapshot, compared as bytes on the GPU (one mpigpu kernel
        for every dtype: no library compiles a kernel per shape or dtype while memory is measured)."""
        return count_changed_device(self.x.ptr, self._snap.ptr, self.count, self.dtype.itemsize, self.gpu, self.stream)

    def free(self) -> None:
        self.buffers.free()


def _patterns_module(gpu: Any) -> Any:
    from mpigpu.kernels.compile import load_module

    major, minor = gpu.compute_capability
    return load_module("patterns.cu", f"{major}{minor}")


def fill_device(
    ptr: int, count: int, dtype: DType, pattern: str, op: Op, rank: int, nranks: int, gpu: Any, stream: Any
) -> float:
    """Fill ``count`` elements at device pointer ``ptr`` with rank ``rank``'s input, on ``stream``.

    Returns the kernel's time in milliseconds (CUDA events; waits for the kernel)."""
    from mpigpu.core._cuda import timing_event
    from mpigpu.kernels.compile import i32, i64, launch

    check_pattern(pattern, dtype)
    kernel = _patterns_module(gpu).kernel(f"fill_{dtype.name}")
    start = timing_event(stream)
    launch(
        stream, kernel, count, ptr, i64(count), i64(0),
        i32(pattern_code(pattern)), i32(op.index), i32(rank), i32(nranks),
    )  # fmt: skip
    end = timing_event(stream)
    end.sync()
    return float(end - start)


def count_wrong_device(
    ptr: int, count: int, dtype: DType, pattern: str, op: Op, nranks: int, gpu: Any, stream: Any
) -> int:
    """Wrong elements among ``count`` results at device pointer ``ptr`` (verified on the GPU)."""
    from mpigpu.kernels.compile import i32, i64

    kernel = _patterns_module(gpu).kernel(f"count_wrong_{dtype.name}")
    args = (ptr, i64(count), i64(0), i32(pattern_code(pattern)), i32(op.index), i32(nranks), np.float64(dtype.eps))
    return _count_on_device(stream, kernel, count, args)


def count_changed_device(a: int, b: int, count: int, width: int, gpu: Any, stream: Any) -> int:
    """Elements of ``width`` bytes among ``count`` that differ between device pointers ``a`` and ``b``."""
    from mpigpu.kernels.compile import i32, i64

    kernel = _patterns_module(gpu).kernel("count_changed")
    return _count_on_device(stream, kernel, count, (a, b, i64(count), i32(width)))


def _count_on_device(stream: Any, kernel: Any, count: int, args: tuple[Any, ...]) -> int:
    """Launch a counting kernel over ``count`` items with ``args`` and a zeroed uint64 counter as its last
    argument, on ``stream`` (any stream resolve_stream takes); wait and return the count."""
    from mpigpu.core._cuda import cupy, resolve_stream
    from mpigpu.kernels.compile import launch

    cp, ref = cupy(), resolve_stream(stream, "", None)
    counter = cp.empty(1, dtype=np.uint64)
    cp.cuda.runtime.memsetAsync(int(counter.data.ptr), 0, 8, ref.handle)
    launch(ref, kernel, count, *args, int(counter.data.ptr))
    host = np.empty(1, dtype=np.uint64)
    cp.cuda.runtime.memcpyAsync(host.ctypes.data, int(counter.data.ptr), 8, cp.cuda.runtime.memcpyDeviceToHost,
                                ref.handle)  # fmt: skip
    cp.cuda.runtime.streamSynchronize(ref.handle)
    return int(host[0])
