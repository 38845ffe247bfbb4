"""Buffers for the commands (average, bench): an input filled with a pattern, an optional separate
output poisoned before each checked run, and a verifier that counts wrong elements. On the host
with NumPy; on the GPU with the NVRTC kernels of ``kernels/patterns.cu`` (fill, verify) so that
gigabyte messages are checked without copying them back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpigpu.arrays import ArrayView
from mpigpu.dtypes import DType
from mpigpu.ops import Op
from mpigpu.patterns import check_pattern, fill, pattern_code
from mpigpu.verify import count_wrong_host

__all__ = ["Workload", "count_wrong_device", "fill_device"]

POISON_BYTE = 0x7F  # NaN or a huge value in every dtype; never an expected result


class Workload:
    """Input ``x`` and output ``out`` (``out is x`` when in place) for one size and dtype."""

    def __init__(
        self,
        *,
        count: int,
        dtype: DType,
        op: Op,
        pattern: str,
        rank: int,
        nranks: int,
        device: Any = None,  # GpuInfo, or None for host memory
        inplace: bool = True,
        stream: Any = None,  # StreamRef for device work
    ) -> None:
        check_pattern(pattern, dtype)
        self.count, self.dtype, self.op, self.pattern = count, dtype, op, pattern
        self.rank, self.nranks, self.gpu, self.inplace, self.stream = rank, nranks, device, inplace, stream
        self._holders: list[Any] = []
        self.x = self._allocate()
        self.out = self.x if inplace else self._allocate()
        self.kernel_ms = 0.0

    # -- memory -------------------------------------------------------------------------------------
    def _allocate(self) -> ArrayView:
        nbytes = self.count * self.dtype.itemsize
        if self.gpu is None:
            arr = np.empty(self.count, dtype=self.dtype.np)
            return ArrayView(arr, arr.ctypes.data, (self.count,), self.dtype, None, False, "numpy", host=arr)
        from mpigpu._cuda import cupy

        raw = cupy().empty(max(nbytes, 1), dtype=np.uint8)
        self._holders.append(raw)
        return ArrayView(raw, int(raw.data.ptr), (self.count,), self.dtype, self.gpu.index, False, "cupy")

    # -- patterns -----------------------------------------------------------------------------------
    def fill(self) -> None:
        """Write this rank's input into ``x`` (records the kernel time on the GPU)."""
        if self.gpu is None:
            fill(self.x.host, self.pattern, self.op, self.rank, self.nranks)
            return
        self.kernel_ms = fill_device(
            self.x.ptr, self.count, self.dtype, self.pattern, self.op, self.rank, self.nranks, self.gpu, self.stream
        )

    def poison(self) -> None:
        """Overwrite ``out`` (when separate) so that an element the backend never writes is caught."""
        if self.out is self.x:
            return
        if self.gpu is None:
            self.out.host.view(np.uint8)[...] = POISON_BYTE
            return
        from mpigpu._cuda import cupy

        cupy().cuda.runtime.memsetAsync(self.out.ptr, POISON_BYTE, self.out.nbytes, self.stream.handle)

    def corrupt(self, elements: int) -> None:
        """Testing aid: damage the first ``elements`` results on this rank (the verifier must see it)."""
        if elements <= 0:
            return
        n = min(elements, self.count) * self.dtype.itemsize
        if self.gpu is None:
            self.out.host.view(np.uint8)[:n] = POISON_BYTE
            return
        from mpigpu._cuda import cupy

        cupy().cuda.runtime.memsetAsync(self.out.ptr, POISON_BYTE, n, self.stream.handle)

    def wrong(self) -> int:
        """Wrong elements in ``out`` on this rank."""
        if self.gpu is None:
            return count_wrong_host(self.out.host, self.pattern, self.op, self.dtype, self.nranks)
        return count_wrong_device(
            self.out.ptr, self.count, self.dtype, self.pattern, self.op, self.nranks, self.gpu, self.stream
        )

    def free(self) -> None:
        self._holders.clear()


def _patterns_module(gpu: Any) -> Any:
    from mpigpu.kernels.compile import load_module

    major, minor = gpu.compute_capability
    return load_module("patterns.cu", f"{major}{minor}")


def fill_device(
    ptr: int, count: int, dtype: DType, pattern: str, op: Op, rank: int, nranks: int, gpu: Any, stream: Any
) -> float:
    """Fill ``count`` elements at device pointer ``ptr`` with rank ``rank``'s input, on ``stream``.

    Returns the kernel's time in milliseconds (CUDA events; waits for the kernel)."""
    from mpigpu._cuda import timing_event
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
    from mpigpu._cuda import cupy
    from mpigpu.kernels.compile import i32, i64, launch

    cp = cupy()
    counter = cp.empty(1, dtype=np.uint64)
    cp.cuda.runtime.memsetAsync(int(counter.data.ptr), 0, 8, stream.handle)
    kernel = _patterns_module(gpu).kernel(f"count_wrong_{dtype.name}")
    launch(
        stream, kernel, count, ptr, i64(count), i64(0),
        i32(pattern_code(pattern)), i32(op.index), i32(nranks), np.float64(dtype.eps), int(counter.data.ptr),
    )  # fmt: skip
    host = np.empty(1, dtype=np.uint64)
    cp.cuda.runtime.memcpyAsync(host.ctypes.data, int(counter.data.ptr), 8, cp.cuda.runtime.memcpyDeviceToHost,
                                stream.handle)  # fmt: skip
    cp.cuda.runtime.streamSynchronize(stream.handle)
    return int(host[0])
