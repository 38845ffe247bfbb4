"""allreduce_init on GPU arrays under mpirun (2 and 4 ranks): CuPy and torch CUDA inputs on every GPU
backend (nccl, ipc, host, cuda-aware where the MPI is CUDA-aware), exact results with the data
re-read at every start, in place and out of place (poisoned), a start with another stream, done()
after a stream synchronisation, and CUDA graphs of nccl and ipc requests replayed and interleaved
with starts and ordinary calls, every result checked.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpigpu
from mpigpu.core._cuda import StreamRef
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op
from mpigpu.core.patterns import fill
from mpigpu.core.verify import count_wrong_host

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

BACKENDS = ["nccl", "ipc", "host", "cuda-aware"]
_D2H, _H2D = 2, 1


def _need(ctx, backend: str) -> None:
    state = ctx.availability[backend]
    if not state.ok:
        pytest.skip(f"{backend} is not available here: {state.reason}")


class _Arrays:
    """Device arrays of one framework, a stream of its kind, and copies to and from the host on it."""

    def __init__(self, framework: str, ctx) -> None:
        import cupy

        self.cupy, self.framework, self.index = cupy, framework, ctx.gpu.index
        if framework == "torch":
            self.torch = pytest.importorskip("torch", reason="torch is not installed")
            self.stream = self.torch.cuda.Stream(device=self.index)
            self.ref = StreamRef(int(self.stream.cuda_stream))
        else:
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.ref = StreamRef(int(self.stream.ptr))

    def empty(self, count: int, dtype: str):
        if self.framework == "torch":
            return self.torch.empty(count, dtype=getattr(self.torch, dtype), device=f"cuda:{self.index}")
        return self.cupy.empty(count, dtype=DTYPES[dtype].np)

    def ptr(self, arr) -> int:
        return int(arr.data_ptr()) if self.framework == "torch" else int(arr.data.ptr)

    def put(self, arr, host: np.ndarray, ref: StreamRef | None = None) -> None:
        rt = self.cupy.cuda.runtime
        handle = (ref or self.ref).handle
        rt.memcpyAsync(self.ptr(arr), host.ctypes.data, host.nbytes, _H2D, handle)
        rt.streamSynchronize(handle)  # the pageable host copy must not be reused before it is read

    def get(self, arr, like: np.ndarray, ref: StreamRef | None = None) -> np.ndarray:
        host = np.empty_like(like)
        rt = self.cupy.cuda.runtime
        handle = (ref or self.ref).handle
        rt.memcpyAsync(host.ctypes.data, self.ptr(arr), host.nbytes, _D2H, handle)
        rt.streamSynchronize(handle)
        return host

    def poison(self, arr, nbytes: int) -> None:
        self.cupy.cuda.runtime.memsetAsync(self.ptr(arr), 0x7F, nbytes, self.ref.handle)


def _input(count: int, dtype: str, op: Op, comm, offset: int) -> np.ndarray:
    host = np.empty(count, DTYPES[dtype].np)
    fill(host, "exact", op, comm.Get_rank(), comm.Get_size(), offset)
    return host


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_across_starts(ctx, comm, backend: str, framework: str) -> None:
    _need(ctx, backend)
    arrays, n = _Arrays(framework, ctx), comm.Get_size()
    failures = []
    for dtype in ("float32", "float64", "bfloat16"):
        for op in (Op.SUM, Op.AVG, Op.MAX):
            for count in (1, 4099, 1 << 20):
                for in_place in (True, False):
                    x = arrays.empty(count, dtype)
                    out = None if in_place else arrays.empty(count, dtype)
                    req = mpigpu.allreduce_init(x, op.value, out=out, backend=backend, stream=arrays.stream)
                    assert req.backend == backend
                    for start in range(3):
                        host = _input(count, dtype, op, comm, start)
                        arrays.put(x, host)
                        if out is not None:
                            arrays.poison(out, host.nbytes)
                        if start == 1:
                            result = req()
                        else:
                            req.start()
                            result = req.wait()
                        assert result is (x if out is None else out)
                        got = arrays.get(result, host)
                        wrong = comm.allreduce(count_wrong_host(got, "exact", op, DTYPES[dtype], n, start))
                        if wrong:
                            failures.append(f"{dtype} {op.value} {count} start {start}: {wrong} wrong")
                        if out is not None and not np.array_equal(arrays.get(x, host), host):
                            failures.append(f"{dtype} {op.value} {count}: out of place changed x")
                    req.free()
    assert not failures, f"{backend}/{framework}: " + "; ".join(failures[:10])


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_on_another_stream_and_done(ctx, comm, backend: str) -> None:
    _need(ctx, backend)
    arrays, n = _Arrays("cupy", ctx), comm.Get_size()
    other = arrays.cupy.cuda.Stream(non_blocking=True)
    other_ref = StreamRef(int(other.ptr))
    x = arrays.empty(70001, "float32")
    with mpigpu.allreduce_init(x, "sum", backend=backend, stream=arrays.stream) as req:
        host = _input(70001, "float32", Op.SUM, comm, 5)
        arrays.put(x, host, other_ref)
        req.start(stream=other)
        req.wait()
        other.synchronize()
        assert req.done()
        got = arrays.get(x, host, other_ref)
        assert comm.allreduce(count_wrong_host(got, "exact", Op.SUM, DTYPES["float32"], n, 5)) == 0


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_graph_replays_interleaved_with_starts_and_calls(ctx, comm, backend: str, framework: str) -> None:
    _need(ctx, backend)
    arrays, n = _Arrays(framework, ctx), comm.Get_size()
    count = 4099
    x, out, eager = arrays.empty(count, "float32"), arrays.empty(count, "float32"), arrays.empty(count, "float32")
    req = mpigpu.allreduce_init(x, "sum", out=out, backend=backend, stream=arrays.stream)
    req()  # one ordinary start first: set-up synchronises the GPU, which a capture must not see
    graph = req.graph()
    try:
        for step in range(10):
            host = _input(count, "float32", Op.SUM, comm, step)
            arrays.put(x, host)
            arrays.poison(out, count * 4)
            assert graph.launch() is out
            got = arrays.get(out, host)
            assert comm.allreduce(count_wrong_host(got, "exact", Op.SUM, DTYPES["float32"], n, step)) == 0
            arrays.poison(out, count * 4)
            req.start()
            req.wait()
            arrays.poison(eager, count * 4)
            mpigpu.allreduce(x, "sum", out=eager, backend=backend, stream=arrays.stream)
            for result in (out, eager):
                got = arrays.get(result, host)
                assert comm.allreduce(count_wrong_host(got, "exact", Op.SUM, DTYPES["float32"], n, step)) == 0
    finally:
        graph.close()
        req.free()


@pytest.mark.parametrize("backend", ["host", "cuda-aware"])
def test_graph_refused_for_host_blocking_backends(ctx, backend: str) -> None:
    _need(ctx, backend)
    arrays = _Arrays("cupy", ctx)
    req = mpigpu.allreduce_init(arrays.empty(16, "float32"), "sum", backend=backend)
    with req, pytest.raises(mpigpu.InvalidArgument, match="CUDA graph"):
        req.graph()
