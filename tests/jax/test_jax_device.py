"""mpigpu.jax.init() and the device checks, on JAX's CPU (issue 23): import starts nothing; init makes the
rank's device JAX's default, is idempotent and fails on every rank alike; the GPU it picks among JAX's
devices; a program on another GPU or over several devices is refused while compiling; inside
jax.shard_map over every process (init(distributed=True)) the calls are XLA's own collectives, and over
several devices of one process they are refused. The GPU half is tests/gpu/test_jax_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import ROOT, run_mpi

jax = pytest.importorskip("jax", reason="jax is not installed (the CI test script installs it)")

from mpigpu.core.errors import DeviceError, InvalidArgument, MismatchError  # noqa: E402
from mpigpu.job.device import GpuInfo  # noqa: E402

mpi = pytest.mark.mpi(min_size=1)


@dataclass(frozen=True)
class FakeDevice:
    platform: str
    local_hardware_id: int
    id: int = 0

    def __str__(self) -> str:
        return f"{self.platform}:{self.local_hardware_id}"


def _gpu(index: int) -> GpuInfo:
    return GpuInfo(index, "Fake GPU", f"0000:0{index}:00.0", "", (9, 0), 2, None)


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300, env=full)


# -- serial -------------------------------------------------------------------------------------------------------


def test_import_starts_nothing() -> None:
    """``import mpigpu.jax`` starts no JAX backend and no MPI: init() can still choose the GPU JAX opens."""
    result = _run(
        "import sys, mpigpu.jax\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized(), 'a JAX backend started'\n"
        "assert 'mpi4py.MPI' not in sys.modules, 'MPI was imported'\n"
        "print('ok')"
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


def test_the_gpu_is_found_by_its_cuda_index() -> None:
    """JAX's device ids are not CUDA ordinals once JAX opens one GPU of several; the hardware id is."""
    from mpigpu.jax._device import jax_device_for

    gpus = [FakeDevice("gpu", 2, id=0), FakeDevice("gpu", 3, id=1)]
    assert jax_device_for(3, gpus) is gpus[1]
    assert jax_device_for(0, gpus) is None
    assert jax_device_for(0, [FakeDevice("cpu", 0)]) is None


def test_a_program_on_another_gpu_or_several_devices_is_refused() -> None:
    """The lowering's check (run on every rank inside the cross-rank check, so every rank raises)."""
    from jax._src.sharding_impls import ShardingContext

    from mpigpu.jax._primitive import check_program_device

    on = [FakeDevice("gpu", 0)]
    check_program_device(ShardingContext(1, (FakeDevice("gpu", 1),)), _gpu(1), rank=1)  # its own GPU: fine
    check_program_device(ShardingContext(1, (FakeDevice("cpu", 0),)), None, rank=1)
    with pytest.raises(DeviceError, match=r"GPU 0\), but rank 1 is bound to GPU 1.*mpigpu.jax.init\(\)"):
        check_program_device(ShardingContext(1, tuple(on)), _gpu(1), rank=1)
    with pytest.raises(InvalidArgument, match=r"spans 2 devices.*inside jax.shard_map only"):
        check_program_device(ShardingContext(2, (FakeDevice("cpu", 0), FakeDevice("cpu", 1))), None, rank=0)


def test_lowering_is_given_the_programs_device(monkeypatch) -> None:
    """JAX tells the lowering which device the program runs on (else the GPU check could not run)."""
    from mpigpu.jax import _primitive

    seen = []
    monkeypatch.setattr(_primitive, "check_program_device", lambda axis, gpu, rank: seen.append(axis))
    import mpigpu.jax as mj

    device = jax.devices("cpu")[0]
    jax.jit(lambda v: mj.allreduce(v, "sum")).lower(jax.device_put(np.ones(5, np.float32), device))
    assert [a.device_assignment for a in seen] == [(device,)]


