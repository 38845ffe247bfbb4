"""mpigpu.rank(), size(), local_rank(), local_size() and barrier() (mpiexec -n 1 to 4, and across MPI's
nodes): the same numbers as MPI's own, on the world and on ``comm=``; a barrier returns on no rank
before every rank has reached it; a rank in another collective makes every rank raise, and the next
call pairs."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import outside_job_env

import mpigpu
from mpigpu.core.errors import MismatchError

pytestmark = pytest.mark.mpi(min_size=1)


def test_rank_and_size_are_mpis_on_the_world_and_on_comm(comm) -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    assert (mpigpu.rank(), mpigpu.size()) == (world.Get_rank(), world.Get_size())
    half = comm.Split(color=comm.Get_rank() % 2, key=-comm.Get_rank())  # reversed order: ranks differ
    try:
        assert (mpigpu.rank(comm=half), mpigpu.size(comm=half)) == (half.Get_rank(), half.Get_size())
        node = half.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            assert (mpigpu.local_rank(half), mpigpu.local_size(half)) == (node.Get_rank(), node.Get_size())
        finally:
            node.Free()
    finally:
        half.Free()
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        assert (mpigpu.local_rank(), mpigpu.local_size()) == (node.Get_rank(), node.Get_size())
    finally:
        node.Free()


def test_no_rank_leaves_a_barrier_before_every_rank_reached_it(comm) -> None:
    """Each rank leaves a mark, then waits in barrier: after it, every rank's mark is there (rank 0
    marks last, after the others have entered the barrier or are about to)."""
    folder = Path(comm.bcast(tempfile.mkdtemp(prefix="mpigpu-barrier-") if comm.Get_rank() == 0 else None))
    try:
        for round_ in range(3):
            if comm.Get_rank() == 0:
                for _ in range(20):  # the others reach the barrier first, most of the time
                    os.sched_yield()
            (folder / f"{round_}-{comm.Get_rank()}").write_text("here")
            mpigpu.barrier()
            assert sorted(p.name for p in folder.glob(f"{round_}-*")) == sorted(
                f"{round_}-{r}" for r in range(comm.Get_size())
            )
        mpigpu.barrier(comm=comm)
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            for p in folder.iterdir():
                p.unlink()
            folder.rmdir()


@pytest.mark.mpi(min_size=2)
def test_a_barrier_beside_an_allreduce_raises_on_every_rank(comm) -> None:
    x = np.ones(4)
    with pytest.raises(MismatchError, match="barrier"):
        if comm.Get_rank() == 0:
            mpigpu.barrier()
        else:
            mpigpu.allreduce(x, "sum")
    assert np.array_equal(x, np.ones(4)), "a refused call writes nothing"
    y = np.full(3, comm.Get_rank() + 1.0)
    mpigpu.allreduce(y, "sum")
    n = comm.Get_size()
    assert np.array_equal(y, np.full(3, n * (n + 1) / 2))
    mpigpu.barrier()


def test_import_starts_no_mpi_until_rank_is_asked() -> None:
    code = "import sys, mpigpu; assert 'mpi4py.MPI' not in sys.modules; print(mpigpu.rank(), mpigpu.size())"
    env = outside_job_env(singleton=True)  # alone: not a rank of the job this test runs in
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stdout.split() == ["0", "1"], done.stderr
