"""The Averager's buckets: what each array is (``Spec``), how arrays are grouped into fused buckets
(``plan_buckets``), and one bucket's buffer with its per-array views and step state (``Bucket``).

Kept apart from ``Averager`` (which runs the steps: pack, allreduce, unpack) so the planning can be
read and tested without a communicator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpigpu.calls.persistent import Request
from mpigpu.core.arrays import as_view, require_c_order
from mpigpu.core.dtypes import DType, parse_dtype
from mpigpu.core.errors import InvalidArgument
from mpigpu.training.packing import DevicePacker

__all__ = [
    "Bucket",
    "Spec",
    "allocate",
    "dense_strides",
    "is_module",
    "is_parameter",
    "is_torch",
    "plan_buckets",
    "slot_view",
    "spec_of",
    "torch_spec",
]


@dataclass(frozen=True)
class Spec:
    """One array as the Averager sees it; every rank must pass the same list."""

    shape: tuple[int, ...]
    dtype: DType
    device: int | None  # CUDA ordinal, None for host memory
    strides: tuple[int, ...] | None = None  # PyTorch element strides of a dense non-C layout (channels_last)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def describe(self) -> str:
        place = "host" if self.device is None else "GPU"
        return f"{self.dtype.name} {self.shape} on {place}"


def plan_buckets(specs: Sequence[Spec], bucket_bytes: int, first_bytes: int | None = None) -> list[list[int]]:
    """Indices of ``specs`` grouped by (device, dtype), in order, into buckets of at most
    ``bucket_bytes`` (the first of each group at most ``first_bytes``, if smaller: DDP's small first
    bucket, sent early); buckets ordered by their first array. Deterministic: equal on every rank."""
    first_cap = bucket_bytes if first_bytes is None else min(first_bytes, bucket_bytes)
    open_: dict[tuple[int | None, str], list[int]] = {}
    filled: dict[tuple[int | None, str], int] = {}
    first: dict[tuple[int | None, str], list[int]] = {}
    buckets: list[list[int]] = []
    for index, spec in enumerate(specs):
        key = (spec.device, spec.dtype.name)
        members = open_.get(key)
        if members and filled[key] + spec.nbytes > (first_cap if members is first.get(key) else bucket_bytes):
            members = None
        if members is None:
            members = open_[key] = []
            first.setdefault(key, members)
            filled[key] = 0
            buckets.append(members)
        members.append(index)
        filled[key] += spec.nbytes
    return buckets


def is_torch(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torch"


def is_parameter(obj: Any) -> bool:
    return is_torch(obj) and type(obj).__name__ == "Parameter"


def is_module(obj: Any) -> bool:
    """A torch.nn.Module (user subclasses included), recognised without importing torch."""
    return any(c.__name__ == "Module" and c.__module__ == "torch.nn.modules.module" for c in type(obj).__mro__)


def dense_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True if element ``strides`` cover ``prod(shape)`` consecutive elements (any dimension order)."""
    expected = 1
    for stride, extent in sorted((s, e) for s, e in zip(strides, shape, strict=True) if e != 1):
        if stride != expected:
            return False
        expected *= extent
    return True


def torch_spec(t: Any, name: str) -> Spec:
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"{name} is a torch tensor on {t.device}: mpigpu takes CPU or CUDA tensors")
    shape, strides = tuple(t.shape), None
    if not t.is_contiguous():
        strides = tuple(t.stride())
        if not dense_strides(shape, strides):
            raise InvalidArgument(f"{name} is not dense (strides {strides}); pass a contiguous tensor")
    return Spec(shape, parse_dtype(t.dtype), t.device.index if t.is_cuda else None, strides)


def spec_of(obj: Any, name: str) -> Spec:
    if is_torch(obj):
        return torch_spec(obj, name)
    view = as_view(obj, name=name)
    require_c_order(view, "the Averager", name)
    if view.readonly:
        hint = (
            " JAX arrays are immutable: average jax.flatten_util.ravel_pytree(grads)[0] with one "
            "mpigpu.allreduce call instead (see samples/jax_step.py)."
            if view.framework == "jax"
            else ""
        )
        raise InvalidArgument(f"{name} is read-only; the Averager writes the averages in place.{hint}")
    return Spec(view.shape, view.dtype, view.device)


def allocate(framework: str, count: int, dtype: DType, device: int | None) -> Any:
    """A flat buffer of ``count`` elements in the arrays' framework (so bucket views are of that kind)."""
    if framework == "torch":
        import torch

        where = torch.device("cuda", device) if device is not None else torch.device("cpu")
        return torch.empty(count, dtype=getattr(torch, dtype.name), device=where)
    if device is not None:
        from mpigpu.core._cuda import cupy

        cp = cupy()
        with cp.cuda.Device(device):
            return cp.empty(count, dtype=dtype.np)
    return np.empty(count, dtype=dtype.np)


def slot_view(buffer: Any, framework: str, offset: int, spec: Spec) -> Any:
    """The part of a bucket that holds one array, shaped (and strided) like the array."""
    if framework == "torch" and spec.strides is not None:
        return buffer.as_strided(spec.shape, spec.strides, buffer.storage_offset() + offset)
    return buffer[offset : offset + spec.size].reshape(spec.shape)


class Bucket:
    """One fused buffer: the arrays it holds, where, and the state of the current step."""

    def __init__(self, index: int, members: list[int], specs: Sequence[Spec], wire: DType, framework: str, arch: str):
        first = specs[members[0]]
        self.index, self.members, self.dtype, self.wire, self.device = index, members, first.dtype, wire, first.device
        self.offsets: list[int] = []
        self.counts = [specs[i].size for i in members]
        self.count = 0
        for size in self.counts:
            self.offsets.append(self.count)
            self.count += size
        self.buffer = allocate(framework, self.count, wire, self.device)
        view = as_view(self.buffer, name="bucket")
        self.ptr, self.host = view.ptr, view.host
        self.slots: list[Any] | None = None  # views aliasing the bucket (no compression)
        self.slot_ptrs: list[int] = []
        if wire == self.dtype:
            self.slots = [
                slot_view(self.buffer, framework, o, specs[i]) for i, o in zip(members, self.offsets, strict=True)
            ]
            self.slot_ptrs = [self.ptr + o * wire.itemsize for o in self.offsets]
        self.packer = DevicePacker(len(members), self.dtype, wire, arch) if self.device is not None else None
        # state of the current step
        self.stream: int = 0  # the caller's stream (GPU)
        self.request: Request | None = None  # the bucket's persistent allreduce (made once, with the bucket)
        self.started = False  # its start of this step is not yet waited for
        self.unpack: list[Any] = []  # (host array or address, offset, count) to copy back
        self.adopt: list[int] = []  # member positions whose p.grad becomes the bucket slot
        self.fixed: tuple[list[Any], list[Any]] | None = None  # (pack, unpack) of the construction-time arrays

    def describe(self) -> dict[str, Any]:
        return {
            "arrays": len(self.members),
            "elements": self.count,
            "bytes": self.count * self.wire.itemsize,
            "dtype": self.dtype.name,
            "wire": self.wire.name,
            "place": "host" if self.device is None else f"GPU {self.device}",
        }
