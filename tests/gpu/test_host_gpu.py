"""The host backend on GPU arrays (scripts/gpu-check.sh runs these under mpirun with 2 and 4 ranks):
every dtype and op through both routes and a ring that wraps many times, exact pattern verified on
the GPU, poisoned outputs, bitwise identical on every rank; CuPy and torch inputs up to 64 MiB;
virtual nodes (equal and unequal); stream ordering; phases; finalize.

Contexts with their own settings are built on a duplicate of the world communicator while the
MPIGPU_* variables are set (see tests/backends/test_host_mpi.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import context_with

import mpigpu
from mpigpu.bench.workload import POISON_BYTE, count_wrong_device, fill_device
from mpigpu.core._cuda import StreamRef
from mpigpu.core.arrays import ArrayView
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op
from mpigpu.runtime.context import Context

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

TINY = {"MPIGPU_HOST_CHUNK": "16K", "MPIGPU_HOST_SMALL": "4K", "MPIGPU_HOST_DEPTH": "1"}
COUNTS = [1, 7, 1000, 70001]  # latency route up to 4 KiB; then 5 to 35 chunks on a ring of 3


class Buffers:
    """Raw device buffers of any dtype (CuPy has no bfloat16), on one non-blocking stream."""

    def __init__(self, ctx: Context) -> None:
        import cupy

        self.cp, self.ctx = cupy, ctx
        ctx.activate_gpu()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.ref = StreamRef(int(self.stream.ptr))
        self.runtime = cupy.cuda.runtime

    def view(self, count: int, dtype: str) -> ArrayView:
        d = DTYPES[dtype]
        raw = self.cp.empty(max(1, count * d.itemsize), dtype=np.uint8)
        return ArrayView(raw, int(raw.data.ptr), (count,), d, self.ctx.gpu.index, False, "cupy", keepalive=raw)

    def fill(self, view: ArrayView, op: Op) -> None:
        ctx = self.ctx
        fill_device(view.ptr, view.size, view.dtype, "exact", op, ctx.rank, ctx.size, ctx.gpu, self.ref)

    def poison(self, view: ArrayView) -> None:
        self.runtime.memsetAsync(view.ptr, POISON_BYTE, view.nbytes, self.ref.handle)

    def wrong(self, view: ArrayView, op: Op) -> int:
        return count_wrong_device(view.ptr, view.size, view.dtype, "exact", op, self.ctx.size, self.ctx.gpu, self.ref)

    def digest(self, view: ArrayView) -> str:
        host = np.empty(view.nbytes, np.uint8)
        self.runtime.memcpyAsync(host.ctypes.data, view.ptr, view.nbytes, self.runtime.memcpyDeviceToHost,
                                 self.ref.handle)  # fmt: skip
        self.runtime.streamSynchronize(self.ref.handle)
        return hashlib.sha256(host.tobytes()).hexdigest()


def _check(ctx: Context, dtypes: list[str], ops: list[Op], counts: list[int]) -> list[str]:
    """Every combination out of place (poisoned) and in place; the problems found (collective)."""
    buffers, comm = Buffers(ctx), ctx.comm
    problems = []
    for name in dtypes:
        for op in ops:
            for count in counts:
                x, out = buffers.view(count, name), buffers.view(count, name)
                buffers.fill(x, op)
                buffers.poison(out)
                mpigpu.allreduce(x, op, out=out, comm=comm, backend="host", stream=buffers.ref)
                wrong = buffers.wrong(out, op)
                digest = buffers.digest(out)
                mpigpu.allreduce(x, op, comm=comm, backend="host", stream=buffers.ref)
                same = buffers.digest(x) == digest
                wrong, distinct = comm.allreduce(wrong), len(set(comm.allgather(digest)))
                if wrong or distinct != 1 or comm.allreduce(int(not same)):
                    problems.append(
                        f"{name} {op.value} x{count}: {wrong} wrong, {distinct} distinct, in place equal={same}"
                    )
    return problems


@pytest.fixture(scope="module")
def tiny(comm) -> Iterator[Context]:
    with context_with(comm, TINY) as ctx:
        yield ctx


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_dtype_and_op_both_routes(tiny: Context, dtype: str) -> None:
    problems = _check(tiny, [dtype], list(Op), COUNTS)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_default_pipeline_large(comm, dtype: str) -> None:
    """Default settings: 1 element, a million (split into 4 chunks) and 64 MiB (16 chunks of 4 MiB)."""
    ctx = Context.get(comm)
    counts = [1, 1000003, (64 << 20) // DTYPES[dtype].itemsize]
    problems = _check(ctx, [dtype], [Op.SUM, Op.AVG], counts)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("node_size", [1, 2, 3])
def test_virtual_nodes(comm, node_size: int) -> None:
    if node_size >= comm.Get_size():
        pytest.skip(f"{comm.Get_size()} rank(s) make a single node of size {node_size}")
    with context_with(comm, dict(TINY, MPIGPU_HOST_CHUNK="256K", MPIGPU_NODE_SIZE=str(node_size))) as ctx:
        assert ctx.layout.num_nodes > 1
        dtypes = ["float32", "float16", "bfloat16", "float64"]
        problems = _check(ctx, dtypes, [Op.SUM, Op.AVG, Op.MAX], [7, 70001, 1000003])
        # integer avg across nodes: the exact parts, summed on the host from the slots (docs/nodes.md)
        problems += _check(ctx, ["int32", "int8", "uint64"], [Op.SUM, Op.AVG, Op.MAX], [7, 70001, 1000003])
        assert not problems, "; ".join(problems)


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("count", [1, 1000003, 16 << 20])
def test_framework_arrays(comm, framework: str, count: int) -> None:
    """CuPy arrays and torch tensors, on their framework's current stream (no stream argument)."""
    ctx = Context.get(comm)
    ctx.activate_gpu()
    rank, n = comm.Get_rank(), comm.Get_size()
    expected_sum = np.float32(n * (n - 1) / 2)
    if framework == "torch":
        torch = pytest.importorskip("torch", reason="torch is not installed")
        x = torch.full((count,), float(rank), dtype=torch.float32, device=f"cuda:{ctx.gpu.index}")
        out = torch.full_like(x, float("nan"))
        mpigpu.allreduce(x, "sum", out=out, backend="host")
        assert bool((out == float(expected_sum)).all())
        y = torch.full((count,), float(rank), dtype=torch.bfloat16, device=f"cuda:{ctx.gpu.index}")
        mpigpu.allreduce(y, "avg", backend="host")
        assert bool((y.float() == float(np.float32(expected_sum / n))).all())
    else:
        import cupy

        x = cupy.full(count, rank, dtype=np.float32)
        out = cupy.full(count, np.nan, dtype=np.float32)
        mpigpu.allreduce(x, "sum", out=out, backend="host")
        assert bool((out == expected_sum).all())


