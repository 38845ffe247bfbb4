"""Horovod's ``horovod.torch`` API on mpigpu: ``import mpigpu.horovod.torch as hvd``.

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

Launch with ``mpiexec -n 4 python -m mpigpu.run train.py``. docs/horovod.md lists every name, what
mpigpu does for it and what is not supported (Adasum, elastic training, the timeline, Spark/Ray).
"""

from __future__ import annotations

from typing import Any

from mpigpu.horovod._errors import HorovodInternalError, HostsUpdatedInterrupt, unsupported
from mpigpu.horovod._state import (
    ProcessSet,
    add_process_set,
    comm_of,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_threads_supported,
    rank,
    remove_process_set,
    shutdown,
    size,
)
from mpigpu.horovod.torch import _handles
from mpigpu.horovod.torch._broadcast import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from mpigpu.horovod.torch._gather import (
    allgather,
    allgather_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    sparse_allreduce_async,
)
from mpigpu.horovod.torch._handles import poll, synchronize
from mpigpu.horovod.torch._join import join
from mpigpu.horovod.torch._ops import (
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from mpigpu.horovod.torch._optimizer import DistributedOptimizer
from mpigpu.horovod.torch._scatter import (
    alltoall,
    alltoall_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from mpigpu.horovod.torch._sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]  # fmt: skip


def mpi_built() -> bool:
    """True: mpigpu always runs on MPI."""
    return True


def mpi_enabled() -> bool:
    """True: MPI is the only controller (there is no Gloo)."""
    return True


def gloo_built() -> bool:
    """False: mpigpu has no Gloo controller."""
    return False


def gloo_enabled() -> bool:
    """False: mpigpu has no Gloo controller."""
    return False


def nccl_built() -> int:
    """The NCCL version code (e.g. 22304 for 2.23.4) if NCCL loads on every rank, else 0, as Horovod
    returns it (after init; before it, whether it loads here)."""
    if is_initialized():
        from mpigpu.runtime.context import Context

        info = Context.get(comm_of(global_process_set)).nccl
    else:
        from mpigpu.job.detect import detect_nccl

        info = detect_nccl(1)
    if not info.available:
        return 0
    major, minor, patch = (int(part) for part in info.version.split("."))
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    """True if this PyTorch sees a CUDA GPU (mpigpu needs no build step for CUDA)."""
    import torch

    return bool(torch.cuda.is_available())


def rocm_built() -> bool:
    """False: mpigpu runs on NVIDIA GPUs only."""
    return False


def ddl_built() -> bool:
    """False."""
    return False


def ccl_built() -> bool:
    """False."""
    return False


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the process set has arrived. As in Horovod, the calls every rank had
    issued before are then complete; a call some rank has not issued yet stays in flight."""
    comm_of(process_set)  # not initialized, or a rank outside the set: ValueError here
    _handles.barrier(process_set)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Not supported: mpigpu has no timeline."""
    raise unsupported("hvd.start_timeline", "profile with torch.profiler or Nsight Systems (nsys)")


def stop_timeline() -> None:
    """Not supported: mpigpu has no timeline."""
    raise unsupported("hvd.stop_timeline", "profile with torch.profiler or Nsight Systems (nsys)")


class _Unsupported:
    """``hvd.elastic``: any use raises NotImplementedError naming the alternative."""

    def __init__(self, what: str, instead: str) -> None:
        self._what, self._instead = what, instead

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise unsupported(f"{self._what}.{name}", self._instead)


elastic = _Unsupported("hvd.elastic", "restart the job from a checkpoint with a fixed set of ranks under mpiexec")
