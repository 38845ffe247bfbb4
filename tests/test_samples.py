"""Every sample in samples/ runs under mpiexec on the CPU path (the GPU script runs them on GPUs,
tests/gpu/test_training_gpu.py), and python -m mpigpu.bench_training runs and reports. The DDP
equivalence check of samples/torch_data_parallel.py runs with 2 and 4 ranks, and must fail when the
gradients are not averaged."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, run_mpi

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
    result = run_mpi(n, [str(SAMPLES / "torch_data_parallel.py"), "--check-ddp", "--device", "cpu"], timeout=600)
    _ok(result, "DDP check", ": PASS", "identical on every rank: True", "# PASS")


def test_ddp_check_catches_missing_averaging() -> None:
    pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    args = [str(SAMPLES / "torch_data_parallel.py"), "--check-ddp", "--device", "cpu", "--no-average"]
    result = run_mpi(2, args, timeout=600)
    assert result.returncode != 0, result.stdout + result.stderr
    assert ": FAIL" in result.stdout and "# FAIL" in result.stdout


def test_bench_training(tmp_path) -> None:
    out = tmp_path / "training.json"
    args = ["-m", "mpigpu.bench_training", "--scale", "0.005", "--iters", "2", "--warmup", "1", "--width", "32",
            "--depth", "2", "--batch", "8", "--accuracy", "--json", str(out)]  # fmt: skip
    result = run_mpi(2, args, timeout=600)
    _ok(result, "Averager vs one allreduce per tensor", "Averager vs one flat allreduce", "compression accuracy")
    document = json.loads(out.read_text())
    fusion = document["fusion"]
    assert fusion["tensors"] == 161 and fusion["speedup_vs_per_tensor"] > 0
    assert set(fusion["seconds"]) >= {"per_tensor", "flat", "averager_copy", "averager_views"}
    accuracy = document["accuracy"]
    assert accuracy["float32"]["max_rel_error_per_tensor"] < 1e-6
    assert 0 < accuracy["bfloat16"]["rel_l2_error"] < 1e-2
    if document.get("overlap"):
        assert document["overlap"]["communication_s"] == pytest.approx(
            document["overlap"]["seconds"]["backward_then_average"] - document["overlap"]["seconds"]["backward"]
        )
