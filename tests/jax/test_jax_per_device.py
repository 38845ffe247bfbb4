"""mpigpu.jax inside ``jax.shard_map`` with several devices per process and a JAX runtime per process (no
jax.distributed): mpigpu's FFI call runs once per device and each device takes part as (rank, device), as
mpigpu.multi's eager calls over several devices do (issue 38). On CPU: XLA's host platform with N devices
per process (--xla_force_host_platform_device_count, MPIGPU_DEVICES_PER_RANK=N), each layout launched
under mpiexec (-n 1, -n 2, and -n 4 for the 4 x 1 reference) by per_device_job.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_mpi

from mpigpu.cli import launcher_rank

pytest.importorskip("jax", reason="jax is not installed")
pytestmark = pytest.mark.skipif(launcher_rank() >= 0, reason="serial test: it launches mpiexec itself")

JOB = str(Path(__file__).with_name("per_device_job.py"))


def _layout(devices: int) -> dict[str, str]:
    """N host devices in each process, for XLA and for mpigpu alike."""
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
            "MPIGPU_DEVICES_PER_RANK": str(devices)}  # fmt: skip


def _job(ranks: int, devices: int, *args: str, env: dict[str, str] | None = None, timeout: float = 240) -> str:
    done = run_mpi(ranks, [JOB, *args], timeout=timeout, env={**_layout(devices), **(env or {})})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


@pytest.mark.parametrize(("ranks", "backend"), [(1, "cpu"), (2, "auto")], ids=["1x2", "2x2"])
def test_every_op_reduces_over_every_device_of_every_process(ranks: int, backend: str) -> None:
    """One process alone names a backend (with backend='auto' it has XLA's collectives, which span the job)."""
    out = _job(ranks, 2, "exact", backend)
    for rank in range(ranks):
        assert f"ok {rank}: 2 local of {2 * ranks} devices, cpu" in out, out


@pytest.mark.parametrize(("ranks", "devices", "backend"), [(1, 2, "cpu"), (2, 2, "auto")], ids=["1x2", "2x2"])
def test_the_same_bits_as_one_device_per_process(ranks: int, devices: int, backend: str) -> None:
    """Random float32 data (sums that round): the participants' order, not the layout, fixes the bits."""
    per_device = re.findall(r"^bits (\w+)$", _job(ranks, devices, "bits", backend), re.M)
    per_process = re.findall(r"^bits (\w+)$", _job(ranks * devices, 1, "bits"), re.M)
    assert len(per_device) == 1 and per_device == per_process, (per_device, per_process)


def test_a_refusal_raises_on_every_rank_and_the_next_call_pairs() -> None:
    out = _job(2, 2, "refuse")
    for rank in (0, 1):
        assert f"refused {rank} nccl: InvalidArgument: backend 'nccl' takes GPU arrays" in out, out
        assert f"refused {rank} shape: MismatchError:" in out, out
        assert f"refused {rank} dtype: InvalidArgument: unsupported dtype complex64" in out, out
        assert f"paired {rank}" in out, out


def test_a_mesh_over_part_of_the_devices_and_a_device_not_in_the_group_are_refused_on_every_rank() -> None:
    out = _job(2, 2, "unmapped", env={"MPIGPU_DEVICES_PER_RANK": "1"})
    for rank in (0, 1):
        assert f"refused {rank} part: InvalidArgument: mpigpu.jax inside jax.shard_map needs a mesh over every " \
               "local device" in out, out  # fmt: skip
        assert f"refused {rank} device: DeviceError: mpigpu.jax inside jax.shard_map: the program runs on JAX's " \
               "CPU device 1" in out and "MPIGPU_DEVICES_PER_RANK" in out, out  # fmt: skip


def test_host_devices_keep_the_python_handler_and_a_demanded_compiled_one_raises_on_every_rank() -> None:
    """MPI has no communicator per device: the compiled handler takes no per-device call on host devices. With
    MPIGPU_JAX_HANDLER=compiled on rank 0 alone every rank raises the same ConfigError, and the next call pairs."""
    out = _job(2, 2, "handler")
    for rank in (0, 1):
        assert f"handler {rank}: python: one call per device inside jax.shard_map" in out, out
        assert "rank 1: host devices: MPI has no communicator per device" in out, out
        assert (
            f"demanded {rank}: ConfigError: MPIGPU_JAX_HANDLER=compiled on rank(s) 0, but the compiled "
            "handler cannot take this call (rank 0: host devices: MPI has no communicator per device" in out
        ), out
        assert f"paired {rank}" in out, out


def test_a_stall_names_the_missing_rank_and_device() -> None:
    """Rank 1's device 1 reaches the call 120 s late: the stall report names it, MPIGPU_TIMEOUT ends the job."""
    env = {**_layout(2), "MPIGPU_STALL": "1", "MPIGPU_TIMEOUT": "8"}
    done = run_mpi(2, [JOB, "stall"], timeout=120, env=env)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "not stalled" not in out, out
    stalled = [line for line in out.splitlines() if line.startswith("[mpigpu rank 1] stalled:")]
    assert any("waiting for (rank 1, host device 1) to make this call" in line for line in stalled), out
    assert "(rank 1, host device 0)" not in out, out  # it made the call
    assert "CollectiveTimeout" in out and "MPIGPU_TIMEOUT=8" in out, out


def test_xla_device_ordinals_map_to_the_processs_device_positions() -> None:
    """A GPU by its CUDA ordinal (a process driving GPUs 2 and 3), a host device k by JAX's CPU device k;
    anything else is a DeviceError that says which devices the process drives."""
    from types import SimpleNamespace

    from mpigpu.core.errors import DeviceError
    from mpigpu.jax._devices import position

    def group(gpus: list[int] | None, count: int) -> SimpleNamespace:
        describe = (lambda k: f"GPU {gpus[k]}") if gpus is not None else (lambda k: f"host device {k}")
        return SimpleNamespace(gpus=gpus, count=count, describe=describe)

    gpus = group([2, 3], 2)
    assert [position(gpus, True, o) for o in (2, 3)] == [0, 1]  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match=r"runs on GPU 0, which is not one of.*GPU 2', 'GPU 3'"):
        position(gpus, True, 0)  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match="a program on JAX's CPU devices, but this process drives"):
        position(gpus, False, 0)  # type: ignore[arg-type]
    hosts = group(None, 2)
    assert [position(hosts, False, o) for o in (0, 1)] == [0, 1]  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match=r"CPU device 2.*MPIGPU_DEVICES_PER_RANK"):
        position(hosts, False, 2)  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match="a program on JAX's GPU devices"):
        position(hosts, True, 0)  # type: ignore[arg-type]
