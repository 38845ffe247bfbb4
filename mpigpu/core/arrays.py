"""One view of any array a user can pass: NumPy, CuPy, PyTorch, JAX, Numba, or anything with
``__dlpack__`` / ``__cuda_array_interface__`` / the buffer protocol.

A view records where the data lives (host, or a CUDA ordinal in this process's numbering), the
pointer, the element type and whether it may be written. Anything that cannot work is refused
here, before any data is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpigpu.core.dtypes import DType, parse_dtype
from mpigpu.core.errors import InvalidArgument

__all__ = [
    "ArrayView",
    "as_view",
    "check_out",
    "copy_single",
    "framework_of",
    "pointer_device",
    "raw_view",
    "require_c_order",
    "scalar_fix",
    "torch_cpu_array",
]

_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13


@dataclass(slots=True)
class ArrayView:
    """Where an array's elements are and what they are."""

    obj: Any  # the caller's object
    ptr: int
    shape: tuple[int, ...]
    dtype: DType
    device: int | None  # CUDA ordinal (this process's numbering), None for host memory
    readonly: bool
    framework: str  # numpy, cupy, torch, jax, numba, cuda-array, dlpack, buffer
    host: np.ndarray | None = None  # zero-copy NumPy view of host data, C-order (a Fortran array's transpose)
    keepalive: Any = None  # whatever must outlive the view (DLPack capsule owners, ...)
    order: str = "C"  # "F": a dense Fortran-order host array (elementwise collectives take it as it is)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def on_device(self) -> bool:
        return self.device is not None

    @property
    def placement(self) -> int:
        """What the cross-rank check compares of the memory: 0 host (C order), 1 GPU, 2 host in Fortran
        order (an elementwise reduction pairs element i of every rank only if all lay them out alike)."""
        return 1 if self.device is not None else (2 if self.order == "F" else 0)

    @property
    def where(self) -> str:
        return "host" if self.device is None else f"GPU {self.device}"

    def overlaps(self, other: ArrayView) -> bool:
        if self.device != other.device or self.nbytes == 0 or other.nbytes == 0:
            return False
        return self.ptr < other.ptr + other.nbytes and other.ptr < self.ptr + self.nbytes

    def same_memory(self, other: ArrayView) -> bool:
        return self.device == other.device and self.ptr == other.ptr and self.nbytes == other.nbytes

    def with_host(self, host: np.ndarray) -> ArrayView:
        """This view over ``host``, an array of the same shape, dtype and layout (C order: a Fortran
        array's transpose) lent for one call: how a call record, which keeps no array, is run."""
        return ArrayView(None, self.ptr, self.shape, self.dtype, None, self.readonly, self.framework, host, None,
                         self.order)  # fmt: skip


def framework_of(obj: Any) -> str:
    """The array library an object comes from ("numpy", "torch", "cupy", "jax", ...)."""
    if isinstance(obj, np.ndarray):
        return "numpy"
    module = type(obj).__module__.split(".")[0]
    if module in ("torch", "cupy", "jax", "jaxlib", "numba"):
        return "jax" if module == "jaxlib" else module
    if hasattr(obj, "__cuda_array_interface__"):
        return "cuda-array"
    if hasattr(obj, "__dlpack__"):
        return "dlpack"
    return "buffer"


