"""The one choice log (MPIGPU_LOG=1): every collective's choice, in one format, once each."""

from __future__ import annotations

import pytest
from conftest import run_mpi

from mpigpu.cli import launcher_rank

pytestmark = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")


_LOG_JOB = """
import numpy as np
import mpigpu
from mpi4py import MPI
n = MPI.COMM_WORLD.Get_size()
for _ in range(2):  # each choice is logged once, however often it is made
    mpigpu.allreduce(np.ones(4))
    mpigpu.reduce_scatter(np.ones((n, 2)))
    mpigpu.broadcast(np.ones(3))
    mpigpu.allgather(np.ones((1, 2)))
    mpigpu.alltoall(np.ones((n, 2)))
"""


def test_one_choice_log_for_every_collective(tmp_path) -> None:
    """MPIGPU_LOG=1: rank 0 prints, once, each collective's choice and its reason, in one format."""
    script = tmp_path / "log_job.py"
    script.write_text(_LOG_JOB)
    done = run_mpi(2, [str(script)], timeout=120, env={"MPIGPU_LOG": "1"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("mpigpu: ")]
    for name in ("allreduce", "reduce_scatter", "broadcast", "allgather", "alltoall"):
        mine = [line for line in lines if line.startswith(f"mpigpu: {name} ")]
        assert len(mine) == 1 and "-> cpu (" in mine[0], (name, lines)
