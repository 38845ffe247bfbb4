"""Lazy access to the CUDA stack (cuda.core for devices, kernels, streams and events; CuPy for the
runtime calls and scratch arrays). Nothing here is imported until a GPU is actually used, and a
missing package is a MissingDependency that says what to install.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from mpigpu.core.errors import InvalidArgument, MissingDependency, install_hint

__all__ = [
    "INSTALL_CUDA_EXTRA",
    "StreamRef",
    "as_core_stream",
    "core_stream",
    "cuda_version",
    "cupy",
    "cupy_stream",
    "require_cuda_core",
    "resolve_stream",
    "set_device",
    "timing_event",
    "visible_device_count",
]

_current = threading.local()
_CUDA12 = install_hint("cuda12", "cupy-cuda12x 'cuda-core[cu12]' nvidia-nccl-cu12")
_CUDA13 = install_hint("cuda13", "cupy-cuda13x 'cuda-core[cu13]' nvidia-nccl-cu13")
INSTALL_CUDA_EXTRA = f"for a CUDA 12 driver {_CUDA12}; for CUDA 13 {_CUDA13}"


@functools.cache
def require_cuda_core(what: str = "the GPU paths") -> ModuleType:
    """Import cuda.core (NVRTC, devices, streams, events)."""
    try:
        import cuda.core as core
    except ImportError as exc:
        raise MissingDependency(f"{what} need cuda.core, which is not installed: {INSTALL_CUDA_EXTRA}") from exc
    return core


@functools.cache
def cupy(what: str = "the GPU paths") -> ModuleType:
    """Import CuPy (runtime calls, scratch arrays, NCCL bindings)."""
    try:
        import cupy as cp
    except ImportError as exc:
        raise MissingDependency(f"{what} need CuPy, which is not installed: {INSTALL_CUDA_EXTRA}") from exc
    return cp


@functools.cache
def visible_device_count() -> int:
    """GPUs visible to this process (honours CUDA_VISIBLE_DEVICES); 0 without cuda.core or a driver."""
    try:
        core = require_cuda_core()
    except MissingDependency:
        return 0
    try:
        return len(core.Device.get_all_devices())
    except Exception:  # no driver, no device: the CPU path
        return 0


def set_device(index: int) -> Any:
    """Make GPU ``index`` current for cuda.core and CuPy on this thread; return its cuda.core Device.

    Cheap when it already is (one runtime query), so backends call it on every collective: user code
    may have switched devices in between."""
    core = require_cuda_core()
    device = core.Device(index)
    runtime = cupy().cuda.runtime
    if getattr(_current, "index", None) != index or runtime.getDevice() != index:
        device.set_current()
        runtime.setDevice(index)
        _current.index = index
    return device


def cuda_version() -> str:
    """Driver and runtime versions, e.g. "driver 13.0, runtime 13.0" ("" when unknown)."""
    try:
        runtime = cupy().cuda.runtime
        drv, rt = runtime.driverGetVersion(), runtime.runtimeGetVersion()
    except Exception:
        return ""
    return f"driver {drv // 1000}.{drv % 1000 // 10}, runtime {rt // 1000}.{rt % 1000 // 10}"


@dataclass(frozen=True)
class StreamRef:
    """A CUDA stream handle that cuda.core can launch on (``__cuda_stream__`` protocol)."""

    handle: int

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def resolve_stream(stream: Any, framework: str, device: int | None) -> StreamRef:
    """The stream a call is ordered on: ``stream`` if given, else the array framework's current
    stream (CuPy, PyTorch), else the legacy default stream."""
    if stream is None:
        if framework == "cupy":  # the array's device's current stream (a list call spans devices)
            cp = cupy().cuda
            current = cp.get_current_stream(device) if device is not None else cp.get_current_stream()
            return StreamRef(int(current.ptr))
        if framework == "torch" and device is not None:
            return StreamRef(int(_torch_current_stream()(device)))
        return StreamRef(0)
    if isinstance(stream, StreamRef):
        return stream
    if isinstance(stream, int) and not isinstance(stream, bool):
        return StreamRef(stream)
    if hasattr(stream, "__cuda_stream__"):
        proto = stream.__cuda_stream__
        version_handle = proto() if callable(proto) else proto
        return StreamRef(int(version_handle[1]))
    for attr in ("cuda_stream", "ptr", "handle"):  # torch.cuda.Stream, cupy Stream, others
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return StreamRef(value)
    raise InvalidArgument(
        f"stream must be a cuda.core Stream, a CuPy or PyTorch stream, an object with __cuda_stream__, "
        f"or an int handle; got {type(stream).__name__}"
    )


@functools.cache
def _torch_current_stream() -> Any:
    """device -> the handle of PyTorch's current stream on it. ``torch._C._cuda_getCurrentRawStream``
    (what torch.compile's generated code calls) returns the handle without building a torch.cuda.Stream
    object, ~2 us cheaper per call; the public call where a PyTorch build lacks it."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


@functools.cache
def core_stream(handle: int) -> Any:
    """A cuda.core Stream wrapping an existing handle (cached; never destroys the stream)."""
    core = require_cuda_core()
    if handle == 0:
        return core.LEGACY_DEFAULT_STREAM
    return core.Stream.from_handle(handle)


def as_core_stream(stream: Any) -> Any:
    """``stream`` as a cuda.core Stream, for cuda.core calls such as ``launch``: cuda.core deprecates
    being handed foreign stream objects, so anything resolve_stream takes (a StreamRef, a CuPy or
    PyTorch stream, an int handle) is wrapped, once per handle (core_stream); a Stream passes as is."""
    if isinstance(stream, StreamRef):  # the common case: one dict look-up once wrapped
        return core_stream(stream.handle)
    if isinstance(stream, require_cuda_core().Stream):
        return stream
    return core_stream(resolve_stream(stream, "", None).handle)


def cupy_stream(handle: int) -> Any:
    """A CuPy stream for an existing handle, which CuPy never destroys: ``Stream.from_external``
    (CuPy 14 deprecates ExternalStream for it), ExternalStream where CuPy (13) lacks it."""
    cuda = cupy().cuda
    from_external = getattr(cuda.Stream, "from_external", None)
    if from_external is None:
        return cuda.ExternalStream(handle)
    return from_external(StreamRef(handle))


@functools.cache
def _timing_options() -> Any:
    return require_cuda_core().EventOptions(timing_enabled=True)


def timing_event(stream: StreamRef) -> Any:
    """Record a timing-enabled cuda.core Event on ``stream``."""
    return core_stream(stream.handle).record(options=_timing_options())
