"""`python -m mpigpu.average` (and `mpigpu.bench.training`) refusing what this job cannot do: one line
that says why and exit status 2 (1 means wrong elements), never an abort. Serial tests: each one
launches the command through ``run_mpi``."""

from __future__ import annotations

import pytest
from conftest import gpu_available, run_mpi

from mpigpu.cli import launcher_rank

pytestmark = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")

NEEDS_NO_GPU = "this refusal needs a machine without a GPU"


@pytest.mark.parametrize(
    ("args", "message", "gpu_free"),
    [
        (["--backend", "nccl"], "error: backend 'nccl' is not available here", True),
        (["--device", "gpu"], "error: --device gpu: not every rank has a GPU", True),
        (["--dtype", "int32", "--pattern", "seed"], "error: the seed pattern (rank + 0.001*i) is for floating", False),
    ],
)
def test_average_refuses_with_one_line_and_status_2(args: list[str], message: str, gpu_free: bool) -> None:
    if gpu_free and gpu_available():
        pytest.skip(NEEDS_NO_GPU)
    done = run_mpi(2, ["-m", "mpigpu.average", "--size", "1K", *args], timeout=60)
    assert done.returncode == 2, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert message in done.stderr
    assert done.stderr.count("error:") == 1, "one line per job, not one per rank"
    assert "unhandled exception" not in done.stderr and "MPI_Abort" not in done.stderr
    assert "PASS" not in done.stdout and "FAIL" not in done.stdout


def test_bench_training_refuses_a_missing_gpu_with_status_2() -> None:
    if gpu_available():
        pytest.skip(NEEDS_NO_GPU)
    done = run_mpi(2, ["-m", "mpigpu.bench.training", "--device", "gpu"], timeout=60)
    assert done.returncode == 2, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stderr.count("error: --device gpu: not every rank has a GPU") == 1
