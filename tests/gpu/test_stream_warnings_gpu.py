"""No deprecation warnings from the streams mpigpu hands cuda.core and CuPy (issue 39: 10k-20k per GPU
test run), under mpirun (scripts/gpu-check.sh). cuda.core deprecates launching on a foreign stream
object, CuPy 14 deprecates ExternalStream: a kernel launch on a StreamRef, a CuPy stream and a raw
handle, and a CuPy stream over a handle, run with both warnings as errors (on this rank alone); the
collective paths that launch kernels (keys for float min on nccl, widening for float16 on cuda-aware,
the Averager's packing on its side stream) record them instead, and every rank fails alike."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

import mpigpu
from mpigpu.core._cuda import StreamRef, as_core_stream, cupy_stream
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op
from mpigpu.core.patterns import fill
from mpigpu.core.verify import count_wrong_host
from mpigpu.kernels.compile import i32, i64, launch, load_module
from mpigpu.training.averager import Averager

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

DEPRECATIONS = (DeprecationWarning, FutureWarning)
MPIGPU_DIR = os.path.dirname(mpigpu.__file__)


@pytest.fixture(scope="module")
def cp(ctx):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    cupy.cuda.Device(ctx.gpu.index).use()
    return cupy


@contextlib.contextmanager
def _strict() -> Iterator[None]:
    """Deprecations raised as errors (on this rank: wrap no collective in this)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        yield


def test_kernel_launch_on_foreign_streams(ctx, cp) -> None:
    major, minor = ctx.gpu.compute_capability
    kernel = load_module("arith.cu", f"{major}{minor}").kernel("finish_avg_float32")
    stream = cp.cuda.Stream(non_blocking=True)
    n, count = 4, 100003
    want = np.arange(count, dtype=np.float32)  # (4 * i) / 4: exact
    for foreign in (StreamRef(int(stream.ptr)), stream, int(stream.ptr)):
        with stream:
            x = cp.asarray(want * n)
        with _strict():
            launch(foreign, kernel, count, int(x.data.ptr), i64(count), i32(n))
        stream.synchronize()
        assert np.array_equal(x.get(), want), type(foreign).__name__
    ref = StreamRef(int(stream.ptr))
    assert as_core_stream(ref) is as_core_stream(StreamRef(int(stream.ptr)))  # wrapped once


def test_cupy_stream_over_a_handle(ctx, cp) -> None:
    runtime = cp.cuda.runtime
    handle = runtime.streamCreateWithPriority(runtime.streamNonBlocking, 0)
    try:
        with _strict():
            wrapped = cupy_stream(handle)
            with wrapped:
                assert cp.cuda.get_current_stream().ptr == handle
                x = cp.arange(1000, dtype=cp.float32) * 2
        assert wrapped.ptr == handle
        wrapped.synchronize()
        assert np.array_equal(x.get(), np.arange(1000, dtype=np.float32) * 2)
    finally:
        runtime.streamSynchronize(handle)
        runtime.streamDestroy(handle)


def _exact(count: int, dtype: str, op: Op, comm, offset: int = 0) -> np.ndarray:
    x = np.empty(count, DTYPES[dtype].np)
    fill(x, "exact", op, comm.Get_rank(), comm.Get_size(), offset)
    return x


def test_collective_kernel_paths(ctx, comm, cp) -> None:
    size = comm.Get_size()
    calls = [("nccl", "float32", Op.MIN), ("cuda-aware", "float16", Op.AVG)]
    calls = [c for c in calls if ctx.availability[c[0]].ok]  # the same on every rank
    specs = [(37, "float32"), (1000, "float64"), (70001, "float32")]
    hosts = [_exact(n, d, Op.AVG, comm, offset=i) for i, (n, d) in enumerate(specs)]
    arrays = [cp.asarray(h) for h in hosts]
    wrong = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for backend, dtype, op in calls:
            x = cp.asarray(_exact(10007, dtype, op, comm))
            mpigpu.allreduce(x, op, backend=backend)
            wrong.append(count_wrong_host(x.get(), "exact", op, DTYPES[dtype], size))
        averager = Averager(arrays, bucket_bytes=4096)
        averager()
        for i, (a, (_, d)) in enumerate(zip(arrays, specs, strict=True)):
            wrong.append(count_wrong_host(a.get(), "exact", Op.AVG, DTYPES[d], size, i))
        averager.close()
    ours = [  # about streams, or raised at mpigpu's own calls (where the stack level points)
        f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
        for w in caught
        if issubclass(w.category, DEPRECATIONS)
        and ("stream" in str(w.message).lower() or w.filename.startswith(MPIGPU_DIR))
    ]
    everyone = comm.allgather((wrong, ours))
    assert all(not any(w) for w, _ in everyone), everyone
    assert all(not o for _, o in everyone), f"deprecations at mpigpu's calls, (wrong, warnings) per rank: {everyone}"
