"""Which ranks share a node: the node communicator, the node-local rank, and the communicator
between nodes. ``MPIGPU_NODE_SIZE=N`` splits each physical node into virtual nodes of N ranks, so
the multi-node code runs (and is tested) on one machine.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from mpigpu.core._mpi import MPI
from mpigpu.core.typed import allgather_ints, allgather_text, allreduce_int

__all__ = ["Layout", "build_layout", "node_ranks"]


@dataclass
class Layout:
    """Where this rank sits. Built collectively over ``comm``; free with ``close()``."""

    comm: Any
    rank: int
    size: int
    phys_comm: Any  # ranks sharing this physical node (shared memory works among them)
    phys_rank: int  # node-local rank on the physical node: the GPU mapping uses this
    phys_size: int
    node_comm: Any  # ranks of this (possibly virtual) node
    local_rank: int
    local_size: int
    node_index: int
    num_nodes: int
    node_sizes: tuple[int, ...]  # ranks per node, by node index
    nodes: list[list[int]]  # the ranks of comm on each node, by node index (node_ranks)
    inter_comm: Any | None  # ranks with this local_rank on every node (None on a single node)
    hostnames: tuple[str, ...]  # per world rank of comm
    virtual: bool  # MPIGPU_NODE_SIZE split the physical nodes

    def close(self) -> None:
        """Free the communicators this layout created (idempotent)."""
        for name in ("inter_comm", "node_comm", "phys_comm"):
            sub = getattr(self, name)
            if sub is not None and sub != MPI().COMM_NULL:
                try:
                    if not MPI().Is_finalized():
                        sub.Free()
                except Exception:
                    pass
            setattr(self, name, None)


def build_layout(comm: Any, node_size: int | None) -> Layout:
    """Split ``comm`` by shared memory (and by ``node_size`` within a node, if given)."""
    mpi = MPI()
    rank, size = comm.Get_rank(), comm.Get_size()
    phys = comm.Split_type(mpi.COMM_TYPE_SHARED, key=rank)
    phys_rank, phys_size = phys.Get_rank(), phys.Get_size()
    if node_size is not None and node_size < phys_size:
        node = phys.Split(color=phys_rank // node_size, key=phys_rank)
        virtual = True
    else:
        node = phys.Dup()
        virtual = False
    local_rank, local_size = node.Get_rank(), node.Get_size()
    nodes = node_ranks(comm, node)
    node_index = next(i for i, members in enumerate(nodes) if rank in members)
    num_nodes = len(nodes)
    node_sizes = tuple(len(members) for members in nodes)
    hostnames = tuple(allgather_text(comm, socket.gethostname()))
    inter = comm.Split(color=local_rank, key=node_index) if num_nodes > 1 else None
    return Layout(
        comm=comm,
        rank=rank,
        size=size,
        phys_comm=phys,
        phys_rank=phys_rank,
        phys_size=phys_size,
        node_comm=node,
        local_rank=local_rank,
        local_size=local_size,
        node_index=node_index,
        num_nodes=num_nodes,
        node_sizes=node_sizes,
        nodes=nodes,
        inter_comm=inter,
        hostnames=hostnames,
        virtual=virtual,
    )


def node_ranks(comm: Any, node: Any) -> list[list[int]]:
    """The ranks of ``comm`` on each node, where ``node`` (a split of ``comm``) holds this rank's: each
    node's ranks ascending, the nodes numbered by their lowest rank, so every rank gets the same list
    (collective over ``node``, then ``comm``)."""
    leader = allreduce_int(node, comm.Get_rank(), "min")
    members: dict[int, list[int]] = {}
    for r, (lead,) in enumerate(allgather_ints(comm, [leader])):
        members.setdefault(lead, []).append(r)
    return [members[lead] for lead in sorted(members)]
