"""The node-shared segment's barrier (mpigpu/job/shm.py), under mpiexec (-n 1 to 4): what one rank
wrote before it every rank reads after it, over thousands of barriers in a row; and a rank that waits
for a late one gives its core away instead of spinning on it (issue 39: 4 ranks x 8 threads on 2
cores, where MPICH's MPI_Barrier spun a core per waiting thread and starved the thread everybody
waited for)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mpigpu.job.shm import SharedSegment


def _node_comm(comm):
    from mpi4py import MPI

    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


@pytest.mark.mpi(min_size=1)
def test_what_each_rank_wrote_before_a_barrier_every_rank_reads_after_it(comm) -> None:
    node = _node_comm(comm)
    rank, n = node.Get_rank(), node.Get_size()
    try:
        with SharedSegment(node, 8 * n) as segment:
            slots = segment.view(0, n, np.int64)
            stale = []
            for i in range(1, 3001):
                slots[rank] = i * n + rank  # this round's value, never the previous one
                segment.barrier()
                want = i * n + np.arange(n)
                if not np.array_equal(slots, want):
                    stale.append((i, slots.tolist()))
                segment.barrier()  # nobody writes round i + 1 before every rank has read round i
            assert stale == [], f"rank {rank} read values from before a barrier: {stale[:3]}"
    finally:
        node.Free()


@pytest.mark.mpi(min_size=2)
def test_a_rank_waiting_for_a_late_one_gives_its_core_away(comm) -> None:
    node = _node_comm(comm)
    rank = node.Get_rank()
    late_s = 1.0
    try:
        with SharedSegment(node, 64) as segment:
            for _ in range(10):  # past MPICH's switch to its spinning shared-memory collectives
                segment.barrier()
            if rank == node.Get_size() - 1:
                time.sleep(late_s)
            wall, cpu = time.perf_counter(), time.thread_time()
            segment.barrier()
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            if rank != node.Get_size() - 1:
                assert wall > 0.5 * late_s, f"rank {rank} left the barrier before the late rank came ({wall:.3f} s)"
                # a spinning wait uses about a core for the whole second (MPI_Barrier in MPICH: 1.0 s)
                assert cpu < 0.4 * late_s, f"rank {rank} spent {cpu:.3f} s of CPU waiting {wall:.3f} s in the barrier"
    finally:
        node.Free()
