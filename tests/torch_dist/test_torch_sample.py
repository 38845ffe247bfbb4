"""samples/ddp_mpigpu.py runs under mpiexec on CPU and passes its own check against DDP over gloo
(tests/gpu/test_torch_dist_gpu.py runs it on GPUs against NCCL)."""

from __future__ import annotations

import pytest
from conftest import ROOT, run_mpi

pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")


@pytest.mark.parametrize(("n", "flags"), [(2, []), (3, ["--static-graph", "--fp16-hook"])])
def test_ddp_sample_matches_ddp_over_gloo(n: int, flags: list[str]) -> None:
    result = run_mpi(n, [str(ROOT / "samples" / "ddp_mpigpu.py"), "--device", "cpu", *flags], timeout=300)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    assert ": PASS" in result.stdout and "identical on every rank: True" in result.stdout, text
    assert f"# PASS ({n} ranks, cpu)" in result.stdout, text
    if n == 2 and not flags:
        assert "(the same bits)" in result.stdout, text
