"""mpigpu: average gradients across GPUs with MPI.

    from mpigpu import allreduce
    allreduce(grad)                 # in place, averaged over all ranks, backend chosen by size

Importing mpigpu starts nothing: MPI, CUDA and the GPU libraries load on first use.
"""

from mpigpu.api import allreduce, explain
from mpigpu.context import finalize
from mpigpu.device import GpuInfo, select_device
from mpigpu.errors import (
    BackendUnavailable,
    CollectiveTimeout,
    ConfigError,
    DeviceError,
    InvalidArgument,
    KernelCompileError,
    MismatchError,
    MissingDependency,
    MpigpuError,
)
from mpigpu.ops import Op
from mpigpu.plan import Choice
from mpigpu.timing import Result

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "Choice",
    "CollectiveTimeout",
    "ConfigError",
    "DeviceError",
    "GpuInfo",
    "InvalidArgument",
    "KernelCompileError",
    "MismatchError",
    "MissingDependency",
    "MpigpuError",
    "Op",
    "Result",
    "__version__",
    "allreduce",
    "explain",
    "finalize",
    "select_device",
]
