"""Several devices in one process (issue 32), JAX's part: inside ``jax.shard_map`` over every device of
every process, mpigpu.jax's reductions average over every device of the job (XLA's collectives). On CPU:
XLA's host platform with two devices per process, one process, then two under mpiexec."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_mpi

from mpigpu.cli import launcher_rank

pytest.importorskip("jax", reason="jax is not installed")
pytestmark = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")

JOB = str(Path(__file__).with_name("per_process_job.py"))
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}


def test_one_process_two_devices_averages_over_both() -> None:
    done = run_mpi(1, [JOB], timeout=180, env=TWO_DEVICES)
    assert done.returncode == 0 and "ok 0: 2 local of 2 devices" in done.stdout, done.stdout + done.stderr


def test_two_processes_two_devices_each_average_over_four() -> None:
    done = run_mpi(2, [JOB], timeout=240, env={**TWO_DEVICES, "JAX_DISTRIBUTED": "1"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "ok 0: 2 local of 4 devices" in out and "ok 1: 2 local of 4 devices" in out, out


def test_two_processes_without_the_distributed_runtime_need_their_device_count_on_every_rank() -> None:
    """Each JAX runtime knows its own two devices only: a psum there would average within the process, so
    mpigpu's FFI call runs once per device (test_jax_per_device.py), and needs to know how many host
    devices each process drives."""
    done = run_mpi(2, [JOB], timeout=180, env=TWO_DEVICES)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for rank in (0, 1):
        assert f"refused {rank}: mpigpu.jax inside jax.shard_map: the program runs on JAX's CPU device 1" in out, out
    assert "set MPIGPU_DEVICES_PER_RANK" in out
