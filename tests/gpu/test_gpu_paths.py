"""GPU paths under mpirun (scripts/gpu-check.sh runs these with 2 and 4 ranks under Open MPI and
Intel MPI): every backend x {float32, float64, float16, bfloat16} x {sum, avg} x sizes {1, 1000003,
64 MiB} x in place / out of place (poisoned), with CuPy and torch inputs, exact pattern, verified on
the GPU, bitwise identical on every rank. Plus stream ordering, device mapping and auto's choice.

A backend that the current MPI cannot run (cuda-aware under a non-CUDA-aware MPI) is skipped with
the reason; gpu-check.sh runs both MPIs so every backend runs in one of them.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import mpigpu
from mpigpu.bench.workload import POISON_BYTE, count_wrong_device, fill_device
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

BACKENDS = ["nccl", "cuda-aware", "host"]
FLOATS = ["float32", "float64", "float16", "bfloat16"]
SIZES = [1, 1000003, "64MiB"]


def _count(size, dtype: str) -> int:
    return (64 << 20) // DTYPES[dtype].itemsize if size == "64MiB" else size


def _need(ctx, backend: str) -> None:
    state = ctx.availability[backend]
    if not state.ok:
        pytest.skip(f"{backend} is not available under {ctx.mpi_lib.name}: {state.reason}")


class _Arrays:
    """Allocation and raw pointers for one framework."""

    def __init__(self, framework: str, ctx) -> None:
        self.framework = framework
        self.index = ctx.gpu.index
        if framework == "torch":
            self.torch = pytest.importorskip("torch", reason="torch is not installed")
            self.stream = self.torch.cuda.Stream(device=self.index)
            self.ref = mpigpu.core._cuda.StreamRef(int(self.stream.cuda_stream))
        else:
            import cupy

            self.cupy = cupy
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.ref = mpigpu.core._cuda.StreamRef(int(self.stream.ptr))

    def empty(self, count: int, dtype: str):
        if self.framework == "torch":
            torch_dtype = getattr(self.torch, dtype)
            return self.torch.empty(count, dtype=torch_dtype, device=f"cuda:{self.index}")
        np_dtype = DTYPES[dtype].np
        try:
            return self.cupy.empty(count, dtype=np_dtype)
        except (TypeError, ValueError):
            pytest.skip(f"this CuPy has no {dtype} arrays")

    def ptr(self, arr) -> int:
        return int(arr.data_ptr()) if self.framework == "torch" else int(arr.data.ptr)

    def digest(self, arr, nbytes: int) -> str:
        host = np.empty(nbytes, np.uint8)
        self.cupy_runtime().memcpyAsync(host.ctypes.data, self.ptr(arr), nbytes, 2, self.ref.handle)
        self.cupy_runtime().streamSynchronize(self.ref.handle)
        return hashlib.sha256(host.tobytes()).hexdigest()

    @staticmethod
    def cupy_runtime():
        import cupy

        return cupy.cuda.runtime


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matrix(ctx, comm, backend: str, framework: str) -> None:
    _need(ctx, backend)
    arrays = _Arrays(framework, ctx)
    rank, n = comm.Get_rank(), comm.Get_size()
    failures = []
    for dtype in FLOATS:
        d = DTYPES[dtype]
        for op in (Op.SUM, Op.AVG):
            for size in SIZES:
                count = _count(size, dtype)
                for inplace in (True, False):
                    x = arrays.empty(count, dtype)
                    out = x if inplace else arrays.empty(count, dtype)
                    fill_device(arrays.ptr(x), count, d, "exact", op, rank, n, ctx.gpu, arrays.ref)
                    if not inplace:
                        arrays.cupy_runtime().memsetAsync(arrays.ptr(out), POISON_BYTE, count * d.itemsize,
                                                          arrays.ref.handle)  # fmt: skip
                    result = mpigpu.allreduce(
                        x, op.value, out=None if inplace else out, backend=backend, stream=arrays.stream
                    )
                    assert result is out
                    wrong = count_wrong_device(arrays.ptr(out), count, d, "exact", op, n, ctx.gpu, arrays.ref)
                    wrong = comm.allreduce(wrong)
                    digests = set(comm.allgather(arrays.digest(out, min(count, 1 << 20) * d.itemsize)))
                    if wrong or len(digests) != 1:
                        failures.append(f"{dtype} {op.value} {count} {'in' if inplace else 'out'}: "
                                        f"{wrong} wrong, {len(digests)} distinct results")  # fmt: skip
                    del x, out
    assert not failures, f"{backend}/{framework}: " + "; ".join(failures)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_order_is_respected(ctx, comm, backend: str) -> None:
    """The input is produced on a busy non-default stream right before the call, with no sync:
    a backend that reads before the producer is done sees poison."""
    _need(ctx, backend)
    import cupy

    rank, n, d = comm.Get_rank(), comm.Get_size(), DTYPES["float32"]
    count = 1 << 22
    stream = cupy.cuda.Stream(non_blocking=True)
    ref = mpigpu.core._cuda.StreamRef(int(stream.ptr))
    good = cupy.empty(count, dtype=np.float32)
    fill_device(int(good.data.ptr), count, d, "exact", Op.SUM, rank, n, ctx.gpu, ref)
    x = cupy.empty(count, dtype=np.float32)
    with stream:
        x.fill(np.nan)
        busy = cupy.ones(1 << 26, dtype=np.float32)
        for _ in range(20):  # ~ms of work queued ahead of the producing copy
            busy = cupy.sin(busy)
        x[...] = good
    mpigpu.allreduce(x, "sum", backend=backend, stream=stream)
    wrong = count_wrong_device(int(x.data.ptr), count, d, "exact", Op.SUM, n, ctx.gpu, ref)
    assert comm.allreduce(wrong) == 0


def test_device_mapping(ctx, comm) -> None:
    from mpigpu.core._cuda import visible_device_count

    gpu = mpigpu.select_device(comm)
    assert gpu is not None
    assert gpu.index == ctx.layout.phys_rank % visible_device_count()
    assert gpu.pci_bus_id and gpu.name
    from mpigpu.cli import header_lines

    lines = header_lines(ctx)
    if comm.Get_rank() == 0:
        assert sum("GPU" in line and "[" in line for line in lines) == comm.Get_size()


def test_a_smaller_communicator_keeps_the_processs_gpu(ctx, comm) -> None:
    """Each rank alone in a communicator of its own (a Horovod process set of one rank): its context is
    bound to the GPU the world's mapped it to, not to GPU 0 (rank 1 of 2 was mapped to GPU 0 by its rank
    inside the one-rank communicator, seen on 2 x H100), and a reduction there of a tensor on the rank's
    GPU is exact; so is one over every even rank."""
    import cupy

    from mpigpu.runtime.context import Context

    rank = comm.Get_rank()
    alone = comm.Split(color=rank, key=0)
    evens = comm.Split(color=rank % 2, key=rank)
    try:
        for sub in (alone, evens):
            assert Context.get(sub).gpu == ctx.gpu, (Context.get(sub).gpu, ctx.gpu)
            with cupy.cuda.Device(ctx.gpu.index):
                x = cupy.arange(1000, dtype=cupy.float32) * (rank + 1)
                out = cupy.full_like(x, np.nan)
                mpigpu.allreduce(x, "sum", out=out, comm=sub)
                members = [r for r in range(comm.Get_size()) if r % 2 == rank % 2] if sub is evens else [rank]
                expect = np.arange(1000, dtype=np.float32) * sum(r + 1 for r in members)
                assert np.array_equal(out.get(), expect)
    finally:
        alone.Free()  # the contexts go with their communicators
        evens.Free()


def test_auto_prefers_nccl_for_large_messages(ctx, comm) -> None:
    import cupy

    if not ctx.availability["nccl"].ok:
        pytest.skip(f"nccl unavailable: {ctx.availability['nccl'].reason}")
    choice = mpigpu.explain(cupy.empty(16 << 20, dtype=np.float32))
    if ctx.tuning is None:
        assert choice.backend == "nccl", choice


def test_array_on_another_gpu_is_refused(ctx, comm) -> None:
    import cupy

    from mpigpu.core._cuda import visible_device_count

    if visible_device_count() < 2:
        pytest.skip("this process sees one GPU (launcher pinning); nothing else to put an array on")
    other = (ctx.gpu.index + 1) % visible_device_count()
    with cupy.cuda.Device(other):
        x = cupy.arange(8, dtype=np.float32)
    with pytest.raises(mpigpu.DeviceError, match="select_device"):
        mpigpu.allreduce(x, backend="nccl" if ctx.availability["nccl"].ok else "host")
    with cupy.cuda.Device(other):
        assert cupy.array_equal(x, cupy.arange(8, dtype=np.float32))


def test_host_array_to_gpu_only_backend_is_refused(ctx, comm) -> None:
    x = np.arange(8, dtype=np.float32)
    for backend in ("nccl", "cuda-aware"):
        if ctx.availability[backend].ok:
            with pytest.raises(mpigpu.InvalidArgument, match="takes GPU arrays only"):
                mpigpu.allreduce(x, backend=backend)
    assert np.array_equal(x, np.arange(8, dtype=np.float32))
