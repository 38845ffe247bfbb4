"""The calls users write, each a family of one road (``pipeline``): the reductions (``reduce``:
allreduce, reduce_scatter), data movement (``move``: broadcast, allgather, alltoall), Python objects
(``objects``), the async forms' machinery (``handles``), persistent requests (``persistent``) and
the ipc backend's registered memory and graphs (``ipc``). Call keys are in ``keys``. allreduce over
several devices per process takes the same road in ``devices`` (its async forms: ``devices_async``)."""

from mpigpu.calls.handles import Handle
from mpigpu.calls.ipc import IpcGraph, ipc_buffer, ipc_graph
from mpigpu.calls.move import allgather, alltoall, alltoall_async, broadcast
from mpigpu.calls.objects import allgather_object, broadcast_object
from mpigpu.calls.persistent import Graph, Request, allreduce_init
from mpigpu.calls.ranks import barrier, local_rank, local_size, rank, size
from mpigpu.calls.reduce import (
    allreduce,
    allreduce_async,
    explain,
    reduce_scatter,
    reduce_scatter_async,
    select_device,
)

__all__ = [
    "Graph",
    "Handle",
    "IpcGraph",
    "Request",
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
    "explain",
    "ipc_buffer",
    "ipc_graph",
    "local_rank",
    "local_size",
    "rank",
    "reduce_scatter",
    "reduce_scatter_async",
    "select_device",
    "size",
]