def test_shard_map_over_every_process_runs_xlas_collectives() -> None:
    """init(distributed=True) under mpiexec -n 2 on JAX's CPU (gloo): exact results, XLA's all-reduce."""
    start = time.monotonic()
    result = run_mpi(2, [str(ROOT / "tests" / "jax" / "spmd_job.py")], timeout=180, env={"JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok 0" in result.stdout and "ok 1" in result.stdout, result.stdout + result.stderr
    assert time.monotonic() - start < 180


# -- under mpiexec ------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_init(monkeypatch):
    """mpigpu.jax.init() as if never called (restored afterwards)."""
    from mpigpu.jax import _device

    monkeypatch.setattr(_device, "_bound", [])
    return _device


@mpi
def test_init_makes_the_ranks_device_the_default_and_is_idempotent(comm, fresh_init, monkeypatch) -> None:
    import jax.numpy as jnp

    import mpigpu
    import mpigpu.jax as mj

    gpu = mpigpu.select_device(comm)  # None here; on a GPU node (gpu-check's tests stage) the rank's GPU
    device = mj.init(comm)
    if gpu is None:
        assert device == jax.devices("cpu")[0]
    else:
        assert (device.platform, device.local_hardware_id) == ("gpu", gpu.index)
    assert jnp.zeros(2).devices() == {device}
    from mpigpu.job import check

    monkeypatch.setattr(check, "fail_together", lambda *a: pytest.fail("a second init() communicated"))
    assert mj.init(comm) is device
    with pytest.raises(InvalidArgument, match="distributed=True to the first call"):
        mj.init(comm, distributed=True)


@mpi
def test_distributed_after_jax_started_fails_on_every_rank(comm, fresh_init) -> None:
    import mpigpu.jax as mj

    jax.devices()  # JAX has started (as it has in this test session)
    with pytest.raises(DeviceError, match=r"JAX has already started.*mpigpu.jax.init\(\)"):
        mj.init(comm, distributed=True)
    assert fresh_init._bound == []


@mpi
def test_before_jax_starts_only_the_ranks_gpu_is_opened(comm, fresh_init, monkeypatch) -> None:
    """Each rank bound to its own (fake) GPU of two, JAX not started yet: init() restricts JAX to GPU 0 on
    the rank bound to it and leaves every GPU open on the others (JAX 0.11 misnumbers a lone GPU k > 0:
    every computation fails "Device id 1 is out of range [0, 1)", seen on 2 x H100), and turns JAX's
    preallocation off on every rank (two GPUs visible); a value set beforehand that names another GPU
    fails on every rank; with JAX told to run on the CPU (JAX_PLATFORMS=cpu), the CPU is the rank's
    device and nothing is restricted."""
    import mpigpu.calls.reduce
    import mpigpu.jax as mj

    rank = comm.Get_rank()
    before, platforms = jax.config.values["jax_cuda_visible_devices"], jax.config.values["jax_platforms"]
    defaults = []
    for name in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(mpigpu.calls.reduce, "select_device", lambda comm=None: _gpu(rank))
    monkeypatch.setattr(fresh_init, "_backends_started", lambda: False)
    monkeypatch.setattr(fresh_init, "_jax_devices", lambda platform: [FakeDevice("gpu", rank)])
    monkeypatch.setattr(fresh_init, "_set_default", defaults.append)
    try:
        assert mj.init(comm) == FakeDevice("gpu", rank)
        seen = jax.config.values["jax_cuda_visible_devices"]
        preallocate = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
        monkeypatch.setattr(fresh_init, "_bound", [])
        jax.config.update("jax_cuda_visible_devices", str(rank + 1))
        with pytest.raises(DeviceError, match=f"jax_cuda_visible_devices is '{rank + 1}'"):
            mj.init(comm)
        jax.config.update("jax_cuda_visible_devices", before)
        jax.config.update("jax_platforms", "cpu")
        monkeypatch.setattr(fresh_init, "_jax_devices", lambda platform: [FakeDevice(platform, 0)])
        assert mj.init(comm) == FakeDevice("cpu", 0)
        unrestricted = jax.config.values["jax_cuda_visible_devices"]
    finally:
        jax.config.update("jax_cuda_visible_devices", before)
        jax.config.update("jax_platforms", platforms)
    assert seen == ("0" if rank == 0 else before) and unrestricted == before
    assert preallocate == "false"
    assert defaults == [FakeDevice("gpu", rank), FakeDevice("cpu", 0)]


@pytest.mark.mpi(min_size=2)
def test_jax_without_the_ranks_gpu_fails_on_every_rank(comm, fresh_init, monkeypatch) -> None:
    """JAX started with GPU 0 only (every rank's), and rank 1 is bound to GPU 1: rank 1 raises DeviceError
    naming the fix, every other rank MismatchError naming rank 1; nothing is bound; the next collective pairs."""
    import mpigpu.calls.reduce
    import mpigpu.jax as mj

    rank = comm.Get_rank()
    defaults = []
    monkeypatch.setattr(mpigpu.calls.reduce, "select_device", lambda comm=None: _gpu(1 if rank == 1 else 0))
    monkeypatch.setattr(fresh_init, "_backends_started", lambda: True)
    monkeypatch.setattr(fresh_init, "_jax_devices", lambda platform: [FakeDevice("gpu", 0)])
    monkeypatch.setattr(fresh_init, "_set_default", defaults.append)
    if rank == 1:
        with pytest.raises(DeviceError, match=r"bound to GPU 1 .*GPU\(s\) 0 only: call `mpigpu.jax.init\(\)` before"):
            mj.init(comm)
    else:
        with pytest.raises(MismatchError, match="rank 1"):
            mj.init(comm)
    assert comm.allreduce(1) == comm.Get_size()  # before the local checks: a rank that fails them cannot hang this
    assert fresh_init._bound == [] and defaults == ([] if rank == 1 else [FakeDevice("gpu", 0)])
