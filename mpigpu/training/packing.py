"""Copying many arrays into one flat bucket and back: NumPy on the host; on the GPU one kernel per
direction (``kernels/bucket.cu``) driven by a table of (address, offset, count), instead of one copy
call per array, whose launch overhead would dominate a model's hundreds of small gradients.

An entry whose address is None (host) or 0 (GPU) packs zeros: a parameter without a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpigpu.core.dtypes import DType

__all__ = ["DevicePacker", "build_table", "pack_host", "unpack_host"]


def pack_host(bucket: np.ndarray, entries: Sequence[tuple[np.ndarray | None, int, int]]) -> None:
    """bucket[offset:offset+count] = src (cast to the bucket's dtype, rounded to nearest), or zeros."""
    for src, offset, count in entries:
        dst = bucket[offset : offset + count]
        if src is None:
            dst[...] = 0
        else:
            np.copyto(dst, src, casting="unsafe")


def unpack_host(bucket: np.ndarray, entries: Sequence[tuple[np.ndarray, int, int]], scale: float = 1.0) -> None:
    """dst = bucket[offset:offset+count] (cast to dst's dtype), times ``scale`` when it is not 1."""
    for dst, offset, count in entries:
        np.copyto(dst, bucket[offset : offset + count], casting="unsafe")
        if scale != 1.0:
            dst *= dst.dtype.type(scale)


def build_table(entries: Sequence[tuple[int, int, int]], out: np.ndarray) -> int:
    """Write the kernels' table for (address, offset, count) entries into ``out``: addresses, then
    offsets, then the running start of each entry in the flattened copy (plus the total).
    Returns the number of int64 values written (3 * entries + 1)."""
    n = len(entries)
    start = 0
    for e, (ptr, offset, count) in enumerate(entries):
        out[e] = ptr
        out[n + e] = offset
        out[2 * n + e] = start
        start += count
    out[3 * n] = start
    return 3 * n + 1


class DevicePacker:
    """The copy table of one GPU bucket and the kernels that use it.

    The table is rebuilt only when the arrays' addresses change (PyTorch allocates new gradients
    after ``zero_grad(set_to_none=True)``). It is staged in pinned host memory and copied to the
    device on the caller's stream, so nothing blocks the host: before the staging area is rewritten
    the previous upload has completed (an event), and the upload waits for the last kernel that read
    the old table (another event), on whatever stream that ran."""

    def __init__(self, capacity: int, dtype: DType, wire: DType, arch: str) -> None:
        from mpigpu.core._cuda import cupy
        from mpigpu.kernels.compile import load_module

        cp = cupy()
        size = 3 * max(capacity, 1) + 1
        self._pinned = cp.cuda.alloc_pinned_memory(size * 8)
        self._staging = np.frombuffer(self._pinned, dtype=np.int64, count=size)  # CuPy's documented idiom
        self._scratch = np.zeros(size, dtype=np.int64)
        self._loaded = np.full(size, -1, dtype=np.int64)  # what the device table holds
        self._loaded_len = 0
        self._device = cp.empty(size, dtype=np.int64)
        runtime = cp.cuda.runtime
        self._runtime = runtime
        self._uploaded = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
        self._read = runtime.eventCreateWithFlags(runtime.eventDisableTiming)
        self._recorded = False
        module = load_module("bucket.cu", arch)
        if wire == dtype:
            self._pack = module.kernel(f"pack_copy{dtype.itemsize}")
            self._unpack = module.kernel(f"unpack_copy{dtype.itemsize}")
            self._scaled = False
        else:  # compression: float32 arrays, float16 / bfloat16 on the wire
            self._pack = module.kernel(f"pack_{dtype.name}_{wire.name}")
            self._unpack = module.kernel(f"unpack_{wire.name}_{dtype.name}")
            self._scaled = True

    def _load(self, entries: Sequence[tuple[int, int, int]], stream: int) -> None:
        length = build_table(entries, self._scratch)
        if length == self._loaded_len and np.array_equal(self._scratch[:length], self._loaded[:length]):
            return
        runtime = self._runtime
        if self._recorded:
            runtime.eventSynchronize(self._uploaded)  # the staging area is free again
            runtime.streamWaitEvent(stream, self._read, 0)  # no kernel still reads the old table
        self._staging[:length] = self._scratch[:length]
        runtime.memcpyAsync(
            int(self._device.data.ptr), self._staging.ctypes.data, length * 8, runtime.memcpyHostToDevice, stream
        )
        runtime.eventRecord(self._uploaded, stream)
        self._loaded[:length] = self._scratch[:length]
        self._loaded_len = length

    def _run(self, kernel: Any, entries: Sequence[tuple[int, int, int]], bucket: int, stream: int, *extra: Any) -> None:
        from mpigpu.core._cuda import StreamRef
        from mpigpu.kernels.compile import i32, launch

        total = sum(count for _, _, count in entries)
        if total == 0:
            return
        self._load(entries, stream)
        launch(StreamRef(stream), kernel, total, int(self._device.data.ptr), i32(len(entries)), bucket, *extra)
        self._runtime.eventRecord(self._read, stream)
        self._recorded = True

    def pack(self, entries: Sequence[tuple[int, int, int]], bucket: int, stream: int) -> None:
        """Copy (address, offset, count) arrays into the bucket at ``bucket`` on ``stream``."""
        self._run(self._pack, entries, bucket, stream)

    def unpack(self, entries: Sequence[tuple[int, int, int]], bucket: int, stream: int, scale: float) -> None:
        """Copy the bucket back into the arrays on ``stream`` (times ``scale`` when compressed)."""
        if self._scaled:
            self._run(self._unpack, entries, bucket, stream, np.float32(scale))
        else:
            self._run(self._unpack, entries, bucket, stream)

    def close(self) -> None:
        """Release the events (idempotent; the memory goes back to CuPy's pools)."""
        if self._recorded and self._read:
            self._runtime.eventSynchronize(self._read)
        for name in ("_uploaded", "_read"):
            event = getattr(self, name)
            if event:
                self._runtime.eventDestroy(event)
                setattr(self, name, 0)
