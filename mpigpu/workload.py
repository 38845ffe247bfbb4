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

__all__ = ["Workload"]

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

    def host_copy(self, view: ArrayView) -> np.ndarray:
        """A host copy of a buffer (synchronises the stream)."""
        if view.host is not None:
            return view.host
        raw = view.obj
        return raw.get(stream=self._cupy_stream())[: self.count * self.dtype.itemsize].view(self.dtype.np)

    def _cupy_stream(self) -> Any:
        from mpigpu._cuda import cupy

        return cupy().cuda.ExternalStream(self.stream.handle) if self.stream else None

    # -- patterns -----------------------------------------------------------------------------------
    def _kernels(self) -> Any:
        from mpigpu.kernels.compile import load_module

        cc = self.gpu.compute_capability
        return load_module("patterns.cu", f"{cc[0]}{cc[1]}")

    def fill(self) -> None:
        """Write this rank's input into ``x`` (records the kernel time on the GPU)."""
        if self.gpu is None:
            fill(self.x.host, self.pattern, self.op, self.rank, self.nranks)
            return
        from mpigpu._cuda import timing_event
        from mpigpu.kernels.compile import i32, i64, launch

        kernel = self._kernels().kernel(f"fill_{self.dtype.name}")
        start = timing_event(self.stream)
        launch(
            self.stream, kernel, self.count, self.x.ptr, i64(self.count), i64(0),
            i32(pattern_code(self.pattern)), i32(self.op.index), i32(self.rank), i32(self.nranks),
        )  # fmt: skip
        end = timing_event(self.stream)
        end.sync()
        self.kernel_ms = float(end - start)

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
        from mpigpu._cuda import cupy
        from mpigpu.kernels.compile import i32, i64, launch

        cp = cupy()
        counter = cp.empty(1, dtype=np.uint64)
        cp.cuda.runtime.memsetAsync(int(counter.data.ptr), 0, 8, self.stream.handle)
        kernel = self._kernels().kernel(f"count_wrong_{self.dtype.name}")
        launch(
            self.stream, kernel, self.count, self.out.ptr, i64(self.count), i64(0),
            i32(pattern_code(self.pattern)), i32(self.op.index), i32(self.nranks),
            np.float64(self.dtype.eps), int(counter.data.ptr),
        )  # fmt: skip
        return int(counter.get(stream=self._cupy_stream())[0])

    def free(self) -> None:
        self._holders.clear()