def _contiguous_c(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> bool:
    """True if byte ``strides`` describe a dense C-order layout (None means C-contiguous)."""
    if strides is None:
        return True
    expected = itemsize
    for extent, stride in zip(reversed(shape), reversed(strides), strict=True):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


_C_ORDER_FIX = {"numpy": "np.ascontiguousarray(x)", "cupy": "cupy.ascontiguousarray(x)", "torch": "x.contiguous()"}


def _not_contiguous(framework: str, fortran: bool = False) -> InvalidArgument:
    fix = _C_ORDER_FIX.get(framework, "a contiguous copy")
    if fortran:
        return InvalidArgument(
            f"the array is in Fortran (column-major) order ({framework}); this path takes dense C-order "
            f"memory. Pass {fix}, and copy the result back if you need the Fortran layout"
        )
    return InvalidArgument(
        f"the array is not contiguous ({framework}); mpigpu reduces dense C-order memory. Pass {fix}, "
        "and copy the result back if you need it in the original layout"
    )


def require_c_order(view: ArrayView, what: str, name: str = "x") -> None:
    """Refuse a Fortran-order array where the layout is not elementwise (``what`` names the call)."""
    if view.order != "C":
        fix = _C_ORDER_FIX.get(view.framework, "a C-order copy").replace("(x)", f"({name})")
        raise InvalidArgument(f"{name} is in Fortran (column-major) order, but {what} takes C order: pass {fix}")


def _base_ndarray(arr: np.ndarray, name: str) -> np.ndarray:
    """A subclass of ndarray as the plain ndarray of the same memory, or InvalidArgument where its
    elements are not what the memory holds (a masked array's masked elements are still in memory)."""
    if isinstance(arr, np.ma.MaskedArray):
        raise InvalidArgument(
            f"{name} is a masked array: mpigpu reduces every element in memory and cannot honour the mask. "
            f"Pass {name}.filled(value) (a value that leaves the result unchanged, e.g. 0 for a sum), and "
            "reduce the mask separately if ranks mask different elements"
        )
    return arr.view(np.ndarray)  # np.matrix & co. redefine operators; the memory is the same


def _dtype_of(value: Any) -> DType:
    """The DType of an array's dtype (NumPy, torch, CuPy, JAX): the one place a view reads it."""
    return parse_dtype(value)


def _from_numpy(arr: np.ndarray, obj: Any, framework: str, name: str = "x") -> ArrayView:
    if type(arr) is not np.ndarray:
        arr = _base_ndarray(arr, name)
    dtype = _dtype_of(arr.dtype)
    order = "C"
    if not arr.flags.c_contiguous:
        if not (arr.flags.f_contiguous and framework == "numpy"):
            raise _not_contiguous(framework, arr.flags.f_contiguous)
        arr, order = arr.T, "F"  # the same memory, in C order: what the backends read
    ptr = arr.__array_interface__["data"][0]
    return ArrayView(
        obj=obj,
        ptr=ptr,
        shape=tuple(arr.shape) if order == "C" else tuple(reversed(arr.shape)),
        dtype=dtype,
        device=None,
        readonly=not arr.flags.writeable,
        framework=framework,
        host=arr,
        order=order,
    )


def _torch_cpu(obj: Any) -> ArrayView:
    if not obj.is_contiguous():
        raise _not_contiguous("torch")
    return _from_numpy(torch_cpu_array(obj), obj, "torch")


def torch_cpu_array(obj: Any) -> np.ndarray:
    """A CPU tensor's memory as a NumPy array, no copy (bfloat16 as ml_dtypes'): what a call record's
    launch is lent for a tensor its key already found valid (mpigpu.calls.pipeline.host_of)."""
    import torch

    tensor = obj.detach()
    if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16: view the bits, then relabel
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    try:
        return tensor.numpy()
    except TypeError as exc:
        raise InvalidArgument(f"unsupported dtype {tensor.dtype} for a CPU tensor: {exc}") from None


def _device_view(obj: Any, framework: str) -> ArrayView:
    """A CUDA array, through cuda.core's StridedMemoryView (DLPack first, then CAI)."""
    from mpigpu.core._cuda import require_cuda_core

    require_cuda_core("GPU arrays")
    from cuda.core.utils import StridedMemoryView

    try:
        view = StridedMemoryView.from_any_interface(obj, stream_ptr=-1)  # -1: mpigpu orders streams itself
    except (BufferError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidArgument(f"cannot read the {framework} array's memory: {exc}") from None
    if not view.is_device_accessible or view.device_id < 0:
        return _from_numpy(np.from_dlpack(obj), obj, framework)
    dtype = _dtype_of(view.dtype)
    shape = tuple(int(s) for s in view.shape)
    strides = None if view.strides is None else tuple(int(s) * dtype.itemsize for s in view.strides)
    if not _contiguous_c(shape, strides, dtype.itemsize):
        raise _not_contiguous(framework)
    return ArrayView(
        obj=obj,
        ptr=int(view.ptr),
        shape=shape,
        dtype=dtype,
        device=pointer_device(int(view.ptr), int(view.device_id)),
        readonly=bool(view.readonly),
        framework=framework,
        keepalive=view,
    )


def _cupy_view(arr: Any) -> ArrayView:
    """CuPy arrays, read directly (the generic DLPack route costs ~10 us per call)."""
    if not arr.flags.c_contiguous:
        raise _not_contiguous("cupy", arr.flags.f_contiguous)
    return ArrayView(arr, int(arr.data.ptr), arr.shape, _dtype_of(arr.dtype), arr.device.id, False, "cupy")


def _torch_cuda_view(tensor: Any) -> ArrayView:
    """PyTorch CUDA tensors, read directly."""
    if not tensor.is_contiguous():
        raise _not_contiguous("torch")
    device = tensor.device.index
    return ArrayView(
        tensor, int(tensor.data_ptr()), tuple(tensor.shape), _dtype_of(tensor.dtype), device, False, "torch"
    )


def _jax_gpu_view(array: Any, device: Any) -> ArrayView:
    """JAX GPU arrays: immutable, dense, and computed asynchronously on JAX's own streams, so wait for
    them and read the buffer directly (JAX's __dlpack__ rejects stream -1 and its CUDA array
    interface is version 2, which cuda.core does not take)."""
    if len(array.devices()) != 1:
        raise InvalidArgument("x is a JAX array sharded over several devices: pass one device's shard")
    array.block_until_ready()
    ptr = int(array.unsafe_buffer_pointer())
    return ArrayView(
        array,
        ptr,
        tuple(array.shape),
        _dtype_of(array.dtype),
        int(device.local_hardware_id if getattr(device, "local_hardware_id", None) is not None else device.id),
        True,
        "jax",
    )


def pointer_device(ptr: int, reported: int) -> int:
    """The GPU that owns ``ptr`` (``reported`` where the driver does not know it). The CUDA array interface
    carries no device, and a view built from it reports the current one, so ask the driver (seen: Numba
    arrays on GPU 1 reported as GPU 0)."""
    if ptr == 0:
        return reported
    from mpigpu.core._cuda import cupy

    try:
        return int(cupy().cuda.runtime.pointerGetAttributes(ptr).device)
    except Exception:  # not a CUDA allocation the runtime knows: trust the producer
        return reported


def _dlpack_device(obj: Any) -> tuple[int, int] | None:
    try:
        dev_type, dev_id = obj.__dlpack_device__()
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None
    return int(dev_type), int(dev_id)


def as_view(obj: Any, *, name: str = "x") -> ArrayView:
    """Describe ``obj`` without copying it, or raise InvalidArgument saying what to pass instead."""
    kind = type(obj)
    if kind is np.ndarray:  # the most common host array first: no framework probing
        return _from_numpy(obj, obj, "numpy")
    if kind is ArrayView:
        return obj
    if kind.__name__ == "ndarray" and kind.__module__.startswith("cupy"):
        return _cupy_view(obj)
    if kind.__name__ == "Tensor" and kind.__module__.startswith("torch") and obj.is_cuda:
        return _torch_cuda_view(obj)
    if kind.__module__.startswith(("jax", "jaxlib")) and hasattr(obj, "unsafe_buffer_pointer"):
        device = next(iter(obj.devices()))
        if device.platform == "gpu":
            return _jax_gpu_view(obj, device)
    framework = framework_of(obj)
    if framework == "numpy":
        return _from_numpy(obj, obj, "numpy", name)
    if framework == "torch":
        if getattr(obj, "is_cuda", False):
            return _device_view(obj.detach(), "torch")
        if getattr(obj, "device", None) is not None and obj.device.type != "cpu":
            raise InvalidArgument(f"{name} is a torch tensor on {obj.device}: mpigpu takes CPU or CUDA tensors")
        return _torch_cpu(obj)
    if framework in ("jax",) or hasattr(obj, "__dlpack_device__"):
        device = _dlpack_device(obj)
        if device is not None and device[0] in (_KDL_CPU, _KDL_CUDA_HOST):
            try:
                arr = np.from_dlpack(obj)
            except (BufferError, TypeError, RuntimeError):
                arr = np.asarray(obj)
            view = _from_numpy(arr, obj, framework)
            if framework == "jax":  # JAX arrays are immutable: never written in place
                view = _replace(view, readonly=True)
            return view
        if device is not None and device[0] in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            if framework == "jax":  # JAX computes asynchronously on its own streams: wait for x
                obj.block_until_ready()
            view = _device_view(obj, framework)
            return _replace(view, readonly=True) if framework == "jax" else view
    if hasattr(obj, "__cuda_array_interface__"):
        return _device_view(obj, framework)
    if isinstance(obj, np.generic):  # a NumPy scalar: np.asarray copies it, so it can be read, never written
        return _replace(_from_numpy(np.asarray(obj), obj, "numpy"), readonly=True)
    if hasattr(obj, "__array_interface__") or isinstance(obj, (bytearray, memoryview)):
        return _from_numpy(np.asarray(obj), obj, framework)  # these protocols never copy
    raise InvalidArgument(
        f"{name} must be an array (NumPy, CuPy, PyTorch, JAX, or an object with __dlpack__, "
        f"__cuda_array_interface__ or __array_interface__), not {type(obj).__module__}.{type(obj).__name__}"
    )


def _replace(view: ArrayView, **changes: Any) -> ArrayView:
    from dataclasses import replace

    return replace(view, **changes)


_ORDER = {"C": "C (row-major)", "F": "Fortran (column-major)"}


def scalar_fix(view: ArrayView, name: str = "x") -> str | None:
    """For a NumPy scalar, which cannot be written, what to pass instead; None for anything else."""
    if not isinstance(view.obj, np.generic):
        return None
    return (
        f"{name} is a NumPy scalar ({type(view.obj).__name__}), which cannot be changed in place: pass a "
        f"0-d or 1-element array (np.array({name})) and read the result from it, or pass out=<0-d array>"
    )


def check_out(x: ArrayView, out: ArrayView) -> None:
    """Refuse an ``out`` that cannot receive x's result (shape, dtype, place, aliasing, read-only)."""
    if out.shape != x.shape:
        raise InvalidArgument(f"out has shape {out.shape}, but x has shape {x.shape}: they must match")
    if out.dtype != x.dtype:
        raise InvalidArgument(
            f"out has dtype {out.dtype.name}, but x has {x.dtype.name}: they must match (cast afterwards if needed)"
        )
    if out.device != x.device:
        raise InvalidArgument(f"out is on {out.where} but x is on {x.where}: put both in the same place")
    if out.readonly:
        raise InvalidArgument("out is read-only; pass a writable array")
    if out.order != x.order:
        raise InvalidArgument(
            f"out is in {_ORDER[out.order]} order but x in {_ORDER[x.order]} order: pass an out laid out like x "
            "(np.empty_like(x))"
        )
    if out.overlaps(x) and not out.same_memory(x):
        raise InvalidArgument(
            "out overlaps x only partly; pass the same array (in place) or one that does not overlap x"
        )


def copy_single(x: ArrayView, out: ArrayView, stream: Any, x_host: Any = None, out_host: Any = None) -> None:
    """One participant: every op's result is the input itself, so copy (or, in place, do nothing) on
    ``stream`` (a StreamRef, or None: the legacy default stream) of the current GPU; the host arrays,
    where given, are this call's (a record's views hold none).

    No backend is called. Besides saving the launch, this avoids NCCL 2.28's single-rank ncclAvg on
    float64, which leaves the last elements of an out-of-place result unwritten."""
    if x.same_memory(out):
        return
    source = x.host if x_host is None else x_host
    if source is not None:
        (out.host if out_host is None else out_host)[...] = source
        return
    from mpigpu.core._cuda import cupy

    runtime = cupy().cuda.runtime
    handle = stream.handle if stream is not None else 0
    runtime.memcpyAsync(out.ptr, x.ptr, x.nbytes, runtime.memcpyDeviceToDevice, handle)


# -- raw memory: buffers handed over by a runtime (XLA's FFI), with no array object ---------------------------------


def raw_view(
    ptr: int, shape: tuple[int, ...], dtype: Any, device: int | None, *, readonly: bool, framework: str = "xla"
) -> ArrayView:
    """A view of dense C-order memory at ``ptr`` that no array object owns (an XLA FFI buffer).

    ``device`` is the CUDA ordinal, or None for host memory (then ``host`` is a zero-copy NumPy view).
    The caller guarantees that the memory stays valid while the view is used."""
    dt = parse_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    host = None
    if device is None:
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes == 0 or ptr == 0:
            host = np.empty(shape, dt.np)
        else:
            import ctypes

            host = np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dt.np).reshape(shape)
        if readonly:
            host.flags.writeable = False
    return ArrayView(None, int(ptr), shape, dt, device, readonly, framework, host=host)
