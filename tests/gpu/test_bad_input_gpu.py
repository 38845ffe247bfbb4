"""Bad input that only a GPU machine can produce: each a clear error naming the problem and the fix,
the caller's data unchanged, no hang, no crash.

In-process tests run under the launcher (scripts/gpu-check.sh: mpirun -n 2/4 ... --with-mpi
--only-mpi tests/gpu): arrays on another rank's GPU, host arrays to GPU-only backends, GPU arrays to
the cpu backend, non-contiguous and unsupported GPU arrays, placement mismatches, NaN/Inf through
the GPU paths. Subprocess tests start their own launcher (run serially: python -m pytest
tests/gpu/test_bad_input_gpu.py): more ranks than GPUs without opting in, and MPIGPU_CUDA_AWARE=1
on an MPI that is not CUDA-aware, which must end with an error status and no core dump.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from conftest import run_mpi

import mpigpu
from mpigpu.core.errors import BackendUnavailable, DeviceError, InvalidArgument, MismatchError

GPU_ONLY = ["nccl", "ipc", "cuda-aware"]


@pytest.fixture(scope="module")
def cp(ctx):
    return pytest.importorskip("cupy", reason="CuPy is not installed")


def _bytes(arr: Any) -> bytes:
    return arr.get().tobytes() if hasattr(arr, "get") else arr.tobytes()


def _still_works(ctx, cp) -> None:
    y = cp.full(5, ctx.rank + 1, cp.float32)
    mpigpu.allreduce(y, "sum")
    cp.cuda.get_current_stream().synchronize()
    assert bool((y == ctx.size * (ctx.size + 1) / 2).all())


# -- in process, under the launcher ------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
def test_array_on_another_gpu_refused(ctx, cp) -> None:
    if ctx.gpu.visible < 2:
        pytest.skip(f"this rank sees {ctx.gpu.visible} GPU (the launcher pins one GPU per rank)")
    other = (ctx.gpu.index + 1) % ctx.gpu.visible
    bad = 0
    with cp.cuda.Device(other if ctx.rank == bad else ctx.gpu.index):
        x = cp.arange(16, dtype=cp.float32)
        cp.cuda.get_current_stream().synchronize()
    before = _bytes(x)
    if ctx.rank == bad:
        with pytest.raises(DeviceError) as info:
            mpigpu.allreduce(x)
        message = str(info.value)
        assert f"x is on GPU {other}, but rank {ctx.rank} is bound to GPU {ctx.gpu.index}" in message
        assert "select_device" in message, "the message names the fix"
    else:
        with pytest.raises(MismatchError, match=f"rank {bad} rejected the arguments"):
            mpigpu.allreduce(x)
    assert _bytes(x) == before
    _still_works(ctx, cp)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", GPU_ONLY)
def test_host_array_to_gpu_only_backend_refused(ctx, cp, backend: str) -> None:
    x = np.arange(16, dtype=np.float32)
    with pytest.raises((InvalidArgument, BackendUnavailable)) as info:
        mpigpu.allreduce(x, backend=backend)
    message = str(info.value)
    if ctx.availability[backend].ok:
        assert "takes GPU arrays only" in message and "move the data to the GPU first" in message
    else:
        assert "not available here" in message and ctx.availability[backend].reason in message
    assert np.array_equal(x, np.arange(16, dtype=np.float32))
    _still_works(ctx, cp)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
def test_gpu_array_to_cpu_backend_refused(ctx, cp) -> None:
    x = cp.arange(16, dtype=cp.float32)
    before = _bytes(x)
    with pytest.raises(InvalidArgument, match=r"takes host \(NumPy\) arrays only.*'host', 'nccl' or 'auto'"):
        mpigpu.allreduce(x, backend="cpu")
    assert _bytes(x) == before
    _still_works(ctx, cp)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
def test_fortran_order_gpu_array_refused_naming_the_order(ctx, cp) -> None:
    """Host arrays in Fortran order are reduced elementwise; GPU arrays are refused, saying why."""
    x = cp.asfortranarray(cp.arange(12, dtype=cp.float32).reshape(3, 4))
    before = _bytes(x)
    with pytest.raises(InvalidArgument, match=r"Fortran \(column-major\) order \(cupy\).*cupy\.ascontiguousarray"):
        mpigpu.allreduce(x)
    assert _bytes(x) == before
    _still_works(ctx, cp)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
def test_not_contiguous_gpu_arrays_refused(ctx, cp) -> None:
    x = cp.arange(32, dtype=cp.float32).reshape(4, 8)[:, ::2]
    before = _bytes(x)
    with pytest.raises(InvalidArgument, match=r"not contiguous \(cupy\).*cupy\.ascontiguousarray"):
        mpigpu.allreduce(x)
    assert _bytes(x) == before
    torch = pytest.importorskip("torch", reason="torch is not installed")
    t = torch.arange(32, dtype=torch.float32, device=f"cuda:{ctx.gpu.index}").reshape(4, 8).t()
    snapshot = t.cpu().clone()
    with pytest.raises(InvalidArgument, match=r"not contiguous \(torch\).*x\.contiguous\(\)"):
        mpigpu.allreduce(t)
    assert torch.equal(t.cpu(), snapshot)
    _still_works(ctx, cp)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["complex64", "bool"])
def test_unsupported_gpu_dtype_refused(ctx, cp, dtype: str) -> None:
    x = cp.ones(8, dtype=dtype)
    before = _bytes(x)
    with pytest.raises(InvalidArgument, match="unsupported dtype"):
        mpigpu.allreduce(x)
    assert _bytes(x) == before
    _still_works(ctx, cp)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
def test_out_in_another_place_or_partly_overlapping_refused(ctx, cp) -> None:
    x = cp.arange(16, dtype=cp.float32)
    host_out = np.full(16, np.nan, np.float32)
    with pytest.raises(InvalidArgument, match=r"out is on host but x is on GPU"):
        mpigpu.allreduce(x, out=host_out)
    buffer = cp.arange(20, dtype=cp.float64)
    before = _bytes(buffer)
    with pytest.raises(InvalidArgument, match="overlaps x only partly"):
        mpigpu.allreduce(buffer[:10], out=buffer[5:15])
    assert _bytes(buffer) == before and np.isnan(host_out).all()
    _still_works(ctx, cp)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
def test_zero_size_gpu_arrays_return_at_once(ctx, cp) -> None:
    for backend in ["auto"] + [b for b in ("nccl", "ipc", "cuda-aware", "host") if ctx.availability[b].ok]:
        x = cp.empty(0, cp.float32)
        assert mpigpu.allreduce(x, backend=backend) is x
    _still_works(ctx, cp)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_placement_mismatch_named(ctx, cp) -> None:
    x = np.ones(8, np.float32) if ctx.rank == 0 else cp.ones(8, cp.float32)
    with pytest.raises(MismatchError) as info:
        mpigpu.allreduce(x)
    message = str(info.value)
    assert "placement: host array on rank 0; GPU array on rank" in message
    assert len(set(ctx.comm.allgather(message))) == 1
    _still_works(ctx, cp)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("backend", ["auto", "nccl", "ipc", "cuda-aware", "host"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_nan_and_inf_propagate_on_gpu(ctx, cp, backend: str, dtype: str) -> None:
    if backend != "auto" and not ctx.availability[backend].ok:
        pytest.skip(f"{backend}: {ctx.availability[backend].reason}")
    from mpigpu.core.arrays import ArrayView
    from mpigpu.core.dtypes import DTYPES

    host = np.ones(6, DTYPES[dtype].np)
    if ctx.rank == ctx.size - 1:
        host[0], host[1] = np.nan, np.inf
    if ctx.rank == 0:
        host[2] = -np.inf
    raw = cp.asarray(host.view(np.uint8))  # the bits on this rank's GPU (CuPy has no bfloat16)
    view = ArrayView(raw, int(raw.data.ptr), host.shape, DTYPES[dtype], ctx.gpu.index, False, "cupy")
    mpigpu.allreduce(view, "sum", backend=backend)  # ordered on CuPy's current stream, like raw.get()
    got = raw.get().view(host.dtype).astype(np.float64)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got[3] == ctx.size, got
    assert len(set(ctx.comm.allgather(got.tobytes()))) == 1


# -- subprocesses with their own launcher --------------------------------------------------------------
def _launcher_env(extra: dict[str, str]) -> dict[str, str]:
    """Open MPI refuses to run as root unless told; the other launchers ignore these variables."""
    env = dict(extra)
    if os.geteuid() == 0:
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    return env


def _no_crash(result: Any) -> None:
    output = result.stdout + result.stderr
    assert result.returncode > 0, f"status {result.returncode}\n{output}"
    assert result.returncode not in (128 + signal.SIGSEGV, 128 + signal.SIGABRT, 128 + signal.SIGBUS), output
    for crash in ("Segmentation fault", "core dumped", "SIGSEGV", "Fatal Python error"):
        assert crash not in output, output


@pytest.mark.gpu
def test_more_ranks_than_gpus_needs_opt_in() -> None:
    # the default refuses (even where the caller's environment opts in, as gpu-check's one-GPU serial stage does)
    env = _launcher_env({"CUDA_VISIBLE_DEVICES": "0", "MPIGPU_ALLOW_SHARED_GPU": "0"})
    start = time.monotonic()
    refused = run_mpi(2, ["-m", "mpigpu.average", "--size", "1K", "--iters", "2"], env=env, timeout=60)
    elapsed = time.monotonic() - start
    _no_crash(refused)
    assert elapsed < 30, f"took {elapsed:.0f} s"
    assert "more ranks than GPUs" in refused.stderr and "MPIGPU_ALLOW_SHARED_GPU=1" in refused.stderr
    allowed = run_mpi(
        2,
        ["-m", "mpigpu.average", "--size", "1K", "--iters", "2"],
        env={**env, "MPIGPU_ALLOW_SHARED_GPU": "1"},
        timeout=60,
    )
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "# PASS" in allowed.stdout


@pytest.mark.gpu
def test_forced_cuda_aware_on_mpi_that_is_not_fails_cleanly() -> None:
    probe = run_mpi(2, ["-m", "mpigpu.info", "--json"], env=_launcher_env({}), timeout=60)
    assert probe.returncode == 0, probe.stderr
    info = json.loads(probe.stdout)
    if info["cuda_aware"]["aware"]:
        pytest.skip(f"{info['mpi']['version']} is CUDA-aware: nothing to refuse")
    args = ["-m", "mpigpu.average", "--device", "gpu", "--backend", "cuda-aware", "--size", "1M", "--iters", "2"]
    start = time.monotonic()
    result = run_mpi(2, args, env=_launcher_env({"MPIGPU_CUDA_AWARE": "1"}), timeout=60)
    elapsed = time.monotonic() - start
    _no_crash(result)
    assert elapsed < 30, f"took {elapsed:.0f} s"
    assert "not CUDA-aware" in result.stderr and "MPIGPU_CUDA_AWARE=1 refused" in result.stderr, result.stderr
