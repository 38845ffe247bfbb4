"""mpigpu: average gradients across GPUs with MPI.

    from mpigpu import allreduce
    allreduce(grad)                 # in place, averaged over all ranks, backend chosen by size

Importing mpigpu starts nothing: MPI, CUDA and the GPU libraries load on first use.
"""

from mpigpu._version import __version__
from mpigpu.api import allreduce, explain, select_device
from mpigpu.averager import Averager
from mpigpu.broadcast_state import broadcast_optimizer_state, broadcast_parameters
from mpigpu.collectives import allgather, broadcast
from mpigpu.context import finalize
from mpigpu.device import GpuInfo
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
from mpigpu.failsafe import install_abort_handler
from mpigpu.handles import Handle, allreduce_async
from mpigpu.integrations.torch import BackwardAverager
from mpigpu.ipc import IpcGraph, ipc_buffer, ipc_graph
from mpigpu.objects import allgather_object, broadcast_object
from mpigpu.ops import Op
from mpigpu.persistent import Graph, Request, allreduce_init
from mpigpu.plan import Choice
from mpigpu.timing import Result

__all__ = [
    "Averager",
    "BackendUnavailable",
    "BackwardAverager",
    "Choice",
    "CollectiveTimeout",
    "ConfigError",
    "DeviceError",
    "GpuInfo",
    "Graph",
    "Handle",
    "InvalidArgument",
    "IpcGraph",
    "KernelCompileError",
    "MismatchError",
    "MissingDependency",
    "MpigpuError",
    "Op",
    "Request",
    "Result",
    "__version__",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_async",
    "allreduce_init",
    "broadcast",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "explain",
    "finalize",
    "install_abort_handler",
    "ipc_buffer",
    "ipc_graph",
    "select_device",
]
