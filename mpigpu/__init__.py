"""mpigpu: average gradients across GPUs with MPI.

    from mpigpu import allreduce
    allreduce(grad)                 # in place, averaged over all ranks, backend chosen by size

Importing mpigpu starts nothing: MPI, CUDA and the GPU libraries load on first use. It installs
exception hooks that end every rank of the job when one rank dies of an uncaught exception while
MPI runs with more than one rank (MPIGPU_ABORT_ON_EXCEPTION=0 turns them off).
"""

from mpigpu import _moved
from mpigpu._version import __version__
from mpigpu.calls import (
    Graph,
    Handle,
    IpcGraph,
    Request,
    allgather,
    allgather_object,
    allreduce,
    allreduce_async,
    allreduce_init,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_object,
    explain,
    ipc_buffer,
    ipc_graph,
    local_rank,
    local_size,
    rank,
    reduce_scatter,
    reduce_scatter_async,
    select_device,
    size,
)
from mpigpu.core.errors import (
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
from mpigpu.core.ops import Op
from mpigpu.core.timing import Result
from mpigpu.job import failsafe as _failsafe
from mpigpu.job.device import GpuInfo
from mpigpu.job.failsafe import install_abort_handler
from mpigpu.multi import local_devices, on_device
from mpigpu.runtime.context import finalize
from mpigpu.runtime.plan import Choice
from mpigpu.training.averager import Averager
from mpigpu.training.broadcast_state import broadcast_optimizer_state, broadcast_parameters
from mpigpu.training.torch import BackwardAverager

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
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "explain",
    "finalize",
    "install_abort_handler",
    "ipc_buffer",
    "ipc_graph",
    "local_devices",
    "local_rank",
    "local_size",
    "on_device",
    "rank",
    "reduce_scatter",
    "reduce_scatter_async",
    "select_device",
    "size",
]

_failsafe.hook_at_import()
_moved.install()  # old module paths (mpigpu._moved.MOVED) keep importing, with a DeprecationWarning