@pytest.mark.parametrize("count", [2, 1 << 22])  # the latency route, then the pipeline
def test_stream_order(comm, count: int) -> None:
    """Input produced on a busy non-default stream right before the call (no sync); the result
    consumed right after on the same stream: both must see the call in stream order."""
    import cupy

    ctx = Context.get(comm)
    ctx.activate_gpu()
    rank, n = comm.Get_rank(), comm.Get_size()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = cupy.full(count, np.nan, dtype=np.float32)
        busy = cupy.ones(1 << 26, dtype=np.float32)
        for _ in range(20):  # milliseconds of work queued ahead of the producer
            busy = cupy.sin(busy)
        x.fill(rank + 1)
    mpigpu.allreduce(x, "sum", backend="host", stream=stream)
    with stream:
        y = x * 2  # consumer, enqueued right after the call
        busy = cupy.sin(busy)  # and more work after it, so the call cannot finish early by luck
        total = int((y == n * (n + 1)).sum())
    assert comm.allreduce(total) == count * n


def test_legacy_default_stream(comm) -> None:
    import cupy

    ctx = Context.get(comm)
    ctx.activate_gpu()
    with cupy.cuda.Stream.null:
        for count in (3, 300000):
            x = cupy.full(count, comm.Get_rank(), dtype=np.float64)
            mpigpu.allreduce(x, "max", backend="host", stream=0)
            assert bool((x == comm.Get_size() - 1).all())


def test_phases_at_64_mib(comm) -> None:
    import cupy

    ctx = Context.get(comm)
    ctx.activate_gpu()
    x = cupy.ones(16 << 20, dtype=np.float32)
    for _ in range(3):
        mpigpu.allreduce(x, "avg", backend="host")
    phases = ctx.backend("host").last_phases
    if comm.Get_size() > 1:
        assert {"copy_out", "reduce", "copy_in", "barrier"} <= set(phases), phases
        assert all(phases[k] > 0 for k in ("copy_out", "reduce", "copy_in")), phases
        assert ctx.backend("host").describe()["pinned"]
    assert bool((x == 1).all())


def test_finalize_then_again(comm) -> None:
    """finalize() unpins and frees the segment and the streams; a later call starts afresh."""
    import cupy

    ctx = Context.get(comm)
    ctx.activate_gpu()
    x = cupy.ones(1 << 20, dtype=np.float32)
    mpigpu.allreduce(x, "sum", backend="host")
    backend = ctx.backend("host")
    mpigpu.finalize()
    assert backend._closed and backend._segment is None and backend._gpu is None
    ctx = Context.get(comm)
    ctx.activate_gpu()
    y = cupy.ones(1 << 20, dtype=np.float32)
    mpigpu.allreduce(y, "sum", backend="host")
    assert bool((y == comm.Get_size()).all())
