"""Every sample in samples/ runs under mpiexec on the CPU path (the GPU script runs them on GPUs,
tests/gpu/test_training_gpu.py; python -m mpigpu.bench.training in test_bench_training_mpi.py). The DDP
equivalence check of samples/torch_data_parallel.py runs with 2 and 4 ranks, and must fail when the
gradients are not averaged."""

from __future__ import annotations

import pytest
from conftest import ROOT, gpu_count, run_mpi

SAMPLES = ROOT / "samples"


def _ok(result, *expected: str) -> None:
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    for line in expected:
        assert line in result.stdout, text


@pytest.mark.parametrize("n", [1, 2])
def test_gradient_average(n: int) -> None:
    result = run_mpi(n, [str(SAMPLES / "gradient_average.py"), "--size", "100K", "--iters", "3"], timeout=120)
    _ok(result, "PASS", "0 wrong elements")
    assert "no GPU here" in result.stdout or "GPU" in result.stdout


def test_cupy_sgd() -> None:
    _ok(run_mpi(2, [str(SAMPLES / "cupy_sgd.py")], timeout=120), "# PASS", "identical on every rank: True")


def test_jax_step() -> None:
    pytest.importorskip("jax", reason="jax is not installed (the CI test script installs it)")
    _ok(run_mpi(2, [str(SAMPLES / "jax_step.py")], timeout=300), "# PASS", "identical on every rank: True")


@pytest.mark.parametrize("n", [2, 4])
def test_torch_matches_ddp(n: int) -> None:
    pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    # on a GPU node with fewer GPUs than ranks, mpigpu refuses to start unless ranks may share GPUs
    env = {"MPIGPU_ALLOW_SHARED_GPU": "1"} if 0 < gpu_count() < n else None
    args = [str(SAMPLES / "torch_data_parallel.py"), "--check-ddp", "--device", "cpu"]
    result = run_mpi(n, args, timeout=600, env=env)
    _ok(result, "DDP check", ": PASS", "identical on every rank: True", "# PASS")


def test_ddp_check_catches_missing_averaging() -> None:
    pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    args = [str(SAMPLES / "torch_data_parallel.py"), "--check-ddp", "--device", "cpu", "--no-average"]
    result = run_mpi(2, args, timeout=600)
    assert result.returncode != 0, result.stdout + result.stderr
    assert ": FAIL" in result.stdout and "# FAIL" in result.stdout


def test_horovod_train() -> None:
    pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    args = ["-m", "mpigpu.run", str(SAMPLES / "horovod_train.py"), "--device", "cpu"]
    result = run_mpi(2, args, timeout=300)
    _ok(result, "parameters identical on every rank: True", "# PASS (2 ranks, cpu)")
